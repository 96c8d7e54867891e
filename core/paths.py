"""Per-user folders shared by every workspace."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """``$LAMINAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/laminar``, else ``~/.cache/laminar``: what is
    made once per machine or version and reused by every workspace (Prefect's database template, the
    native decode kernels)."""
    if os.environ.get("LAMINAR_CACHE_DIR"):
        return Path(os.environ["LAMINAR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "laminar"
