"""``environments.sandbox.run``: what a program gets (stdin, files, exit status, output), how limits
are reported, the backend interface, and the refusal where bubblewrap cannot run."""

from __future__ import annotations

import logging
import signal
import threading

import pytest

from conf.loader import load_config
from conf.schema import ConfigError, SandboxConfig, SandboxLimits
from environments import sandbox
from environments.sandbox import (
    BubblewrapBackend,
    Job,
    SandboxBackend,
    SandboxResult,
    SandboxUnavailable,
    UnsafeSubprocessBackend,
)

SMALL = SandboxLimits(cpu_s=1, memory_mb=256, processes=16, output_bytes=4096)


@pytest.fixture(autouse=True)
def bwrap_or_skip():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


@pytest.fixture
def fresh_selection(monkeypatch):
    """select_backend's once-per-process choice, emptied for this test and restored after it."""
    monkeypatch.setattr(sandbox, "_chosen", {})


def test_a_program_reads_stdin_and_its_files_and_reports_its_exit_status():
    code = "import sys\nprint(sys.stdin.read().upper(), open('data/in.txt').read())\nsys.exit(3)"
    result = sandbox.run(code, stdin="abc", files={"data/in.txt": "file text"}, limits=SMALL)
    assert result == SandboxResult(
        stdout="ABC file text\n",
        stderr="",
        exit_code=3,
        timed_out=False,
        killed_by=None,
        wall_s=result.wall_s,
        truncated=False,
        backend="bubblewrap",
    )
    assert not result.ok and 0 < result.wall_s < 5


def test_a_traceback_shows_the_programs_frames_only():
    result = sandbox.run("def f():\n    return 1 / 0\nf()", limits=SMALL)
    assert result.exit_code == 1 and result.killed_by is None
    assert result.stderr.startswith("Traceback") and "runpy" not in result.stderr
    assert 'File "main.py", line 2, in f' in result.stderr and "ZeroDivisionError" in result.stderr


def test_a_signal_is_a_negative_exit_code_and_named():
    result = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", limits=SMALL)
    assert result.exit_code == -signal.SIGTERM and result.killed_by == "signal"
    big = sandbox.run("open('f', 'wb').write(b'x' * (2 * 1024**2))", limits=SandboxLimits(file_size_mb=1))
    assert big.exit_code != 0 and "File too large" in big.stderr


def test_stderr_is_capped_like_stdout():
    result = sandbox.run("import sys\nsys.stderr.write('e' * 100_000)", limits=SMALL)
    assert result.killed_by == "output" and result.truncated and len(result.stderr) == 4096


def test_the_working_folder_is_private_to_each_run():
    sandbox.run("open('left.txt', 'w').write('x')", limits=SMALL)
    result = sandbox.run("import os\nprint(sorted(os.listdir('.')), os.getcwd())", limits=SMALL)
    assert result.stdout == "['main.py'] /sandbox\n"


@pytest.mark.parametrize("name", ["/etc/x", "../x", "a/../../x", "main.py", ""])
def test_a_file_outside_the_working_folder_is_refused_before_running(name):
    with pytest.raises(ValueError, match="relative path inside the working folder"):
        sandbox.run("pass", files={name: "x"})


def test_concurrent_runs_keep_their_own_output():
    results: dict[int, SandboxResult] = {}

    def one(i: int) -> None:
        results[i] = sandbox.run(f"import time\ntime.sleep(0.2)\nprint({i})", limits=SMALL)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i}\n" for i in range(8)}


class EchoBackend:
    """A stand-in remote sandbox: anything with name, unavailable() and execute(job) plugs in."""

    name = "echo"

    def unavailable(self):
        return None

    def execute(self, job: Job) -> SandboxResult:
        return SandboxResult(job.code, "", 0, False, None, 0.0, False, self.name)


def test_a_backend_of_your_own_plugs_in():
    backend = EchoBackend()
    assert isinstance(backend, SandboxBackend) and isinstance(BubblewrapBackend(), SandboxBackend)
    assert sandbox.run("print(1)", backend=backend).stdout == "print(1)"


def test_where_bubblewrap_cannot_run_the_call_is_refused_saying_why(monkeypatch, fresh_selection):
    broken = BubblewrapBackend(bwrap="/bin/false")
    assert "bwrap could not start a sandbox" in broken.unavailable()
    monkeypatch.setattr(sandbox, "BubblewrapBackend", lambda: broken)
    with pytest.raises(SandboxUnavailable, match="user namespaces.*sandbox.allow_unsafe=true"):
        sandbox.run("print(1)")


def test_the_unsafe_opt_in_runs_and_warns_on_every_run(monkeypatch, fresh_selection, caplog):
    monkeypatch.setattr(sandbox, "BubblewrapBackend", lambda: BubblewrapBackend(bwrap="/bin/false"))
    cfg = SandboxConfig(allow_unsafe=True)
    with caplog.at_level(logging.WARNING, logger="environments.sandbox.backends"):
        results = [sandbox.run("print('hi')", config=cfg) for _ in range(2)]
    assert [(r.backend, r.stdout) for r in results] == [("unsafe", "hi\n")] * 2
    warnings = [r.message for r in caplog.records if "WITHOUT isolation" in r.message]
    assert len(warnings) == 2 and "bubblewrap cannot run" in warnings[0]


def test_the_unsafe_backend_keeps_the_limits():
    result = sandbox.run(
        "while True:\n    pass", backend=UnsafeSubprocessBackend(), limits=SMALL, timeout_s=15
    )
    assert result.killed_by == "cpu" and result.backend == "unsafe"


def test_the_sandbox_section_composes_and_refuses_unsafe_without_the_opt_in():
    cfg = load_config(["sandbox.timeout_s=2", "sandbox.limits.memory_mb=128"])
    assert cfg.sandbox.timeout_s == 2 and cfg.sandbox.limits.memory_mb == 128 and not cfg.sandbox.allow_unsafe
    assert load_config(["sandbox.backend=unsafe", "sandbox.allow_unsafe=true"]).sandbox.backend == "unsafe"
    with pytest.raises(ConfigError, match="set sandbox.allow_unsafe=true"):
        load_config(["sandbox.backend=unsafe"])
    with pytest.raises(ConfigError, match="sandbox.limits.cpu_s=0"):
        load_config(["sandbox.limits.cpu_s=0"])
