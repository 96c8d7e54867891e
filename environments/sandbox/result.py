"""The sandbox's typed records: one run's request (``Job``) and its outcome (``SandboxResult``)."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from conf.schema import SandboxLimits

KilledBy = Literal["wall", "cpu", "memory", "output", "processes", "file_size", "signal"]
"""Which limit ended a run: the wall timeout, RLIMIT_CPU, memory (RLIMIT_AS or the memory cgroup),
the output cap, the process limit, RLIMIT_FSIZE, or another signal."""


class SandboxUnavailable(RuntimeError):
    """No backend may run code here (bubblewrap cannot start and the unsafe fallback is not allowed)."""


@dataclass(frozen=True)
class SandboxResult:
    """One run's outcome. ``exit_code``: the program's exit status, ``-N`` when signal N killed it
    (``subprocess``'s convention); ``killed_by``: the limit that ended it (None: it ended by itself);
    ``truncated``: stdout or stderr went past ``output_bytes`` and was cut there."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    killed_by: KilledBy | None
    wall_s: float
    truncated: bool
    backend: str

    @property
    def ok(self) -> bool:
        """The program exited 0 within every limit."""
        return self.exit_code == 0 and self.killed_by is None


MAIN = "main.py"
"""The program's file name in the working folder."""


def _check_name(name: str) -> str:
    norm = posixpath.normpath(name)
    if not name or posixpath.isabs(name) or norm.startswith("..") or norm in (".", MAIN):
        raise ValueError(
            f"sandbox file name {name!r} must be a relative path inside the working folder (no '..', "
            f"not {MAIN!r}, which holds the program)"
        )
    return norm


@dataclass(frozen=True)
class Job:
    """One run: the program (``main.py``), its stdin, extra files of the working folder (relative
    path -> bytes), the wall timeout and the limits. Invariant: file names are normalised relative
    paths inside the working folder."""

    code: str
    stdin: bytes
    files: tuple[tuple[str, bytes], ...]
    timeout_s: float
    limits: SandboxLimits

    @classmethod
    def make(
        cls,
        code: str,
        stdin: str | bytes | None,
        files: Mapping[str, str | bytes] | None,
        timeout_s: float,
        limits: SandboxLimits,
    ) -> Job:
        if not timeout_s > 0:
            raise ValueError(f"sandbox timeout_s={timeout_s} must be > 0")
        raw = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        named = tuple(
            (_check_name(k), v.encode() if isinstance(v, str) else bytes(v)) for k, v in (files or {}).items()
        )
        return cls(code=code, stdin=raw, files=named, timeout_s=float(timeout_s), limits=limits)

    def rlimits(self, nproc: bool = True) -> dict[str, tuple[int, int]]:
        """The ``resource`` limits the bootstrap sets before the program runs: (soft, hard).
        ``nproc=False`` leaves RLIMIT_NPROC out (it counts every process of the uid, not the run's)."""
        lim, mib = self.limits, 1024 * 1024
        cpu = max(1, int(round(lim.cpu_s)))
        out = {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_AS": (lim.memory_mb * mib, lim.memory_mb * mib),
            "RLIMIT_NPROC": (lim.processes, lim.processes),
            "RLIMIT_FSIZE": (lim.file_size_mb * mib, lim.file_size_mb * mib),
            "RLIMIT_NOFILE": (lim.open_files, lim.open_files),
            "RLIMIT_CORE": (0, 0),
        }
        if not nproc:
            del out["RLIMIT_NPROC"]
        return out
