"""Operating a workspace from outside a run: ``laminar runs`` (``list_runs`` / ``format_runs``),
whether a laminar process holds the workspace now, and the Prefect servers that killed runs left
behind. Reads only; the runner (``tasks.runner``) stops the orphaned servers under the lock.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime
from typing import Any

import psutil

from core.workspace import Workspace
from tasks.dag import stage_headline
from tasks.records import INTERRUPTED

PREFECT_SERVER = "prefect.server.api.server:create_app"


def orphan_prefect_servers(ws: Workspace) -> list[int]:
    """Prefect's temporary API servers (``uvicorn ... prefect.server.api.server:create_app``) of this
    workspace's Prefect home whose laminar process is gone: a run killed with SIGKILL leaves its
    server running, with no parent to stop it."""
    home = str(ws.prefect_home)
    found = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        if proc.pid == os.getpid() or PREFECT_SERVER not in " ".join(proc.info["cmdline"] or ()):
            continue
        try:
            if proc.environ().get("PREFECT_HOME") != home:
                continue
            ppid = proc.info["ppid"]
            parent = " ".join(psutil.Process(ppid).cmdline()) if ppid > 1 else ""
        except psutil.Error:  # gone, or not ours to read
            continue
        if ppid == os.getpid() or "python" in parent:
            continue  # a live laminar (or Prefect) process still owns it
        found.append(proc.pid)
    return found


def stop_orphan_prefect_servers(ws: Workspace) -> list[int]:
    """SIGTERM the servers ``orphan_prefect_servers`` finds; call it holding the workspace lock."""
    stopped = []
    for pid in orphan_prefect_servers(ws):
        try:
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
        except OSError:
            pass
    return stopped


def workspace_busy(ws: Workspace) -> bool:
    """Whether a laminar process holds the workspace lock now: the pid the lock file names is alive
    and has the lock file open. Asking never takes the lock, so it never makes a starting run fail."""
    path = ws.root / ".lock"
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if not pid:
        return False
    try:
        return any(f.path == str(path.resolve()) for f in psutil.Process(pid).open_files())
    except psutil.AccessDenied:
        return True  # another user's live process: assume it holds the lock it names
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


# ---- laminar runs ---------------------------------------------------------------------------------


def _iso(v: Any) -> str | None:
    return v.isoformat(sep=" ", timespec="seconds") if isinstance(v, datetime) else (str(v) if v else None)


def list_runs(ws: Workspace, limit: int | None = None) -> dict:
    """Every run (newest first) with its stages' headline metrics and the checkpoints it made or used,
    and every checkpoint with the accuracy of its evaluations."""
    busy = workspace_busy(ws)
    runs = ws.catalog.query(
        "SELECT run_id, started_at, finished_at, status, command, prefect_flow_run_id FROM runs "
        "ORDER BY started_at DESC" + (f" LIMIT {int(limit)}" if limit else ""),
    )
    stage_rows = ws.catalog.query(
        "SELECT run_id, stage, status, cache_key, seconds, prefect_task_run_id, outputs_json, "
        "metrics_json FROM stage_runs ORDER BY started_at",
    )
    ckpts = ws.catalog.query(
        "SELECT checkpoint_sha, stage, step, base_sha, cache_key, created_at FROM checkpoints "
        "ORDER BY created_at",
    )
    evals = ws.catalog.query(
        "SELECT checkpoint_sha, eval_sha, benchmark, count(DISTINCT problem_id) AS problems, "
        "count(*) AS samples, avg(CAST(correct AS DOUBLE)) AS accuracy FROM eval_results "
        "GROUP BY checkpoint_sha, eval_sha, benchmark ORDER BY benchmark",
    )
    ckpt_by_sha = {c["checkpoint_sha"]: c for c in ckpts}
    by_run: dict[str, list[dict]] = {}
    for s in stage_rows:
        metrics = json.loads(s["metrics_json"] or "{}")
        outputs = {k: v["sha256"] for k, v in json.loads(s["outputs_json"] or "{}").items()}
        by_run.setdefault(s["run_id"], []).append(
            {
                "stage": s["stage"],
                "status": s["status"],
                "seconds": s["seconds"],
                "cache_key": s["cache_key"],
                "prefect_task_run_id": s["prefect_task_run_id"],
                "outputs": outputs,
                "headline": stage_headline(s["stage"], metrics),
                "metrics": metrics,
            }
        )
    out_runs = []
    for r in runs:
        stages = by_run.get(r["run_id"], [])
        status = r["status"]
        if status == "running" and not busy:
            status = f"{INTERRUPTED}?"  # its process is gone; the next run marks it
        seconds = (
            (r["finished_at"] - r["started_at"]).total_seconds()
            if r["finished_at"] and r["started_at"]
            else None
        )
        out_runs.append(
            {
                "run_id": r["run_id"],
                "status": status,
                "started_at": _iso(r["started_at"]),
                "finished_at": _iso(r["finished_at"]),
                "seconds": seconds,
                "command": r["command"],
                "prefect_flow_run_id": r["prefect_flow_run_id"],
                "ran": sum(s["status"] == "ran" for s in stages),
                "cached": sum(s["status"] == "cached" for s in stages),
                "stages": stages,
                "checkpoints": {
                    s["stage"]: sha for s in stages for sha in s["outputs"].values() if sha in ckpt_by_sha
                },
            }
        )
    evals_by_ckpt: dict[str, list[dict]] = {}
    for e in evals:
        evals_by_ckpt.setdefault(e["checkpoint_sha"], []).append(
            {
                "eval": e["eval_sha"],
                "benchmark": e["benchmark"],
                "problems": e["problems"],
                "samples": e["samples"],
                "accuracy": e["accuracy"],
            }
        )
    out_ckpts = [
        {
            "sha256": c["checkpoint_sha"],
            "stage": c["stage"],
            "step": c["step"],
            "base": c["base_sha"],
            "cache_key": c["cache_key"],
            "created_at": _iso(c["created_at"]),
            "evaluations": evals_by_ckpt.get(c["checkpoint_sha"], []),
        }
        for c in reversed(ckpts)
    ]
    return {"workspace": str(ws.root), "busy": busy, "runs": out_runs, "checkpoints": out_ckpts}


def format_runs(listing: dict) -> str:
    lines = [f"{'run':<30} {'status':<12} {'started':<19} {'seconds':>8}  stages"]
    lines.append("-" * 90)
    for r in listing["runs"]:
        secs = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        lines.append(
            f"{r['run_id']:<30} {r['status']:<12} {r['started_at'] or '-':<19} {secs:>8}  "
            f"{r['ran']} ran, {r['cached']} cached"
        )
        if r.get("command"):
            lines.append(f"    command: {r['command']}")
        for s in r["stages"]:
            lines.append(f"    {s['stage']:<14} {s['status']:<7} {s['headline']}")
        if r["checkpoints"]:
            lines.append(
                "    checkpoints: " + ", ".join(f"{st} {sha[:12]}" for st, sha in r["checkpoints"].items())
            )
    if not listing["runs"]:
        lines.append("(no runs)")
    lines += ["", f"{'checkpoint':<14} {'stage':<12} {'step':>6}  {'created':<19}  evaluations", "-" * 90]
    for c in listing["checkpoints"]:
        ev = "  ".join(
            f"{e['benchmark']} {e['accuracy']:.3f} (eval {e['eval'][:8]}, {e['samples']} samples)"
            for e in c["evaluations"]
            if e["accuracy"] is not None
        )
        step = "-" if c["step"] is None else str(c["step"])
        lines.append(
            f"{c['sha256'][:12]:<14} {c['stage'] or '-':<12} {step:>6}  {c['created_at'] or '-':<19}  {ev}"
        )
    if not listing["checkpoints"]:
        lines.append("(no checkpoints)")
    return "\n".join(lines)
