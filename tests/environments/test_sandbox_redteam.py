"""Red team: programs that try to escape or exhaust the sandbox. Each test checks that the host is
untouched and the result is typed (the autouse fixture checks the next call works); where the attack
would succeed without isolation, the unsafe backend shows it does (the negative control)."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conf.schema import SandboxLimits
from environments import sandbox
from environments.sandbox import SandboxResult, UnsafeSubprocessBackend
from environments.sandbox.process import cgroup_parents, own_prefix

LIMITS = SandboxLimits(cpu_s=1, memory_mb=256, processes=16, output_bytes=64 * 1024, tmpfs_mb=16)
UNSAFE = UnsafeSubprocessBackend()


def _bwrap_or_skip():
    reason = sandbox.BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


@pytest.fixture(autouse=True)
def next_call_works():
    _bwrap_or_skip()
    yield
    after = sandbox.run("print(6 * 7)", timeout_s=10)
    assert after.ok and after.stdout == "42\n", after
    # only this process's cgroups: a pytest process beside this one runs sandboxes of its own
    for parent in cgroup_parents().values():
        assert not [p.name for p in parent.glob(f"{own_prefix()}*")], "a run left its cgroup behind"


def run(code: str, timeout_s: float = 3.0, backend=None, **kw) -> SandboxResult:
    result = sandbox.run(code, timeout_s=timeout_s, limits=LIMITS, backend=backend, **kw)
    assert isinstance(result, SandboxResult)
    return result


def _processes_with(token: str) -> list[int]:
    """Host processes whose command line holds ``token``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if token.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def test_a_fork_bomb_is_held_to_the_process_limit():
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(500):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "print(n)\n"
    )
    result = run(code)
    assert result.exit_code == 0, result
    assert int(result.stdout) < LIMITS.processes  # without the limit all 500 forks succeed
    assert result.wall_s < 3.0  # the sleeping children died with the run instead of holding it open


def test_an_endless_fork_bomb_ends_at_the_wall_timeout_with_nothing_left():
    result = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert result.killed_by in ("wall", "cpu") and result.wall_s < 6.0, result


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(2 * 1024**3)", "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024**2))"],
)
def test_a_memory_bomb_is_refused_memory(code):
    result = run(code)
    assert result.killed_by == "memory" and result.exit_code != 0, result
    assert run("x = bytearray(64 * 1024**2); print(len(x))").ok  # the same program within the limit


def test_an_infinite_loop_is_killed_at_the_wall_timeout():
    result = run("import time\nwhile True:\n    time.sleep(0.1)", timeout_s=1.0)
    assert result.timed_out and result.killed_by == "wall" and result.exit_code == -signal.SIGKILL
    assert 1.0 <= result.wall_s < 2.5


def test_a_cpu_spin_past_the_limit_is_killed_by_the_cpu_limit():
    result = run("while True:\n    pass", timeout_s=15.0)  # a loaded machine gives less than a core
    assert result.killed_by == "cpu" and not result.timed_out and result.exit_code == -signal.SIGXCPU, result


def test_a_cpu_spin_that_ignores_sigxcpu_is_killed_at_the_hard_limit():
    result = run("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass", 15.0)
    assert result.killed_by == "cpu" and result.exit_code == -signal.SIGKILL, result


def _write_attempt(paths: list[str]) -> str:
    return (
        "import json\n"
        "out = {}\n"
        f"for p in {paths!r}:\n"
        "    try:\n"
        "        open(p, 'w').write('x'); out[p] = 'written'\n"
        "    except OSError as e:\n"
        "        out[p] = type(e).__name__\n"
        "open('inside.txt', 'w').write('fine')\n"
        "print(json.dumps(out))\n"
    )


def test_writing_outside_the_sandbox_leaves_the_host_unchanged(tmp_path):
    name = f"laminar-escaped-{uuid.uuid4().hex}"
    targets = [
        tmp_path / name,
        Path("/usr") / name,
        Path("/") / name,
        Path("/bin") / name,
        Path("/tmp") / name,
    ]
    result = run(_write_attempt([str(p) for p in targets]))
    assert result.ok, result
    outcome = json.loads(result.stdout)
    assert [k for k, v in outcome.items() if v == "written"] == [str(targets[-1])]  # its own private /tmp
    assert not any(p.exists() for p in targets)
    control = run(_write_attempt([str(targets[0])]), backend=UNSAFE)  # only into this test's folder
    assert json.loads(control.stdout)[str(targets[0])] == "written" and targets[0].exists()


def _read_attempt(paths: list[str]) -> str:
    return (
        "import json, os\n"
        "out = {}\n"
        f"for p in {paths!r}:\n"
        "    try:\n"
        "        out[p] = open(p).read()\n"
        "    except OSError as e:\n"
        "        out[p] = None\n"
        "print(json.dumps(out))\n"
    )


def test_the_workspace_is_out_of_view():
    me = str(Path(__file__).resolve())
    code = _read_attempt([me]) + f"print(os.path.exists({str(Path.cwd())!r}), os.path.exists('/work'))\n"
    result = run(code)
    seen, exists = result.stdout.splitlines()
    assert json.loads(seen) == {me: None} and exists == "False False", result
    control = run(code, backend=UNSAFE)
    assert "red team" in json.loads(control.stdout.splitlines()[0])[me]


@pytest.fixture
def home_markers():
    """A marker file planted in ``~/.ray`` and ``~/.prefect`` (removed afterwards)."""
    token = uuid.uuid4().hex
    planted = []
    for folder, name in ((".ray", f"laminar-redteam-{token}"), (".prefect", f"laminar-redteam-{token}.toml")):
        d = Path.home() / folder
        made = not d.exists()
        d.mkdir(exist_ok=True)
        (d / name).write_text(f"PREFECT_API_KEY={token}\n")
        planted.append((d / name, d if made else None))
    yield token, [str(p) for p, _ in planted]
    for p, made in planted:
        p.unlink(missing_ok=True)
        if made is not None:
            made.rmdir()


def test_ray_and_prefect_credentials_are_out_of_view(home_markers):
    token, paths = home_markers
    extra = [str(Path.home() / ".ray" / "auth_token"), str(Path.home() / ".prefect" / "profiles.toml")]
    code = _read_attempt(paths) + (
        f"print(json.dumps([os.path.exists(p) for p in {[*extra, str(Path.home() / '.ray')]!r}]))\n"
    )
    result = run(code)
    seen, exists = result.stdout.splitlines()
    assert set(json.loads(seen).values()) == {None} and json.loads(exists) == [False, False, False], result
    control = run(code, backend=UNSAFE)
    assert all(token in v for v in json.loads(control.stdout.splitlines()[0]).values())


def test_the_parents_secrets_stay_out_of_os_environ_and_proc(monkeypatch):
    secret = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("LAMINAR_REDTEAM_TOKEN", secret)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "HF_TOKEN": secret}
    )
    code = (
        "import glob, os\n"
        f"secret = {secret!r}.encode()\n"
        "env = any(secret in v.encode() for v in os.environ.values())\n"
        "procs = []\n"
        "for p in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        if secret in open(p, 'rb').read():\n"
        "            procs.append(p)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(env, len(procs))\n"
    )
    try:
        time.sleep(0.2)
        assert run(code).stdout == "False 0\n"
        assert run(code, backend=UNSAFE).stdout.split()[1] != "0"  # the host's /proc shows the holder's
        inherited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert inherited.stdout.split()[0] == "True"  # an ordinary child inherits the variable
    finally:
        holder.kill()
        holder.wait()


def test_no_network_not_even_loopback_to_the_host():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "out = []\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=1).close(); out.append('connected')\n"
        "    except OSError as e:\n"
        "        out.append(type(e).__name__)\n"
        "print(out)\n"
    )
    try:
        result = run(code)
        assert result.ok and "connected" not in result.stdout, result
        assert "connected" in run(code, backend=UNSAFE).stdout
    finally:
        server.close()


def test_a_daemon_does_not_outlive_the_call():
    token = f"laminar-daemon-{uuid.uuid4().hex}"
    code = (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.closerange(0, 3)\n"
        "        sleeper = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
        f"        os.execv(sys.executable, [*sleeper, {token!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('parent done')\n"
    )
    detector = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        time.sleep(0.1)
        assert _processes_with(token) == [detector.pid]  # the check sees a live process with the token
    finally:
        detector.kill()
        detector.wait()
    result = run(code)
    assert result.ok and result.stdout == "parent done\n" and result.wall_s < 2.0, result
    time.sleep(0.2)
    assert _processes_with(token) == []


def test_100_mb_of_stdout_is_cut_at_the_cap_without_buffering_it():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run("import sys\nfor _ in range(100):\n    sys.stdout.write('a' * 1024**2)", timeout_s=10)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert result.killed_by == "output" and result.truncated, result.killed_by
    assert len(result.stdout) == LIMITS.output_bytes and grown_mb < 50 and result.wall_s < 5


def test_a_symlink_out_of_the_working_folder_reaches_nothing(tmp_path):
    host_file = tmp_path / "host-secret.txt"
    host_file.write_text("host-secret")
    code = (
        "import os\n"
        f"os.symlink({str(host_file)!r}, 'link')\n"
        "os.symlink('/proc/1/root/etc/hostname', 'link2')\n"
        "out = []\n"
        "for p in ['link', 'link2', '../../../../' + " + repr(str(host_file).lstrip("/")) + "]:\n"
        "    try:\n"
        "        out.append(open(p).read())\n"
        "    except OSError as e:\n"
        "        out.append(type(e).__name__)\n"
        "print(out)\n"
    )
    result = run(code)
    assert result.ok and "host-secret" not in result.stdout, result
    assert not (Path.cwd() / "link").exists()
    assert "host-secret" in run(code, backend=UNSAFE).stdout


def test_killing_the_parent_or_everything_reaches_only_the_sandbox():
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for code in (
            "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')",
            "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\nprint('x')",
            "import os, signal\nos.killpg(0, signal.SIGKILL)",
        ):
            result = run(code)
            assert isinstance(result.exit_code, int) and result.wall_s < 3.0, result
            assert sentinel.poll() is None, "a sandboxed kill reached a host process"
    finally:
        sentinel.kill()
        sentinel.wait()


def test_an_owner_killed_mid_run_leaves_nothing_once_the_next_run_starts():
    """A worker SIGKILLed while its sandboxed program runs cannot remove its cgroup; the next run in
    any process reaps it (and whatever is still inside), and leaves a live owner's cgroups alone."""
    parents = cgroup_parents()
    if not parents:
        pytest.skip("no cgroup this process may create children in")
    owner_code = (
        "from environments import sandbox\nsandbox.run('import time\\ntime.sleep(60)', timeout_s=60)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    owner = subprocess.Popen(
        [sys.executable, "-c", owner_code], cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo))
    )
    prefix = f"laminar-sandbox-{owner.pid}-"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(list(p.glob(f"{prefix}*")) for p in parents.values()):
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()
    left = [d for p in parents.values() for d in p.glob(f"{prefix}*")]
    assert left, "the owner never started a run, or its cgroup went with it"
    live = [p / f"{own_prefix()}still-mine" for p in parents.values()]
    for d in live:
        d.mkdir()
    try:
        assert run("print(1)").stdout == "1\n"  # the next run reaps
        assert not [d.name for d in left if d.exists()], "the orphaned cgroup outlived the next run"
        assert all(d.exists() for d in live), "a live owner's cgroup was reaped"
    finally:
        for d in live:
            d.rmdir()
