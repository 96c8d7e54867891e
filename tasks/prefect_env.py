"""Point Prefect at the workspace before it is imported: its home, result storage and logging."""

from __future__ import annotations

import os

from core.workspace import Workspace


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
