"""Running one sandboxed process: a cgroup for the whole run where the host allows one, the
bootstrap that sets the rlimits inside, output read incrementally under a cap, the wall timeout that
kills the process group, and the classification of how the run ended."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from environments.sandbox.result import MAIN, Job, KilledBy, SandboxResult

BOOTSTRAP = (
    "import os, resource, sys, types\n"
    "for _item in sys.argv[1].split():\n"
    "    _k, _s, _h = _item.split(':')\n"
    "    resource.setrlimit(getattr(resource, _k), (int(_s), int(_h)))\n"
    f"sys.argv = [{MAIN!r}]\n"
    "sys.path[0] = os.getcwd()\n"
    "_main = types.ModuleType('__main__')\n"
    f"_main.__file__ = {MAIN!r}\n"
    "sys.modules['__main__'] = _main\n"
    "try:\n"
    f"    with open({MAIN!r}, 'rb') as _f:\n"
    f"        _code = compile(_f.read(), {MAIN!r}, 'exec')\n"
    "    exec(_code, _main.__dict__)\n"
    "except SystemExit:\n"
    "    raise\n"
    "except BaseException as _e:\n"
    "    import traceback\n"
    "    _tb = _e.__traceback__\n"
    f"    while _tb is not None and _tb.tb_frame.f_code.co_filename != {MAIN!r}:\n"
    "        _tb = _tb.tb_next\n"
    "    traceback.print_exception(type(_e), _e, _tb)\n"
    "    sys.exit(1)\n"
)
"""What the sandboxed interpreter runs first: the job's rlimits (``sys.argv[1]``: ``NAME:soft:hard``
items), then the program as ``__main__``, compiled and run in place (json and runpy would add 50 ms
of imports to every run's start-up); a traceback shows the program's frames only. The limits bind
before any line of the program runs."""

SAFE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONUNBUFFERED": "1",
    "PYTHONHASHSEED": "0",
}
"""The whole environment of a sandboxed program (plus HOME and TMPDIR): nothing of the parent's."""

JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
"""``sh -c`` script: move this shell into each cgroup named before ``--``, then exec the command, so
the run is inside its cgroup before its first instruction (no pre-exec hook in a threaded parent)."""

MIB = 1024 * 1024
CONTROLLERS = ("pids", "memory", "cpuacct")
EXIT_GRACE_S = 0.2
"""After the program exits, how long to keep reading pipes that a leftover process still holds."""


def _v1_dirs() -> dict[str, Path]:
    """controller -> this process's cgroup folder, for the v1 ``pids``, ``memory`` and ``cpuacct``
    hierarchies."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in CONTROLLERS:
            root = Path("/sys/fs/cgroup") / c
            if c in controllers.split(",") and (root / "cgroup.procs").exists():
                out[c] = root / path.lstrip("/")
    return out


@cache
def cgroup_parents() -> dict[str, Path]:
    """The v1 ``pids``/``memory``/``cpuacct`` folders this process may create child cgroups in (probed once by
    creating and removing one); empty where the host does not allow it (not root, cgroup v2 only)."""
    out = {}
    try:
        dirs = _v1_dirs()
    except OSError:
        return {}
    for c, parent in dirs.items():
        probe = parent / f"laminar-probe-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
            probe.rmdir()
            out[c] = parent
        except OSError:
            continue
    return out


PREFIX = "laminar-sandbox-"


def own_prefix() -> str:
    """Name prefix of the cgroups this process creates: the owner's pid is in the name, so a process
    (or a test) can tell its own runs from a neighbour's, and an owner's death can be detected."""
    return f"{PREFIX}{os.getpid()}-"


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(parents: dict[str, Path] | None = None) -> list[str]:
    """Remove the cgroups of runs whose owner process died mid-run (SIGKILLed worker, OOM-killed
    trainer): kill what is still inside them, then rmdir. Returns the names removed. Cgroups of live
    owners, this process's included, are left alone."""
    removed = []
    for parent in (parents if parents is not None else cgroup_parents()).values():
        for d in parent.glob(f"{PREFIX}*"):
            owner, _, rest = d.name[len(PREFIX) :].partition("-")
            if not rest or not owner.isdigit() or _owner_alive(int(owner)):
                continue
            orphan = Cgroup({"_": d})
            orphan.kill_all()
            orphan.remove()
            if not d.exists():
                removed.append(d.name)
    return removed


@dataclass
class Cgroup:
    """The cgroups of one run: ``pids`` caps its processes (RLIMIT_NPROC does not bind uid 0),
    ``memory`` caps its total memory, ``cpuacct`` counts its CPU time; every process of the run is in
    them, daemons included."""

    dirs: dict[str, Path]

    @classmethod
    def create(cls, job: Job) -> Cgroup | None:
        parents = cgroup_parents()
        if not parents:
            return None
        reap_orphans(parents)
        name = f"{own_prefix()}{uuid.uuid4().hex[:12]}"
        dirs = {c: p / name for c, p in parents.items()}
        made = cls({})
        try:
            for c, d in dirs.items():
                d.mkdir()
                made.dirs[c] = d
            if "pids" in dirs:
                (dirs["pids"] / "pids.max").write_text(str(job.limits.processes))
            if "memory" in dirs:
                limit = str(job.limits.memory_mb * MIB)
                (dirs["memory"] / "memory.limit_in_bytes").write_text(limit)
                swap = dirs["memory"] / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    swap.write_text(limit)
        except OSError:
            made.remove()
            return None
        return made

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def _counter(self, controller: str, file: str, key: str) -> int:
        try:
            for line in (self.dirs[controller] / file).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (KeyError, OSError, ValueError):
            pass
        return 0

    def oom_kills(self) -> int:
        return self._counter("memory", "memory.oom_control", "oom_kill")

    def fork_refusals(self) -> int:
        return self._counter("pids", "pids.events", "max")

    def cpu_s(self) -> float:
        """CPU seconds of every process of the run (0 without ``cpuacct``)."""
        try:
            return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except (KeyError, OSError, ValueError):
            return 0.0

    def pids(self) -> set[int]:
        out: set[int] = set()
        for f in self.procs_files():
            try:
                out.update(int(x) for x in Path(f).read_text().split())
            except OSError:
                pass
        return out

    def kill_all(self, attempts: int = 200) -> None:
        """SIGKILL every process left in the run's cgroups, until none is left."""
        for _ in range(attempts):
            left = self.pids()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        for d in self.dirs.values():
            for _ in range(200):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def memfd(name: str, data: bytes) -> int:
    """A readable in-memory file holding ``data``, positioned at its start (inherited by the child)."""
    fd = os.memfd_create(name, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass
class _Output:
    cap: int
    data: bytearray
    cut: bool = False

    def add(self, chunk: bytes) -> bool:
        """Keep what fits under the cap; False once something had to be dropped."""
        room = self.cap - len(self.data)
        self.data += chunk[: max(0, room)]
        if len(chunk) > room:
            self.cut = True
        return not self.cut


def _exited(pid: int) -> bool:
    """Whether ``pid`` has ended, without reaping it (its process group id stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[_Output, _Output, KilledBy | None]:
    """Read stdout and stderr as they come, up to ``cap`` bytes each, until both close, the program
    ended ``EXIT_GRACE_S`` ago, the deadline passes (``'wall'``) or output passes the cap (``'output'``)."""
    streams = {
        proc.stdout.fileno(): _Output(cap, bytearray()),
        proc.stderr.fileno(): _Output(cap, bytearray()),
    }
    out, err = streams.values()
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    ended_at = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                return out, err, "wall"
            if ended_at is None and _exited(proc.pid):
                ended_at = now
            if ended_at is not None and now - ended_at > EXIT_GRACE_S:
                break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                elif not streams[key.fd].add(chunk):
                    return out, err, "output"
    finally:
        sel.close()
    return out, err, None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(
    reason: KilledBy | None, code: int, cpu_s: float, stderr: str, job: Job, cgroup: Cgroup | None
) -> KilledBy | None:
    """Which limit ended the run, from what the parent saw (its own kill), the exit status, the CPU
    time used (a SIGKILL past ``cpu_s`` is RLIMIT_CPU's hard limit), the last line of stderr and the
    cgroups' counters."""
    if reason is not None:
        return reason
    sig = -code if code < 0 else 0
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= job.limits.cpu_s):
        return "cpu"
    if sig == signal.SIGXFSZ:
        return "file_size"
    lines = stderr.rstrip().splitlines()
    if (cgroup and cgroup.oom_kills()) or (code != 0 and lines and lines[-1].startswith("MemoryError")):
        return "memory"
    if code != 0 and cgroup and cgroup.fork_refusals():
        return "processes"
    if sig:
        return "signal"
    return None


def execute(
    argv: Sequence[str],
    job: Job,
    *,
    backend: str,
    env: dict[str, str],
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    decode_exit=lambda code: code,
) -> SandboxResult:
    """Run ``argv`` (which runs ``BOOTSTRAP``) as one sandboxed job in its own process group and
    cgroup, feed it ``job.stdin``, collect its capped output and kill everything of it at the end.
    ``decode_exit``: the backend's exit status -> the program's (a wrapper may report signals as
    128 + N)."""
    cgroup = Cgroup.create(job)
    stdin_fd = memfd("stdin", job.stdin)
    prefix = ["/bin/sh", "-c", JOIN_CGROUPS, "sh", *cgroup.procs_files(), "--"] if cgroup else []
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [*prefix, *argv],
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            pass_fds=tuple(pass_fds),
            start_new_session=True,
        )
    finally:
        os.close(stdin_fd)
        for fd in pass_fds:
            os.close(fd)
    try:
        out, err, reason = _collect(proc, start + job.timeout_s, job.limits.output_bytes)
        _kill_group(proc.pid)
        if cgroup:
            cgroup.kill_all()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - start
        proc.stdout.close()
        proc.stderr.close()
        code = decode_exit(proc.returncode) if reason is None else proc.returncode
        stderr = err.data.decode("utf-8", "replace")
        cpu_s = max(usage.ru_utime + usage.ru_stime, cgroup.cpu_s() if cgroup else 0.0)
        killed = _classify(reason, code, cpu_s, stderr, job, cgroup)
        return SandboxResult(
            stdout=out.data.decode("utf-8", "replace"),
            stderr=stderr,
            exit_code=code,
            timed_out=reason == "wall",
            killed_by=killed,
            wall_s=wall,
            truncated=out.cut or err.cut,
            backend=backend,
        )
    finally:
        if proc.returncode is None:
            _kill_group(proc.pid)
            proc.wait()
        if cgroup:
            cgroup.kill_all()
            cgroup.remove()


def bootstrap_args(python: str, job: Job, nproc: bool = True) -> list[str]:
    """The interpreter command that sets ``job``'s rlimits and runs ``main.py`` of the working folder."""
    limits = " ".join(f"{k}:{s}:{h}" for k, (s, h) in job.rlimits(nproc).items())
    return [python, "-S", "-s", "-B", "-c", BOOTSTRAP, limits]
