"""A Prefect server for ``laminar serve``: schedules need one (Prefect's temporary per-process server
runs no scheduler), and its UI shows the runs.

``laminar serve`` uses the server ``PREFECT_API_URL`` names, or starts Prefect's server
(``tasks.served_server``) on localhost with the workspace's Prefect home (so the UI also shows the
workspace's earlier runs) and writes its address to ``<workspace>/prefect/server.json``;
``laminar run`` on that workspace then reports to the same server (``attach_served_api``). Nothing
here imports Prefect: its settings are read once, at import, so ``PREFECT_API_URL`` must be in the
environment before.

The server is locked down: Prefect's API authentication on (a fresh random ``user:password`` per
``laminar serve``, in ``<workspace>/prefect/api-auth``, mode 0600, which the serve process, its flow
runs and ``laminar run`` on the workspace send), CSRF protection on, and CORS limited to the server's
own origin. A run of the deployment may choose only config overrides on the allow-list
(``caller_keys``: numbers, switches and names, never a key that can name a host path or a URL); the
workspace, the stage selection and every other override are fixed by the ``laminar serve`` command
line. The served API answers 403 with the reason to parameters off the list (``refused_parameters``),
and the flow run checks them again and validates the config before anything is written
(``check_served_run``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import types
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.workspace import Workspace

SERVER_FILE = "server.json"
AUTH_FILE = "api-auth"
SERVE_SPEC_ENV = "LAMINAR_SERVE_SPEC"


class ServeError(RuntimeError):
    pass


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,?#LW-]+$")


def check_cron_shape(expr: str) -> str:
    """Five (or six) cron fields of cron characters: a check that needs no Prefect import, so an
    obviously wrong expression fails before anything is written."""
    fields = expr.split()
    if len(fields) not in (5, 6) or not all(_CRON_FIELD.match(f) for f in fields):
        raise ServeError(
            f"--cron {expr!r} is not a cron expression (five fields: minute hour day month "
            "weekday, e.g. '0 3 * * *' for every day at 03:00)"
        )
    return expr


def check_cron(expr: str) -> str:
    """Prefect's own cron validation; call it once ``PREFECT_API_URL`` is settled (it imports Prefect)."""
    from prefect.client.schemas.schedules import CronSchedule

    check_cron_shape(expr)
    try:
        CronSchedule(cron=expr)
    except ValueError as err:
        errors = getattr(err, "errors", None)
        why = errors()[0]["msg"] if callable(errors) else str(err).splitlines()[0]
        raise ServeError(
            f"--cron {expr!r} is not a cron expression (five fields: minute hour day month "
            f"weekday, e.g. '0 3 * * *'): {why}"
        ) from None
    return expr


def free_port(preferred: int = 0, host: str = "127.0.0.1") -> int:
    """``preferred`` when it is free (0: any free port)."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise ServeError("no free port on localhost")


def healthy(api_url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the server's process (Linux): SIGTERM when ``laminar serve`` dies, however it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _server_file(ws: Workspace) -> Path:
    return ws.prefect_home / SERVER_FILE


def auth_file(ws: Workspace) -> Path:
    """The served API's ``user:password`` (mode 0600), while ``laminar serve`` runs its server."""
    return ws.prefect_home / AUTH_FILE


def new_api_auth(ws: Workspace) -> str:
    """A fresh random ``laminar:<secret>`` in ``auth_file(ws)``, created 0600 under a temporary name
    and renamed over any earlier one (never readable by another user, not even for a moment)."""
    ws.prefect_home.mkdir(parents=True, exist_ok=True)
    auth = "laminar:" + secrets.token_urlsafe(32)
    path = auth_file(ws)
    tmp = path.with_name(f".{AUTH_FILE}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(auth)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return auth


def read_api_auth(ws: Workspace) -> str | None:
    try:
        return auth_file(ws).read_text().strip() or None
    except OSError:
        return None


def server_env(ws: Workspace, port: int, auth: str, ui: bool = True) -> dict[str, str]:
    """The environment of the served Prefect server: the workspace's Prefect home, API authentication
    with ``auth`` (the server's own services send it too), CSRF protection on, CORS for the server's
    own origin only (its UI; no other web page may call the API), and the API address the UI is
    told (``/ui-settings``) on the server's own port (Prefect's default is 4200 whatever the port)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(ws.prefect_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_UI_ENABLED": "true" if ui else "false",
        "PREFECT_SERVER_API_AUTH_STRING": auth,
        "PREFECT_API_AUTH_STRING": auth,
        "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://127.0.0.1:{port}",
        "PREFECT_SERVER_UI_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    for alias in (
        "PREFECT_UI_API_URL",
        "PREFECT_API_URL",
        "PREFECT_SERVER_CSRF_PROTECTION_ENABLED",
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS",
    ):
        env.pop(alias, None)  # the server's own URL; no older alias of these settings left to disagree
    return env


@contextmanager
def local_server(
    ws: Workspace, port: int, startup_s: float = 180.0, ui: bool = True, auth: str | None = None
) -> Iterator[str]:
    """Prefect's server (``tasks.served_server``: what ``prefect server start`` runs, behind the guard
    of a run's parameters) on ``127.0.0.1:port`` with the workspace's Prefect home, locked down
    (``server_env``; ``auth``: its ``user:password``, default a fresh one in ``auth_file(ws)``); yields
    its API URL once healthy; stops it on exit. Its log is ``<workspace>/logs/prefect-server.log``."""
    ws.create()
    api_url = f"http://127.0.0.1:{port}/api"
    env = server_env(ws, port, auth or new_api_auth(ws), ui)
    log = open(ws.logs / "prefect-server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.served_server", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    try:
        deadline = time.monotonic() + startup_s
        while not healthy(api_url):
            if proc.poll() is not None:
                raise ServeError(
                    f"the Prefect server exited ({proc.returncode}) before it was up; see "
                    f"{ws.logs / 'prefect-server.log'}"
                )
            if time.monotonic() > deadline:
                raise ServeError(
                    f"the Prefect server was not up after {startup_s:.0f}s; see "
                    f"{ws.logs / 'prefect-server.log'}"
                )
            time.sleep(0.5)
        _server_file(ws).write_text(json.dumps({"api_url": api_url, "pid": proc.pid}))
        yield api_url
    finally:
        _server_file(ws).unlink(missing_ok=True)
        auth_file(ws).unlink(missing_ok=True)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        log.close()


@contextmanager
def prefect_api(ws: Workspace, port: int, cron: str) -> Iterator[str]:
    """The Prefect API ``laminar serve`` registers with, for ``ws``: the one ``PREFECT_API_URL`` names,
    else a local server on ``port`` (taken: another free one; 0: any) started here and stopped on exit.
    Sets the environment before Prefect is imported (for a local server: its URL and this process's
    auth string, which its flow runs inherit), then checks ``cron`` (raises ServeError) before the
    server starts."""
    from tasks.prefect_env import configure_prefect

    check_cron_shape(cron)  # before anything is written
    configure_prefect(ws)
    external = os.environ.get("PREFECT_API_URL")
    auth = None
    if not external:
        port = free_port(port)
        auth = new_api_auth(ws)
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        os.environ["PREFECT_API_AUTH_STRING"] = auth
    ws.create()  # Prefect makes its home (inside the workspace) on import
    try:
        check_cron(cron)
    except ServeError:
        auth_file(ws).unlink(missing_ok=True)
        raise
    if external:
        yield external
        return
    with local_server(ws, port, auth=auth) as api_url:
        yield api_url


def attach_served_api(ws: Workspace) -> str | None:
    """When ``laminar serve`` runs a server for this workspace and no ``PREFECT_API_URL`` is set, point
    this process at it (before Prefect is imported), so its runs appear in that server's UI too."""
    if os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:
        return None
    try:
        info = json.loads(_server_file(ws).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    auth = read_api_auth(ws)
    if auth is None or not healthy(info["api_url"]):
        return None  # the served API refuses a client without its auth string
    os.environ["PREFECT_API_URL"] = info["api_url"]
    os.environ["PREFECT_API_AUTH_STRING"] = auth
    return info["api_url"]


# ---- what a run of the served deployment may choose ---------------------------------------------------

OPERATOR_ONLY = ("sandbox",)
"""Sections a caller may not set even where their keys are numbers or names: how untrusted code is
isolated (``sandbox.backend=unsafe``, its limits) is the operator's."""
NAME_LISTS = ("eval.benchmarks", "curation.decontam.benchmarks")
"""Keys whose value is a list of registered names (a file spec, a dict, is the operator's)."""
_OVERRIDE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[[0-9]+\])*)=(.*)", re.S)
_PLAIN = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")
_PLAIN_LIST = re.compile(
    r"\[\s*(?:[A-Za-z0-9_+-][A-Za-z0-9_.+-]*\s*(?:,\s*[A-Za-z0-9_+-][A-Za-z0-9_.+-]*\s*)*)?\]"
)


def _leaf_kind(hint: Any) -> str | None:
    """What a schema field holds, if a caller may set it: ``plain`` (a number, a switch or one of a
    closed set of names), ``plains`` (a list of them), ``section`` (walk it); None: anything else (a
    free string: a path, a URL, an executable, a template; a list of sections)."""
    import typing

    if _section_in(hint) is hint:
        return "section"
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]  # Optional[X]
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if hint in (bool, int, float) or typing.get_origin(hint) is typing.Literal:
        return "plain"
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if typing.get_origin(item) is typing.Annotated:
            item = typing.get_args(item)[0]
        if item in (int, float) or typing.get_origin(item) is typing.Literal:
            return "plains"
    return None


@functools.cache
def caller_keys() -> dict[str, str]:
    """The allow-list: every config key a caller of the deployment may set (key -> ``plain`` or
    ``plains``), derived from the schema's types: numbers, switches and closed name sets (a
    ``Literal``), and the lists of registered names ``NAME_LISTS``; never a free string (a path, a
    URL, an executable), a list of sections or a section of ``OPERATOR_ONLY``. A field added to the
    schema is classified by its type the same way."""
    from conf.schema import Config

    out: dict[str, str] = {}

    def walk(cls: Any, prefix: str) -> None:
        for name, info in cls.model_fields.items():
            key = prefix + name
            if key in OPERATOR_ONLY:
                continue
            kind = "plains" if key in NAME_LISTS else _leaf_kind(info.annotation)
            if kind == "section":
                walk(info.annotation, key + ".")
            elif kind is not None:
                out[key] = kind

    walk(Config, "")
    return out


def config_groups() -> tuple[str, ...]:
    """The config groups (``conf/<group>/*.yaml``): ``group=option`` picks a shipped file."""
    from conf.loader import CONF_DIR

    return tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and list(p.glob("*.yaml"))))


def served_parameters(
    ws: Workspace, overrides: Sequence[str], force: Sequence[str], until: str | None, command: str
) -> dict:
    """What ``laminar serve`` fixes for every run of its deployment, put in this process's environment
    (its flow runs inherit it: ``check_served_run`` reads it); returns the deployment's parameters,
    the only ones a run may pass: ``overrides`` (default: the command line's) and ``workspace``
    (this one; any other is refused)."""
    os.environ[SERVE_SPEC_ENV] = json.dumps(
        {
            "workspace": str(ws.root),
            "overrides": list(overrides),
            "force": list(force),
            "until": until,
            "command": command,
        }
    )
    return {"overrides": list(overrides), "workspace": str(ws.root)}


def check_caller_override(override: str) -> None:
    """One override a caller of the deployment passed (not on the ``laminar serve`` command line):
    ``key=value`` with a key of the allow-list (``caller_keys``) and a plain value (a number, a
    switch, a name, or a list of them: no ``/``, ``:``, quote, brace or ``${...}``), or
    ``group=option`` of a shipped config group. Any key that could name a host path or a URL is the
    operator's. Raises ServeError with the reason."""
    m = _OVERRIDE.fullmatch(override) if isinstance(override, str) else None
    if m is None:
        raise ServeError(
            f"override {override!r} is refused: a run's overrides are key=value or group=option "
            "(no +, ~ or @ forms)"
        )
    key, value = re.sub(r"\[[0-9]+\]", "", m.group(1)), m.group(2)
    if "${" in value:
        raise ServeError(f"override {override!r} is refused: no ${{...}} interpolation in a run's overrides")
    if "." not in key and key not in caller_keys() and (key in config_groups() or _schema_has(key)):
        if key in config_groups() and _PLAIN.fullmatch(value):
            return
        raise ServeError(
            f"override {override!r} is refused: a top-level key takes a plain value or a config "
            "group's option (set a section's keys one by one: section.key=value)"
        )
    kind = caller_keys().get(key)
    if kind is None:
        if not _schema_has(key):
            raise ServeError(
                f"config error: unknown config key '{key}': check the spelling (`laminar config` prints "
                "every key)"
            )
        raise ServeError(
            f"override {override!r} is refused: {key} is not among the keys a run's caller may set "
            "(numbers, switches and names: docs/operations.md); it may name a file, folder, executable, "
            "URL or cluster, or loosen the sandbox: only the `laminar serve` command line may set it"
        )
    if not (_PLAIN.fullmatch(value) or (kind == "plains" and _PLAIN_LIST.fullmatch(value))):
        raise ServeError(
            f"override {override!r} is refused: {key} takes a plain value here ("
            + ("a number, a switch or a name" if kind == "plain" else "a list of names or numbers, [a,b]")
            + "; no path, URL, quote or mapping)"
        )


def _section_in(hint: Any) -> Any:
    """The section a type hint holds (itself, or inside Annotated, Optional or a list), else None."""
    import typing

    from pydantic import BaseModel

    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint
    return next((d for d in map(_section_in, typing.get_args(hint)) if d is not None), None)


def _schema_has(key: str) -> bool:
    """Whether ``key`` names a field or section of the schema (a list's items are walked)."""
    from conf.schema import Config

    node: Any = Config
    for part in key.split("."):
        fields = node.model_fields if node is not None else {}
        if part not in fields:
            return False
        node = _section_in(fields[part].annotation)
    return True


def refused_parameters(parameters: object, spec: dict) -> str | None:
    """Why the served API refuses a request that sets a flow run's (or the deployment's) parameters
    (``tasks.served_server`` answers 403 with it), or None: ``workspace`` other than the served one,
    or an override not on the ``laminar serve`` command line that ``check_caller_override`` refuses."""
    if not isinstance(parameters, dict):
        return None
    workspace = parameters.get("workspace")
    if workspace is not None and workspace != spec["workspace"]:
        return (
            f"this deployment runs on workspace {spec['workspace']} only; a run may not choose another "
            f"(workspace={workspace!r} refused)"
        )
    overrides = parameters.get("overrides")
    if overrides is None:
        return None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return f"overrides must be a list of 'key=value' strings, got {overrides!r}"
    trusted = set(spec["overrides"])
    for o in overrides:
        if o not in trusted:
            try:
                check_caller_override(o)
            except ServeError as err:
                return str(err)
    return None


@dataclass(frozen=True)
class ServedRun:
    workspace: str
    overrides: list[str]
    force: list[str]
    until: str | None
    command: str
    cfg: object


def check_served_run(overrides: object, workspace: object) -> ServedRun:
    """The parameters of one run of the served deployment, checked before anything is written: the
    workspace must be the served one, every override not on the ``laminar serve`` command line must
    pass ``check_caller_override``, and the config must validate (schema and preflight). Raises
    ServeError naming what was refused."""
    from conf.schema import ConfigError
    from tasks.preflight import load_checked

    raw = os.environ.get(SERVE_SPEC_ENV)
    if not raw:
        raise ServeError(
            "this flow runs only under `laminar serve` (its deployment fixes the workspace); "
            "use `laminar run` otherwise"
        )
    spec = json.loads(raw)
    if workspace is not None and workspace != spec["workspace"]:
        raise ServeError(
            f"this deployment runs on workspace {spec['workspace']} only; a run may not choose "
            f"another (workspace={workspace!r} refused)"
        )
    overrides = list(spec["overrides"]) if overrides is None else overrides
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ServeError(f"overrides must be a list of 'key=value' strings, got {overrides!r}")
    reason = refused_parameters({"overrides": overrides}, spec)
    if reason:
        raise ServeError(reason)
    try:
        cfg = load_checked(overrides)
    except ConfigError as err:
        raise ServeError(f"config error: {err}") from None
    return ServedRun(
        spec["workspace"], list(overrides), list(spec["force"]), spec["until"], spec["command"], cfg
    )
