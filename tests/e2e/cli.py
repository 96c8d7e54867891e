"""What the CLI end-to-end tests share: ``laminar`` run as a subprocess of this interpreter on a
workspace, and the summary of a workspace's latest run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def laminar(
    *args: str, ws: Path, env: dict | None = None, check: bool = True, timeout: int = 900
) -> subprocess.CompletedProcess:
    """``laminar ARGS --workspace WS`` from the repository root (``env``: the whole environment;
    default: this one with the repository on ``PYTHONPATH``); with ``check``, a non-zero exit fails
    the test with the output's tails."""
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=env if env is not None else {**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"laminar {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def latest_summary(ws: Path) -> dict:
    """The ``summary.json`` of the workspace's most recent run."""
    runs = sorted((ws / "runs").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(runs[-1].read_text())
