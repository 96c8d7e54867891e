"""One pipeline run for a benchmark: ``laminar run`` (the real CLI, ``python -m flows.cli run``) into a
workspace, its output kept in a log, and a record of it (run id, stages that ran or came from cache,
wall seconds, load average, the command) written beside it, so a finished run is not run again
(``resume``) and its ``summary.json`` is read the same way by every benchmark that runs the pipeline
(``benchmarks/calculator_rl.py``, ``calculator_episodes.py``, ``agent_pipeline.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pipeline(
    ws: Path,
    overrides: list[str],
    *,
    record: str = "bench_wall.json",
    log: str = "bench_stdout.log",
    resume: bool = False,
    fresh: bool = True,
    nice: int = 0,
) -> dict:
    """``laminar run --workspace ws OVERRIDES``; the run's record (also in ``ws/record``). ``resume``:
    a record already there is returned as it is. ``fresh``: ``ws`` is emptied first; else what it holds
    stays, so stages whose cache key is unchanged come from cache (content-addressed: the results a
    fresh workspace computes, without the compute). ``nice``: the run's niceness increment."""
    done = ws / record
    if resume and done.exists():
        return json.loads(done.read_text())
    if fresh:
        shutil.rmtree(ws, ignore_errors=True)
    cmd = [sys.executable, "-m", "flows.cli", "run", "--workspace", str(ws), *overrides]
    t0, load0 = time.perf_counter(), os.getloadavg()
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=(lambda: os.nice(nice)) if nice else None
    )
    wall = time.perf_counter() - t0
    ws.mkdir(parents=True, exist_ok=True)
    (ws / log).write_text(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    latest = max((ws / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    statuses = json.loads((latest / "summary.json").read_text())["stages"]
    shown = ws.relative_to(ROOT) if ws.is_relative_to(ROOT) else ws
    rec = {
        "run_id": latest.name,
        "cached_stages": sorted(k for k, v in statuses.items() if v["status"] == "cached"),
        "ran_stages": sorted(k for k, v in statuses.items() if v["status"] != "cached"),
        "wall_s": round(wall, 1),
        "command": " ".join(["laminar", "run", "--workspace", str(shown), *overrides]),
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    done.write_text(json.dumps(rec))
    return rec


def run_summary(ws: Path, rec: dict) -> dict:
    """The ``summary.json`` of the run ``rec`` names."""
    return json.loads((ws / "runs" / rec["run_id"] / "summary.json").read_text())
