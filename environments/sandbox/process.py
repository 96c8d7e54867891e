"""Running one sandboxed process: a cgroup for the whole run where the host allows one, the
bootstrap that sets the rlimits inside, output read incrementally under a cap, the wall timeout that
kills the process group, and the classification of how the run ended."""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from environments.sandbox.result import MAIN, Job, KilledBy, SandboxResult

log = logging.getLogger(__name__)

BOOTSTRAP = f"""\
import _signal, os, resource, sys, types
_fd, _limits, _paths = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if _fd >= 0:
    import _ctypes
    class _Int(_ctypes._SimpleCData):
        _type_ = 'i'
    class _Fn(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL
        _restype_ = _Int
    _prctl = _Fn(_ctypes.dlsym(_ctypes.dlopen(None), 'prctl'))
    _prctl(4, 0, 0, 0, 0)
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    _child = os.fork()
    if _child:
        for _std in (0, 1, 2):
            os.close(_std)
        while True:
            _pid, _status, _ru = os.wait4(-1, 0)
            if _pid == _child:
                break
        os.write(_fd, b'%d %.6f' % (_status, _ru.ru_utime + _ru.ru_stime))
        os._exit(0)
    os.close(_fd)
    _prctl(4, 1, 0, 0, 0)
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
for _item in _limits.split():
    _k, _s, _h = _item.split(':')
    resource.setrlimit(getattr(resource, _k), (int(_s), int(_h)))
sys.argv = [{MAIN!r}]
sys.path[0] = os.getcwd()
sys.path += [_p for _p in _paths.split(os.pathsep) if _p]
_main = types.ModuleType('__main__')
_main.__file__ = {MAIN!r}
sys.modules['__main__'] = _main
try:
    with open({MAIN!r}, 'rb') as _f:
        _code = compile(_f.read(), {MAIN!r}, 'exec')
    exec(_code, _main.__dict__)
except SystemExit:
    raise
except BaseException as _e:
    import traceback
    _tb = _e.__traceback__
    while _tb is not None and _tb.tb_frame.f_code.co_filename != {MAIN!r}:
        _tb = _tb.tb_next
    traceback.print_exception(type(_e), _e, _tb)
    sys.exit(1)
"""
"""What the sandboxed interpreter runs first. Arguments: the report fd, the job's rlimits
(``NAME:soft:hard`` items) and extra ``sys.path`` entries (the opted-in packages).

With a report fd (bubblewrap), this interpreter is the sandbox's pid 1 (``bwrap --as-pid-1``): it
makes itself non-dumpable (``PR_SET_DUMPABLE`` 0: no ptrace, ``/proc/1/mem`` or ``/proc/1/fd`` of it
for the program), forks the program, reaps every process that ends up its child and, when the
program ends, writes the program's wait status and CPU seconds (``wait4``: the kernel's word) to
the fd, which the program never holds (the child closes it before its first line). A pid 1 gets no
signal from inside its namespace that it has no handler for, so the program can neither kill nor
stop it. Without a report fd (the unsafe backend) the interpreter is the program itself. (``_signal``
and ``_ctypes``, not ``signal`` and ``ctypes``: their imports pull in enum and struct, 10-20 ms.)

Then the rlimits, then the program as ``__main__``, compiled and run in place (json and runpy
would add 50 ms of imports to every run's start-up); a traceback shows the program's frames only.
The limits bind before any line of the program runs."""

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
CONTROLLERS = ("pids", "memory")
NO_CGROUPS_ENV = "LAMINAR_SANDBOX_CGROUPS"
"""Set to ``0`` to run without per-run cgroups where the host gives them (the fallback of hosts that
do not: non-root, cgroup v2 only), e.g. to test that path."""
EXIT_GRACE_S = 0.2
"""After the program exits, how long to keep reading pipes that a leftover process still holds."""


def _v1_dirs() -> dict[str, Path]:
    """controller -> this process's cgroup folder, for the v1 ``pids`` and ``memory`` hierarchies."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in CONTROLLERS:
            root = Path("/sys/fs/cgroup") / c
            if c in controllers.split(",") and (root / "cgroup.procs").exists():
                out[c] = root / path.lstrip("/")
    return out


def cgroup_parents() -> dict[str, Path]:
    """The v1 ``pids``/``memory`` folders this process may create child cgroups in (probed once by
    creating and removing one); empty where the host does not allow it (not root, cgroup v2 only) or
    where ``LAMINAR_SANDBOX_CGROUPS=0``."""
    return {} if os.environ.get(NO_CGROUPS_ENV) == "0" else _probe_cgroups()


@cache
def _probe_cgroups() -> dict[str, Path]:
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


@cache
def _warn_uncontained() -> None:
    log.warning(
        "sandbox: running as root without a pids cgroup: RLIMIT_NPROC does not bind uid 0, so nothing "
        "caps a run's processes and a fork bomb reaches the host's process table (docs/sandbox.md)"
    )


@dataclass
class Cgroup:
    """The cgroups of one run: ``pids`` caps its processes (RLIMIT_NPROC does not bind uid 0),
    ``memory`` caps its total memory (tmpfs pages included); every process of the run is in them,
    daemons included. Their event counters are the kernel's word on which limit was hit."""

    dirs: dict[str, Path]

    @classmethod
    def create(cls, job: Job) -> Cgroup | None:
        parents = cgroup_parents()
        if "pids" not in parents and os.geteuid() == 0:
            _warn_uncontained()
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

    @property
    def has_memory(self) -> bool:
        return "memory" in self.dirs

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


CPU_MARGIN = 0.75
"""A signal counts as RLIMIT_CPU's (SIGXCPU at the soft limit, SIGKILL at the hard one) when the
program's CPU seconds (``wait4``) reach this share of that limit: the kernel checks the limit against
tick-sampled time, which ran up to 13% ahead of ``wait4``'s precise time here."""


@dataclass(frozen=True)
class Ending:
    """How the program ended, in the kernel's words: its ``wait4`` status and CPU seconds."""

    status: int
    cpu_s: float

    @property
    def exit_code(self) -> int:
        return os.waitstatus_to_exitcode(self.status)


def _classify(
    reason: KilledBy | None, ending: Ending | None, job: Job, cgroup: Cgroup | None
) -> KilledBy | None:
    """Which limit ended the run, from the kernel's word only: the parent's own kill (``reason``), the
    program's wait status (a signal, not an exit code that looks like one), its CPU seconds against
    RLIMIT_CPU (SIGXCPU at the soft limit, SIGKILL at the hard one) and the cgroups' event counters
    (an OOM kill, a refused fork). Never from the exit code's value or the program's output."""
    if reason is not None:
        return reason
    if ending is None:  # the sandbox's init said nothing: only the cgroup can speak
        return "memory" if cgroup and cgroup.oom_kills() else None
    if os.WIFEXITED(ending.status) and os.WEXITSTATUS(ending.status) == 0:
        return None
    if cgroup and cgroup.oom_kills():
        return "memory"
    if os.WIFSIGNALED(ending.status):
        sig = os.WTERMSIG(ending.status)
        soft, hard = job.rlimits()["RLIMIT_CPU"]
        if (sig == signal.SIGXCPU and ending.cpu_s >= soft * CPU_MARGIN) or (
            sig == signal.SIGKILL and ending.cpu_s >= hard * CPU_MARGIN
        ):
            return "cpu"
        return "file_size" if sig == signal.SIGXFSZ else "signal"
    if cgroup and cgroup.fork_refusals():
        return "processes"
    return None


def _read_report(fd: int) -> Ending | None:
    """The sandbox init's report (``BOOTSTRAP``), or None where it wrote none (killed first)."""
    os.set_blocking(fd, False)
    try:
        status, cpu = os.read(fd, 256).split()
        return Ending(int(status), float(cpu))
    except (BlockingIOError, ValueError):
        return None
    finally:
        os.close(fd)


Command = Callable[[dict[str, tuple[int, int]], int], list[str]]
"""Builds a run's command line from the rlimits to set and the report fd (-1: no report)."""


def _spawn(
    argv: Callable[[], list[str]],
    stdin: bytes,
    env: dict[str, str],
    cwd: str | None,
    fds: Sequence[int],
    cgroup: Cgroup | None,
) -> subprocess.Popen:
    """Start ``argv()`` in a new session, inside ``cgroup`` (a ``sh`` prefix joins it first), with
    ``stdin`` on its standard input and ``fds`` passed; this process's copies of ``fds`` are closed,
    whether it started or not."""
    prefix = ["/bin/sh", "-c", JOIN_CGROUPS, "sh", *cgroup.procs_files(), "--"] if cgroup else []
    stdin_fd = memfd("stdin", stdin)
    try:
        return subprocess.Popen(
            [*prefix, *argv()],
            stdin=stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            pass_fds=fds,
            start_new_session=True,
        )
    finally:
        for fd in (stdin_fd, *fds):
            os.close(fd)


def execute(
    job: Job,
    command: Command,
    *,
    backend: str,
    env: dict[str, str],
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    nproc: bool = True,
    report: bool = False,
) -> SandboxResult:
    """Run ``command`` (which runs ``BOOTSTRAP``) as one sandboxed job in its own process group and
    cgroup, feed it ``job.stdin``, collect its capped output and kill everything of it at the end.
    ``report``: the command's init writes the program's ending to a pipe (else the command is the
    program, and its own wait status is the ending). RLIMIT_AS is left out where the run's memory
    cgroup bounds memory, so that an overrun is the cgroup's OOM kill, which the kernel counts."""
    cgroup = Cgroup.create(job)
    rlimits = job.rlimits(nproc=nproc, memory=not (cgroup and cgroup.has_memory))
    read_fd, write_fd = os.pipe() if report else (-1, -1)
    fds = (*pass_fds, write_fd) if report else tuple(pass_fds)
    start = time.monotonic()
    try:
        proc = _spawn(lambda: command(rlimits, write_fd), job.stdin, env, cwd, fds, cgroup)
    except BaseException:
        if report:
            os.close(read_fd)
        if cgroup:
            cgroup.remove()
        raise
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
        ending = _read_report(read_fd) if report else Ending(status, usage.ru_utime + usage.ru_stime)
        return SandboxResult(
            stdout=out.data.decode("utf-8", "replace"),
            stderr=err.data.decode("utf-8", "replace"),
            exit_code=ending.exit_code if ending else proc.returncode,
            timed_out=reason == "wall",
            killed_by=_classify(reason, ending, job, cgroup),
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


def bootstrap_args(
    python: str, rlimits: dict[str, tuple[int, int]], report_fd: int = -1, paths: Sequence[str] = ()
) -> list[str]:
    """The interpreter command that runs ``BOOTSTRAP``: the sandbox's init when ``report_fd`` >= 0,
    then the program (``main.py`` of the working folder) under ``rlimits``, with ``paths`` appended
    to its ``sys.path``."""
    limits = " ".join(f"{k}:{s}:{h}" for k, (s, h) in rlimits.items())
    return [python, "-S", "-s", "-B", "-c", BOOTSTRAP, str(report_fd), limits, os.pathsep.join(paths)]
