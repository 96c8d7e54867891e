"""Point Prefect at the workspace before it is imported: its home, result storage and logging.

A fresh workspace's Prefect database is copied from a migrated, empty template kept in the user's
cache (one per Prefect version), so a new workspace's temporary server starts without running
Prefect's ~15 s of schema migrations. The template is made once, by ``prefect server database
upgrade`` in a scratch home, and only ever holds the schema and Prefect's own seed rows.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from core.paths import user_cache_dir
from core.workspace import Workspace

LOG = logging.getLogger("laminar.prefect")
DB_NAME = "prefect.db"
# Prefect 3's names for a database URL other than the default sqlite file in PREFECT_HOME
DB_URL_VARS = ("PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")


def configure_prefect(ws: Workspace, log_level: str = "WARNING") -> None:
    home = ws.prefect_home
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", log_level),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    os.environ.update(env)
    seed_database(home)


def cache_dir() -> Path:
    """``core.paths.user_cache_dir()``: ``$LAMINAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/laminar``, else
    ``~/.cache/laminar``."""
    return user_cache_dir()


def template_path() -> Path:
    return cache_dir() / f"prefect-{version('prefect')}-{DB_NAME}"


def make_template(path: Path, timeout_s: float = 300.0) -> Path:
    """Migrate an empty database in a scratch Prefect home and move it to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".prefect-template-") as scratch:
        env = {k: v for k, v in os.environ.items() if k not in DB_URL_VARS and k != "PREFECT_API_URL"}
        env.update(PREFECT_HOME=scratch, PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
        subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout_s,
        )
        os.replace(Path(scratch) / DB_NAME, path)
    return path


def seed_database(home: Path) -> bool:
    """Copy the migrated template into a Prefect home that has no database yet (the default sqlite
    URL, and no ``PREFECT_API_URL``: a run that reports to a server never opens this file). Returns
    whether it did; any failure leaves Prefect to create its own database."""
    if (
        any(os.environ.get(v) for v in (*DB_URL_VARS, "PREFECT_API_URL"))
        or os.environ.get("LAMINAR_PREFECT_TEMPLATE") == "off"
    ):
        return False  # another database, another server's (which keeps its own), or turned off
    target = home / DB_NAME
    if target.exists():
        return False
    try:
        template = template_path()
        if not template.exists():
            make_template(template)
        home.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{DB_NAME}.{os.getpid()}.tmp")
        shutil.copyfile(template, tmp)
        os.replace(tmp, target)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()[-500:]
        LOG.warning(
            "no Prefect database template (%s%s); Prefect migrates a new database itself",
            e,
            f": {detail}" if detail else "",
        )
        return False


class _SaidOnce(logging.Filter):
    """On the console, a stage that stopped with a ``StageError`` (a diverged loss, an unreadable
    source file) or a ``CatalogBusy`` is said once, by the CLI's ``laminar: ...`` line: Prefect's
    task- and flow-run ERROR records of that failure (the exception, the final state naming it) are
    left out there. Prefect's API handler (its UI) still gets them."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        from core.catalog import CatalogBusy
        from core.errors import StageError

        if record.levelno < logging.ERROR or not record.name.startswith(
            ("prefect.task_runs", "prefect.flow_runs")
        ):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (CatalogBusy, StageError)):
            self.said.add(str(exc))
            return False
        message = record.getMessage()
        return not any(text in message for text in self.said)


def one_line_failures() -> None:
    """Install ``_SaidOnce`` on the console handlers Prefect's logging config set up (once; call it
    inside a flow run, when that config is in place)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not any(
            isinstance(f, _SaidOnce) for f in handler.filters
        ):
            handler.addFilter(_SaidOnce())
