"""Run untrusted code in isolation: ``run(code, ...) -> SandboxResult`` is the one entry point tools
and rewards call. Threat model, flags and limits: docs/sandbox.md."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from conf.schema import SandboxConfig, SandboxLimits
from environments.sandbox.backends import BubblewrapBackend, SandboxBackend, UnsafeSubprocessBackend
from environments.sandbox.result import Job, KilledBy, SandboxResult, SandboxUnavailable

__all__ = [
    "BubblewrapBackend",
    "Job",
    "KilledBy",
    "SandboxBackend",
    "SandboxResult",
    "SandboxUnavailable",
    "UnsafeSubprocessBackend",
    "run",
    "select_backend",
]

_chosen: dict[tuple[str, bool], SandboxBackend] = {}
_lock = threading.Lock()


def _refusal(reason: str) -> str:
    return (
        f"the sandbox cannot run code here: {reason}. bubblewrap needs user namespaces (Linux with "
        "kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0, or root; containers often "
        "disable them). Enable them, or set sandbox.allow_unsafe=true to run code as a plain subprocess "
        "with the host's files and network in reach (every run then warns)"
    )


def select_backend(config: SandboxConfig | None = None) -> SandboxBackend:
    """The backend ``config`` asks for, probed once per process: bubblewrap where it can run; where it
    cannot, the unsafe subprocess if ``allow_unsafe``, else ``SandboxUnavailable`` saying why."""
    cfg = config or SandboxConfig()
    key = (cfg.backend, bool(cfg.allow_unsafe))
    with _lock:
        if key not in _chosen:
            _chosen[key] = _select(cfg)
        return _chosen[key]


def _select(cfg: SandboxConfig) -> SandboxBackend:
    if cfg.backend == "unsafe":
        if not cfg.allow_unsafe:
            raise SandboxUnavailable("sandbox.backend=unsafe needs sandbox.allow_unsafe=true")
        return UnsafeSubprocessBackend(why="sandbox.backend=unsafe")
    bwrap = BubblewrapBackend()
    reason = bwrap.unavailable()
    if reason is None:
        return bwrap
    if cfg.allow_unsafe:
        return UnsafeSubprocessBackend(why=f"bubblewrap cannot run: {reason}")
    raise SandboxUnavailable(_refusal(reason))


def run(
    code: str,
    *,
    stdin: str | bytes | None = None,
    timeout_s: float | None = None,
    limits: SandboxLimits | None = None,
    files: Mapping[str, str | bytes] | None = None,
    config: SandboxConfig | None = None,
    backend: SandboxBackend | None = None,
    packages: Sequence[str] | None = (),
) -> SandboxResult:
    """Run the Python program ``code`` as ``main.py`` in a private working folder, with ``files``
    (relative path -> content) beside it and ``stdin`` on its standard input, under ``limits`` and a
    wall timeout of ``timeout_s`` (defaults: ``config``'s, else ``SandboxConfig()``'s). ``backend``
    overrides the configured one. The program imports the standard library only, plus ``packages``
    (top-level import names, as this host's Python finds them), mounted read-only. Thread-safe;
    whatever the program does, the result is typed."""
    cfg = config or SandboxConfig()
    job = Job.make(
        code, stdin, files, cfg.timeout_s if timeout_s is None else timeout_s, limits or cfg.limits, packages
    )
    return (backend or select_backend(cfg)).execute(job)
