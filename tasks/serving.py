"""A Prefect server for ``laminar serve``: schedules need one (Prefect's temporary per-process server
runs no scheduler), and its UI shows the runs.

``laminar serve`` uses the server ``PREFECT_API_URL`` names, or starts ``prefect server start`` on
localhost with the workspace's Prefect home (so the UI also shows the workspace's earlier runs) and
writes its address to ``<workspace>/prefect/server.json``; ``laminar run`` on that workspace then
reports to the same server (``attach_served_api``). Nothing here imports Prefect: its settings are
read once, at import, so ``PREFECT_API_URL`` must be in the environment before.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from core.workspace import Workspace

SERVER_FILE = "server.json"


class ServeError(RuntimeError):
    pass


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*/,?#LW-]+$")


def check_cron_shape(expr: str) -> str:
    """Five (or six) cron fields of cron characters: a check that needs no Prefect import, so an
    obviously wrong expression fails before anything is written."""
    fields = expr.split()
    if len(fields) not in (5, 6) or not all(_CRON_FIELD.match(f) for f in fields):
        raise ServeError(f"--cron {expr!r} is not a cron expression (five fields: minute hour day month "
                         "weekday, e.g. '0 3 * * *' for every day at 03:00)")
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
        raise ServeError(f"--cron {expr!r} is not a cron expression (five fields: minute hour day month "
                         f"weekday, e.g. '0 3 * * *'): {why}") from None
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


@contextmanager
def local_server(ws: Workspace, port: int, startup_s: float = 180.0, ui: bool = True) -> Iterator[str]:
    """``prefect server start`` on ``127.0.0.1:port`` with the workspace's Prefect home; yields its API
    URL once healthy; stops it on exit. Its log is ``<workspace>/logs/prefect-server.log``."""
    ws.create()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(ws.prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1", "PREFECT_UI_ENABLED": "true" if ui else "false"}
    env.pop("PREFECT_API_URL", None)
    log = open(ws.logs / "prefect-server.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + startup_s
        while not healthy(api_url):
            if proc.poll() is not None:
                raise ServeError(f"the Prefect server exited ({proc.returncode}) before it was up; see "
                                 f"{ws.logs / 'prefect-server.log'}")
            if time.monotonic() > deadline:
                raise ServeError(f"the Prefect server was not up after {startup_s:.0f}s; see "
                                 f"{ws.logs / 'prefect-server.log'}")
            time.sleep(0.5)
        _server_file(ws).write_text(json.dumps({"api_url": api_url, "pid": proc.pid}))
        yield api_url
    finally:
        _server_file(ws).unlink(missing_ok=True)
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
    Sets the environment before Prefect is imported, then checks ``cron`` (raises ServeError) before
    the server starts."""
    from tasks.prefect_env import configure_prefect

    check_cron_shape(cron)  # before anything is written
    configure_prefect(ws)
    external = os.environ.get("PREFECT_API_URL")
    if not external:
        port = free_port(port)
        os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    ws.create()  # Prefect makes its home (inside the workspace) on import
    check_cron(cron)
    if external:
        yield external
        return
    with local_server(ws, port) as api_url:
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
    if not healthy(info["api_url"]):
        return None
    os.environ["PREFECT_API_URL"] = info["api_url"]
    return info["api_url"]
