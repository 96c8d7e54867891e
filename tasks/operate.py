"""Operating the pipeline: which stages a command runs, the run record around one pipeline run,
and the listing of runs and checkpoints.

- The stage selections are computed from ``tasks.stages.STAGES`` and each ``Stage.inputs``, never
  from a list of names: ``laminar rerun STAGE`` forces ``downstream_of(STAGE)`` and runs only what
  that needs (``upstream_of`` it); ``laminar run --until STAGE`` runs ``upstream_of(STAGE)``.
- ``run_pipeline`` is one pipeline run under the workspace lock, for the CLI and for scheduled
  runs alike: it marks the runs that died without finishing (their row still says ``running``;
  holding the lock proves no one else runs) as ``interrupted``, writes the ``runs`` row, the run
  files and ``summary.json``, and closes the row as ``completed``, ``failed`` or ``interrupted``.
- ``list_runs`` / ``format_runs``: ``laminar runs``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any
from collections.abc import Callable, Iterable, Sequence

from conf.schema import Config
from core.catalog import dumps
from core.workspace import Workspace
from tasks.stages import STAGE_BY_NAME, STAGES, stage_headline

INTERRUPTED = "interrupted"


# ---- the DAG, generically ------------------------------------------------------------------------


class UnknownStage(ValueError):
    pass


def check_stages(names: Iterable[str]) -> list[str]:
    names = list(names)
    unknown = [n for n in names if n not in STAGE_BY_NAME]
    if unknown:
        raise UnknownStage(
            f"unknown stage {', '.join(unknown)}; stages are {', '.join(s.name for s in STAGES)}"
        )
    return names


def upstream_of(names: Iterable[str]) -> set[str]:
    """``names`` and every stage they read from, transitively."""
    todo, seen = check_stages(names), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(src for src, _ in STAGE_BY_NAME[name].inputs.values())
    return seen


def downstream_of(names: Iterable[str]) -> set[str]:
    """``names`` and every stage that reads from them, transitively (whatever the order of STAGES)."""
    seen = set(check_stages(names))
    changed = True
    while changed:
        changed = False
        for stage in STAGES:
            if stage.name not in seen and any(src in seen for src, _ in stage.inputs.values()):
                seen.add(stage.name)
                changed = True
    return seen


def in_dag_order(names: Iterable[str]) -> list[str]:
    wanted = set(names)
    return [s.name for s in STAGES if s.name in wanted]


@dataclass(frozen=True)
class Selection:
    """What one ``laminar run``/``rerun`` executes: ``stages`` (None: all of them) and ``force``."""

    stages: list[str] | None
    force: list[str]


def select(until: str | None = None, force: Sequence[str] = (), rerun: str | None = None) -> Selection:
    """``until``: only that stage and its upstream. ``rerun``: that stage and its downstream are forced,
    their upstream comes from cache, and stages that neither feed nor follow it are left out."""
    force = check_stages(force)
    stages: set[str] | None = None
    if rerun is not None:
        forced = downstream_of([rerun])
        force = sorted(set(force) | forced)
        stages = upstream_of(forced)
    if until is not None:
        up = upstream_of([until])
        stages = up if stages is None else stages & up
    if stages is not None:
        force = [f for f in force if f in stages]
    return Selection(in_dag_order(stages) if stages is not None else None, in_dag_order(force))


# ---- one run under the workspace lock -----------------------------------------------------------


def load_checked(overrides: Sequence[str]) -> Config:
    """The config of ``overrides``, validated by the schema and by ``tasks.preflight`` (raises ConfigError)."""
    from conf.loader import load_config
    from tasks.preflight import preflight

    cfg = load_config(list(overrides))
    preflight(cfg)
    return cfg


def new_run_id(prefix: str = "") -> str:
    return prefix + datetime.now(UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def command_line() -> str:
    return shlex.join(["laminar", *sys.argv[1:]])


def save_run_files(ws: Workspace, run_id: str, cfg: Config, command: str) -> None:
    """The resolved config and the exact command beside the run's outputs."""
    from conf.loader import to_yaml

    run_dir = ws.run_dir(run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "command.txt").write_text(command + "\n")


def mark_interrupted(ws: Workspace) -> list[str]:
    """Runs whose row still says ``running``: their process died (SIGKILL, OOM, power). The caller
    holds the workspace lock, so none of them is still running. Returns their ids."""
    if not ws.catalog.path.exists():
        return []
    with ws.catalog.transaction() as con:
        rows = con.execute("SELECT run_id FROM runs WHERE status = 'running' ORDER BY started_at").fetchall()
        if rows:
            con.execute("UPDATE runs SET status = ? WHERE status = 'running'", [INTERRUPTED])
    return [r[0] for r in rows]


def orphan_prefect_servers(ws: Workspace) -> list[int]:
    """Prefect's temporary API servers (``uvicorn ... prefect.server.api.server:create_app``) of this
    workspace's Prefect home whose laminar process is gone: a run killed with SIGKILL leaves its
    server running, with no parent to stop it. Linux (``/proc``) only; [] elsewhere."""
    from pathlib import Path

    proc = Path("/proc")
    if not proc.is_dir():
        return []
    home = f"PREFECT_HOME={ws.prefect_home}".encode()
    found = []
    for d in proc.iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if b"prefect.server.api.server:create_app" not in (d / "cmdline").read_bytes():
                continue
            if home not in (d / "environ").read_bytes().split(b"\0"):
                continue
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parent = (proc / str(ppid) / "cmdline").read_bytes() if ppid > 1 else b""
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() or b"python" in parent:
            continue  # a live laminar (or Prefect) process still owns it
        found.append(int(d.name))
    return found


def stop_orphan_prefect_servers(ws: Workspace) -> list[int]:
    """SIGTERM the servers ``orphan_prefect_servers`` finds; call it holding the workspace lock."""
    import signal

    stopped = []
    for pid in orphan_prefect_servers(ws):
        try:
            os.kill(pid, signal.SIGTERM)
            stopped.append(pid)
        except OSError:
            pass
    return stopped


def prepare_workspace(ws: Workspace, say: Callable[[str], None]) -> None:
    """Under the lock, before a run: folders, writers' leftovers, rows and servers of runs that died."""
    from tasks.prefect_env import configure_prefect
    from tasks.serving import attach_served_api

    ws.create()
    ws.artifacts.clean_tmp()
    configure_prefect(ws)
    attach_served_api(ws)
    for run_id in mark_interrupted(ws):
        say(f"laminar: run {run_id} never finished (its process was killed); marked {INTERRUPTED}")
    for pid in stop_orphan_prefect_servers(ws):
        say(f"laminar: stopped Prefect server pid {pid} left behind by a killed run")


def _run_logging(ws: Workspace, run_id: str) -> logging.Handler:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    handler = logging.FileHandler(ws.logs / f"{run_id}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    laminar_log = logging.getLogger("laminar")
    laminar_log.setLevel(logging.INFO)
    laminar_log.addHandler(handler)
    laminar_log.propagate = False
    return handler


@dataclass
class RunResult:
    run_id: str
    summary: dict


def run_pipeline(
    cfg: Config,
    ws: Workspace,
    pipeline: Callable[..., list],
    *,
    overrides: Sequence[str],
    selection: Selection,
    command: str,
    flow_run_id: str | None = None,
    say: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
) -> RunResult:
    """One pipeline run: lock, runs row, ``pipeline(...)`` (the Prefect flow), summary, final status.

    Raises ``core.workspace.WorkspaceBusy`` at once, before writing anything, when another laminar
    process holds the workspace."""
    from core.artifacts import write_json_atomic
    from conf.loader import to_dict
    from tasks.summary import build_summary, catalog_metrics, format_table

    warn = warn or (lambda m: print(m, file=sys.stderr))
    with ws.lock():
        prepare_workspace(ws, warn)
        run_id = new_run_id()
        save_run_files(ws, run_id, cfg, command)
        handler = _run_logging(ws, run_id)
        t0 = time.perf_counter()
        with ws.catalog.transaction() as con:
            con.execute(
                "INSERT INTO runs VALUES (?, now(), NULL, 'running', ?, ?, ?)",
                [run_id, command, dumps(to_dict(cfg)), flow_run_id],
            )
        status, error = "failed", None
        _one_line_in_prefect_logs()
        from tasks import tracking

        n = len(selection.stages) if selection.stages is not None else len(STAGES)
        say(
            f"laminar: run {run_id}: {n} stages, each runs or comes from cache (when any must run, "
            "Prefect's local server starts first: ~15 s)"
        )
        tracker = tracking.start_run(cfg, ws, run_id, command)
        try:
            outcomes = pipeline(
                overrides=list(overrides),
                workspace=str(ws.root),
                run_id=run_id,
                force=list(selection.force),
                stages=selection.stages,
            )
            summary = build_summary(
                run_id, outcomes, time.perf_counter() - t0, catalog_metrics(cfg, ws, outcomes)
            )
            tracker.log_metrics("summary", {"seconds": summary["seconds"], **summary["metrics"]})
            write_json_atomic(ws.run_dir(run_id) / "summary.json", summary)
            say(format_table(summary))
            say(f"summary: {ws.run_dir(run_id) / 'summary.json'}")
            status = "completed"
            return RunResult(run_id, summary)
        except KeyboardInterrupt as err:
            status, error = INTERRUPTED, err
            raise
        except BaseException as err:
            error = err
            raise
        finally:
            try:
                finish_run(ws, run_id, status, error)
            finally:
                tracking.finish_run(tracker, status)
                logging.getLogger("laminar").removeHandler(handler)
                handler.close()


class _DropTraceback(logging.Filter):
    """Prefect logs a failing task's and flow's exception with its traceback; ``CatalogBusy`` and a
    ``StageError`` (a diverged loss, an unreadable source file) already say all in one line (which
    the CLI prints), so keep Prefect's line and drop the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from core.catalog import CatalogBusy
        from core.errors import StageError

        if record.exc_info and isinstance(record.exc_info[1], (CatalogBusy, StageError)):
            record.exc_info, record.exc_text = None, None
        return True


def _one_line_in_prefect_logs() -> None:
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTraceback) for f in logger.filters):
            logger.addFilter(_DropTraceback())


class RunRecordError(RuntimeError):
    """The run finished but its catalog row could not be closed."""


def finish_run(ws: Workspace, run_id: str, status: str, error: BaseException | None) -> None:
    """Close the ``runs`` row with ``status``. When the run is failing with ``error``, a failure here
    (a full disk, a catalog held open too long) never replaces it: ``error`` keeps propagating with
    this failure added as a note, and the row stays ``running`` (the next run marks it interrupted)."""
    try:
        with ws.catalog.transaction() as con:
            con.execute("UPDATE runs SET finished_at = now(), status = ? WHERE run_id = ?", [status, run_id])
    except Exception as close_err:  # noqa: BLE001 - reported on the error that matters
        detail = (
            f"{type(close_err).__name__}: {close_err}"
            if type(close_err) is not type(error)
            else f"{type(close_err).__name__}, as above"
        )
        note = f"laminar: also, run {run_id} could not be recorded as {status} in the catalog ({detail})"
        if error is None:
            raise RunRecordError(note.removeprefix("laminar: also, ")) from close_err
        logging.getLogger("laminar").error(note)
        error.add_note(note)


def record_flow_run(ws: Workspace, run_id: str, flow_run_id: str | None) -> None:
    """The Prefect flow run of a laminar run, unless an outer (scheduled) flow run is recorded already."""
    if flow_run_id:
        with ws.catalog.transaction() as con:
            con.execute(
                "UPDATE runs SET prefect_flow_run_id = coalesce(prefect_flow_run_id, ?) WHERE run_id = ?",
                [str(flow_run_id), run_id],
            )


# ---- reading the catalog while a run may be writing it ------------------------------------------


def query(ws: Workspace, sql: str, params: Sequence[Any] = ()) -> list[dict]:
    """``Catalog.query``: it waits (bounded) while a running pipeline holds DuckDB's lock for a write,
    then raises ``core.catalog.CatalogBusy``."""
    return ws.catalog.query(sql, params)


def workspace_busy(ws: Workspace) -> bool:
    """Whether a laminar process holds the workspace lock now. Read from ``/proc/locks`` (Linux), so
    asking never takes the lock and never makes a starting run fail; elsewhere: whether the pid the
    lock file names is alive."""
    path = ws.root / ".lock"
    if not path.exists():
        return False
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            return any(
                line.split()[1] == "FLOCK" and line.split()[5] == dev for line in f if len(line.split()) > 5
            )
    except OSError:
        pass
    try:
        pid = int(path.read_text().strip() or 0)
        if pid:
            os.kill(pid, 0)
            return True
    except (ValueError, ProcessLookupError, PermissionError):
        pass
    return False


# ---- laminar runs ---------------------------------------------------------------------------------


def _iso(v: Any) -> str | None:
    return v.isoformat(sep=" ", timespec="seconds") if isinstance(v, datetime) else (str(v) if v else None)


def list_runs(ws: Workspace, limit: int | None = None) -> dict:
    """Every run (newest first) with its stages' headline metrics and the checkpoints it made or used,
    and every checkpoint with the accuracy of its evaluations."""
    busy = workspace_busy(ws)
    runs = query(
        ws,
        "SELECT run_id, started_at, finished_at, status, command, prefect_flow_run_id FROM runs "
        "ORDER BY started_at DESC" + (f" LIMIT {int(limit)}" if limit else ""),
    )
    stage_rows = query(
        ws,
        "SELECT run_id, stage, status, cache_key, seconds, prefect_task_run_id, outputs_json, "
        "metrics_json FROM stage_runs ORDER BY started_at",
    )
    ckpts = query(
        ws,
        "SELECT checkpoint_sha, stage, step, base_sha, cache_key, created_at FROM checkpoints "
        "ORDER BY created_at",
    )
    evals = query(
        ws,
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
