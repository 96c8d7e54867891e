"""The sandbox's typed records: one run's request (``Job``) and its outcome (``SandboxResult``)."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
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
WRITABLE_TMPFS = 3
"""The sandbox's writable mounts, each a sized tmpfs: the working folder, ``/tmp`` and ``/dev/shm``."""


def _check_package(name: str) -> str:
    if not name.isidentifier():
        raise ValueError(f"sandbox package {name!r} must be a top-level import name (like 'yaml')")
    return name


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
    path -> bytes), the wall timeout, the limits and the packages beyond the standard library the
    program may import (top-level import names, mounted read-only). Invariant: file names are
    normalised relative paths inside the working folder."""

    code: str
    stdin: bytes
    files: tuple[tuple[str, bytes], ...]
    timeout_s: float
    limits: SandboxLimits
    packages: tuple[str, ...] = ()

    @classmethod
    def make(
        cls,
        code: str,
        stdin: str | bytes | None,
        files: Mapping[str, str | bytes] | None,
        timeout_s: float,
        limits: SandboxLimits,
        packages: Sequence[str] | None = (),
    ) -> Job:
        if not timeout_s > 0:
            raise ValueError(f"sandbox timeout_s={timeout_s} must be > 0")
        raw = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        named = tuple(
            (_check_name(k), v.encode() if isinstance(v, str) else bytes(v)) for k, v in (files or {}).items()
        )
        if isinstance(packages, str):
            raise ValueError(f"sandbox packages={packages!r} must be a list of import names, not a string")
        wanted = tuple(dict.fromkeys(_check_package(p) for p in packages or ()))
        return cls(
            code=code, stdin=raw, files=named, timeout_s=float(timeout_s), limits=limits, packages=wanted
        )

    @property
    def tmpfs_bytes(self) -> int:
        """The size of each writable tmpfs: ``tmpfs_mb``, but never more than a ``WRITABLE_TMPFS``-th of
        ``memory_mb``, so that files in memory stay within the memory limit, with or without cgroups."""
        return min(self.limits.tmpfs_mb * 1024 * 1024, self.limits.memory_mb * 1024 * 1024 // WRITABLE_TMPFS)

    def rlimits(self, nproc: bool = True, memory: bool = True) -> dict[str, tuple[int, int]]:
        """The ``resource`` limits the bootstrap sets before the program runs: (soft, hard).
        ``nproc=False`` leaves RLIMIT_NPROC out (it counts every process of the uid, not the run's);
        ``memory=False`` leaves RLIMIT_AS out (where a memory cgroup bounds the whole run)."""
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
        if not memory:
            del out["RLIMIT_AS"]
        return out
