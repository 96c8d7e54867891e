"""The sandbox's last gaps (issue 55), each closed with per-run cgroups and without them (the fallback
of hosts that give none, forced here with ``LAMINAR_SANDBOX_CGROUPS=0``): every writable tmpfs sized
within the memory limit; ``killed_by`` from the kernel's word, never from the exit code or output;
no ptrace of the sandbox's init; only the standard library importable unless a run opts into
packages; no host path in ``/proc``."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from conf.schema import SandboxLimits
from environments import sandbox
from environments.sandbox import BubblewrapBackend, UnsafeSubprocessBackend
from environments.sandbox import process
from environments.sandbox.process import NO_CGROUPS_ENV, cgroup_parents

LIMITS = SandboxLimits(cpu_s=2, memory_mb=256, processes=16, output_bytes=64 * 1024)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def bwrap_or_skip():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


@pytest.fixture(params=["cgroups", "no-cgroups"])
def cgroups(request, monkeypatch) -> bool:
    """Each test once with the run's cgroups (where the host gives them) and once on the fallback."""
    if request.param == "cgroups":
        if not cgroup_parents():
            pytest.skip("this host gives no per-run cgroups")
        return True
    monkeypatch.setenv(NO_CGROUPS_ENV, "0")
    assert cgroup_parents() == {}
    return False


def run(code: str, timeout_s: float = 10.0, limits: SandboxLimits = LIMITS, **kw):
    return sandbox.run(code, timeout_s=timeout_s, limits=limits, **kw)


# ------------------------------------------------------------------ tmpfs within the memory limit
WRITABLE_MOUNTS = (
    "import json, os\n"
    "sizes = {}\n"
    "for line in open('/proc/self/mounts').read().splitlines():\n"
    "    point = line.split()[1]\n"
    "    try:\n"
    "        open(os.path.join(point, '.probe'), 'w').close()\n"
    "    except OSError:\n"
    "        continue\n"
    "    st = os.statvfs(point)\n"
    "    sizes[point] = st.f_blocks * st.f_frsize // 2**20\n"
    "written = {}\n"
    "for folder in ('/dev/shm', '/dev'):\n"  # 1 MiB files, each under RLIMIT_FSIZE
    "    n = 0\n"
    "    try:\n"
    "        while n < 512:\n"
    "            with open(os.path.join(folder, f'fill{n}'), 'wb') as f:\n"
    "                f.write(b'x' * 2**20)\n"
    "            n += 1\n"
    "    except OSError:\n"
    "        pass\n"
    "    written[folder] = n\n"
    "print(json.dumps({'sizes': sizes, 'written': written}))\n"
)


def test_every_writable_tmpfs_is_sized_within_the_memory_limit(cgroups):
    limits = SandboxLimits(cpu_s=5, memory_mb=256, processes=16, tmpfs_mb=512)  # tmpfs_mb asks for more
    result = run(WRITABLE_MOUNTS, timeout_s=30, limits=limits)
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert set(seen["sizes"]) == {"/sandbox", "/tmp", "/dev/shm"}, seen  # /dev itself is read-only
    assert sum(seen["sizes"].values()) <= limits.memory_mb, seen
    assert seen["written"]["/dev"] == 0 and seen["written"]["/dev/shm"] <= limits.memory_mb // 3, seen


def test_the_working_folder_keeps_its_size_where_memory_allows(cgroups):
    result = run(WRITABLE_MOUNTS.replace("('/dev/shm', '/dev')", "()"), limits=SandboxLimits(tmpfs_mb=48))
    assert json.loads(result.stdout)["sizes"] == {"/sandbox": 48, "/tmp": 48, "/dev/shm": 48}


SYSV_SHM = (
    "import ctypes, json\n"
    "from multiprocessing import shared_memory\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.shmat.restype = ctypes.c_void_p\n"
    "held = 0\n"
    "for _ in range(4):\n"  # 4 x 100 MB, each detached (out of RLIMIT_AS) but kept in the kernel
    "    sid = libc.shmget(0, 100 * 2**20, 0o1600)\n"
    "    if sid < 0:\n"
    "        break\n"
    "    addr = libc.shmat(sid, None, 0)\n"
    "    ctypes.memset(addr, 1, 100 * 2**20)\n"
    "    libc.shmdt(ctypes.c_void_p(addr))\n"
    "    held += 100\n"
    "posix = shared_memory.SharedMemory(create=True, size=2**20)\n"  # what multiprocessing uses
    "posix.close(); posix.unlink()\n"
    "print(json.dumps([held, ctypes.get_errno()]))\n"
)


def test_system_v_shared_memory_is_refused_and_posix_shared_memory_works(cgroups):
    """A fresh IPC namespace puts no limit on System V segments (the kernel's own tmpfs), and a
    detached segment is outside every rlimit: the seccomp filter refuses ``shmget``."""
    result = run(SYSV_SHM, limits=SandboxLimits(cpu_s=5, memory_mb=256))
    assert result.ok and json.loads(result.stdout) == [0, 1], result  # EPERM, nothing held


def test_a_system_call_through_the_x32_abi_kills_the_process(cgroups):
    if os.uname().machine != "x86_64":
        pytest.skip("x32 is an x86-64 ABI")
    code = "import ctypes\nprint(ctypes.CDLL(None).syscall(0x40000000 | 39))"  # x32 getpid
    result = run(code)
    assert result.exit_code == -signal.SIGSYS and result.killed_by == "signal", result


# ------------------------------------------------------------------ killed_by from the kernel's word
@pytest.mark.parametrize(
    "code, exit_code, killed_by",
    [
        ("import sys\nsys.exit(137)", 137, None),  # looks like SIGKILL
        ("import sys\nsys.exit(152)", 152, None),  # looks like SIGXCPU
        ("import sys\nsys.exit(153)", 153, None),  # looks like SIGXFSZ
        ("import sys\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)", 1, None),
        ("raise MemoryError('no allocation was refused')", 1, None),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)", -signal.SIGXCPU, "signal"),  # no CPU used
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, "signal"),
    ],
)
def test_an_exit_code_or_output_that_looks_like_a_limit_is_not_one(cgroups, code, exit_code, killed_by):
    result = run(code)
    assert (result.exit_code, result.killed_by) == (exit_code, killed_by), result


@pytest.mark.parametrize("code", ["import sys\nsys.exit(152)", "raise MemoryError"])
def test_the_unsafe_backend_reads_the_same_kernel_word(code):
    result = run(code, backend=UnsafeSubprocessBackend())
    assert result.killed_by is None and result.exit_code in (152, 1), result


def test_a_real_memory_overrun_is_named_only_where_the_kernel_counts_it(cgroups):
    result = run("x = bytearray(2 * 1024**3)")
    assert result.exit_code != 0
    if cgroups:  # the memory cgroup's OOM kill, counted in memory.oom_control
        assert result.killed_by == "memory" and result.exit_code == -signal.SIGKILL, result
    else:  # RLIMIT_AS refused the allocation: the program saw a MemoryError; nothing killed it
        assert result.killed_by is None and "MemoryError" in result.stderr, result


def test_a_real_cpu_overrun_is_still_named(cgroups):
    result = run("while True:\n    pass", timeout_s=20, limits=SandboxLimits(cpu_s=1))
    assert result.killed_by == "cpu" and result.exit_code == -signal.SIGXCPU, result


# ------------------------------------------------------------------ no ptrace outside the program
PTRACE_INIT = (
    "import ctypes, errno, json, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "out = {'parent': os.getppid()}\n"
    "for name, request in (('attach', 16), ('seize', 0x4206)):\n"
    "    if libc.ptrace(request, os.getppid(), 0, 0) == 0:\n"
    "        out[name] = 'attached'\n"
    "        libc.ptrace(17, os.getppid(), 0, 0)\n"  # PTRACE_DETACH
    "    else:\n"
    "        out[name] = errno.errorcode[ctypes.get_errno()]\n"
    "def fds():\n"
    "    return [os.readlink(f'/proc/1/fd/{n}') for n in os.listdir('/proc/1/fd')]\n"
    "for name, probe in (('mem', lambda: open('/proc/1/mem', 'rb').close()), ('fd', fds)):\n"
    "    try:\n"
    "        probe()\n"
    "        out[name] = 'opened'\n"
    "    except OSError as e:\n"
    "        out[name] = errno.errorcode[e.errno]\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    import time; time.sleep(5); os._exit(0)\n"
    "out['own_child'] = 'attached' if libc.ptrace(16, child, 0, 0) == 0 else 'refused'\n"
    "os.kill(child, 9)\n"
    "print(json.dumps(out))\n"
)


def test_the_program_cannot_ptrace_the_sandboxs_init(cgroups):
    result = run(PTRACE_INIT, timeout_s=5)
    assert result.ok and not result.timed_out, result
    out = json.loads(result.stdout)
    assert out == {
        "parent": 1,
        "attach": "EPERM",
        "seize": "EPERM",
        "mem": "EACCES",
        "fd": "EACCES",
        "own_child": "attached",  # its own processes stay its own business
    }, out


# ------------------------------------------------------------------ only the standard library
THIRD_PARTY = ("yaml", "requests", "botocore", "awscli")
IMPORT_HUNT = (
    "import importlib, json, os, subprocess, sys\n"
    f"names = {THIRD_PARTY!r}\n"
    "found = set()\n"
    "for d, dirs, files in os.walk('/'):\n"
    "    if d in ('/proc', '/sys', '/dev'):\n"
    "        dirs[:] = []\n"
    "        continue\n"
    "    if os.path.basename(d) in ('site-packages', 'dist-packages'):\n"
    "        found.add(d)\n"
    "    found.update(d for n in names if n in dirs and os.path.isfile(os.path.join(d, n, '__init__.py')))\n"
    "sys.path += sorted(found)\n"
    "got = []\n"
    "for n in names:\n"
    "    try:\n"
    "        importlib.import_module(n); got.append(n)\n"
    "    except Exception:\n"
    "        pass\n"
    "py3 = [p for p in ('/usr/bin/python3',) if os.path.exists(p)]\n"
    "system = [subprocess.run([p, '-c', 'import yaml'], capture_output=True).returncode for p in py3]\n"
    "print(json.dumps({'importable': got, 'system_python_yaml': [c == 0 for c in system]}))\n"
)


def test_only_the_standard_library_is_importable(cgroups):
    result = run(IMPORT_HUNT, timeout_s=60, limits=SandboxLimits(cpu_s=30, processes=16))
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert seen["importable"] == [] and not any(seen["system_python_yaml"]), seen
    control = run(
        IMPORT_HUNT.replace("os.walk('/')", "os.walk(sys.base_prefix)"), backend=UnsafeSubprocessBackend()
    )
    assert "yaml" in json.loads(control.stdout)["importable"]  # the host's interpreter has it


def test_a_run_opts_into_named_packages_read_only(cgroups):
    code = (
        "import json, os, yaml\n"
        "try:\n"
        "    open(os.path.join(os.path.dirname(yaml.__file__), 'x.py'), 'w')\n"
        "    wrote = True\n"
        "except OSError:\n"
        "    wrote = False\n"
        "try:\n"
        "    import requests\n"
        "    other = True\n"
        "except ImportError:\n"
        "    other = False\n"
        "print(json.dumps([yaml.safe_load('a: 1'), yaml.__file__, wrote, other]))\n"
    )
    result = run(code, packages=["yaml"])
    assert json.loads(result.stdout) == [{"a": 1}, "/packages/yaml/__init__.py", False, False], result
    assert json.loads(run(code, packages=["yaml"], backend=UnsafeSubprocessBackend()).stdout)[0] == {"a": 1}


@pytest.mark.parametrize("packages, match", [(["no_such_pkg_x"], "not importable"), (["a.b"], "top-level")])
def test_an_unknown_package_is_refused_before_running(packages, match):
    with pytest.raises(ValueError, match=match):
        sandbox.run("pass", packages=packages)


# ------------------------------------------------------------------ no host path in /proc
PROC_SCAN = (
    "import json, os\n"
    "seen = []\n"
    "for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:\n"
    "    for name in ('cmdline', 'environ', 'mountinfo', 'cwd', 'exe', 'root'):\n"
    "        path = f'/proc/{pid}/{name}'\n"
    "        try:\n"
    "            link = name in ('cwd', 'exe', 'root')\n"
    "            text = os.readlink(path) if link else open(path, 'rb').read().decode()\n"
    "        except OSError:\n"
    "            continue\n"
    "        seen.append([path, text])\n"
    "print(json.dumps(seen))\n"
)


def test_no_host_path_shows_in_proc(cgroups):
    result = run(PROC_SCAN)
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert any(path == "/proc/1/cmdline" for path, _ in seen)  # the scan reads pid 1
    host = {str(REPO), os.getcwd(), sys.prefix, "/work"}
    leaks = [(path, h) for path, text in seen for h in host if h in text]
    assert leaks == [], leaks


# ------------------------------------------------------------------ the fallback says what it lacks
@pytest.mark.skipif(os.geteuid() != 0, reason="RLIMIT_NPROC binds every uid but 0")
def test_root_without_a_pids_cgroup_is_warned_that_processes_are_uncapped(monkeypatch, caplog):
    monkeypatch.setenv(NO_CGROUPS_ENV, "0")
    process._warn_uncontained.cache_clear()
    with caplog.at_level(logging.WARNING, logger="environments.sandbox.process"):
        assert run("print(1)").stdout == "1\n" and run("print(2)").stdout == "2\n"
    warnings = [r.message for r in caplog.records if "fork bomb" in r.message]
    assert len(warnings) == 1 and "without a pids cgroup" in warnings[0]
