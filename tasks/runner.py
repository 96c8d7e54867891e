"""Runs stages as Prefect tasks with the pipeline's cache keys, and records lineage in the catalog.

``run_stage`` is called by the flow for each stage in DAG order. The Prefect task's
``cache_key_fn`` returns the stage's key, so an unchanged stage returns its cached result (small
artifact refs, JSON-serialised) without running its body; the catalog rows are written after
every stage, ran or cached, in one transaction with idempotent keys.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.catalog import dumps
from core.workspace import Workspace
from tasks.cache import CacheKey, make_key
from tasks.stages import STAGE_BY_NAME, STAGES, Stage, StageContext, StageResult

LOG = logging.getLogger("laminar.tasks")


@dataclass
class StageOutcome:
    stage: str
    status: str  # "ran" | "cached"
    seconds: float
    key: CacheKey
    result: StageResult
    task_run_id: str | None


def stage_key(
    stage: Stage, cfg: Config, inputs: dict[str, ArtifactRef], ws: Workspace | None = None
) -> CacheKey:
    hashes = {k: v.sha256 for k, v in inputs.items()}
    if stage.external is not None:
        hashes.update(stage.external(cfg, ws.catalog if ws is not None else None))
    return make_key(stage.name, stage.config(cfg), hashes, stage.modules, cfg.seed)


def _execute(
    stage_name: str, key: str, cfg: Config, workspace: str, inputs: dict[str, dict], device: str
) -> dict:
    """The body of every stage task: run the library function, return JSON-ready artifact refs."""
    ws = Workspace.at(workspace)
    state = ws.stage_state(stage_name, key)
    ctx = StageContext(
        cfg=cfg,
        store=ws.artifacts,
        inputs={k: ArtifactRef.from_dict(v) for k, v in inputs.items()},
        device=device,
        catalog=ws.catalog,
        state_dir=state,
    )
    out = (
        STAGE_BY_NAME[stage_name].body(ctx).to_dict(ws.artifacts)
    )  # Prefect stores paths relative to the workspace
    if state.exists():  # the artifact is complete: its resumable state is spent
        import shutil

        shutil.rmtree(state, ignore_errors=True)
    return out


_TASKS: dict[str, Any] = {}


def prefect_task(stage: Stage):
    """One Prefect task per stage, keyed by the pipeline's cache key, results stored as JSON."""
    if stage.name not in _TASKS:
        from prefect import task

        _TASKS[stage.name] = task(
            _execute,
            name=stage.name,
            cache_key_fn=lambda _ctx, params: params["key"],
            persist_result=True,
            result_serializer="json",
            log_prints=False,
        )
    return _TASKS[stage.name]


def run_stage(
    stage_name: str,
    cfg: Config,
    ws: Workspace,
    run_id: str,
    upstream: dict[str, StageOutcome],
    force: bool = False,
) -> StageOutcome:
    from generation.model import resolve_device

    device = resolve_device(cfg.device)
    stage = STAGE_BY_NAME[stage_name]
    inputs = {name: upstream[src].result.artifacts[out] for name, (src, out) in stage.inputs.items()}
    key = stage_key(stage, cfg, inputs, ws)
    t0 = time.perf_counter()
    started = datetime.now(UTC)
    task = prefect_task(stage)
    params = dict(
        stage_name=stage.name,
        key=key.digest,
        cfg=cfg,
        workspace=str(ws.root),
        inputs={k: v.to_dict() for k, v in inputs.items()},
        device=device,
    )
    state = task.with_options(refresh_cache=force or None)(**params, return_state=True)
    result = StageResult.from_dict(state.result(), ws.artifacts)
    status = "cached" if state.name == "Cached" else "ran"
    if status == "cached" and not all(ws.artifacts.exists(r) for r in result.artifacts.values()):
        # Prefect remembers a result whose artifact is gone (workspace cleaned by hand): rebuild it.
        state = task.with_options(refresh_cache=True)(**params, return_state=True)
        result, status = StageResult.from_dict(state.result(), ws.artifacts), "ran"
    outcome = StageOutcome(
        stage.name,
        status,
        time.perf_counter() - t0,
        key,
        result,
        str(state.state_details.task_run_id) if state.state_details.task_run_id else None,
    )
    record(ws, run_id, stage, outcome, inputs, started, cfg, device)
    from tasks.tracking import log_stage

    log_stage(ws, stage.name, outcome)
    LOG.info("stage %s %s in %.1fs key %s", stage.name, status, outcome.seconds, key.digest[:16])
    print(f"laminar: stage {stage.name:<14} {status:<6} {outcome.seconds:6.1f}s", flush=True)  # progress
    return outcome


def record(
    ws: Workspace,
    run_id: str,
    stage: Stage,
    out: StageOutcome,
    inputs: dict[str, ArtifactRef],
    started: datetime,
    cfg: Config,
    device: str,
) -> None:
    """Lineage rows for one stage, all or nothing."""
    ctx = StageContext(cfg=cfg, store=ws.artifacts, inputs=inputs, device=device)
    k = out.key
    with ws.catalog.transaction() as con:
        con.execute(
            "INSERT INTO stage_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, now(), ?, ?, ?, ?) "
            "ON CONFLICT DO UPDATE SET status = excluded.status, finished_at = excluded.finished_at, "
            "seconds = excluded.seconds, outputs_json = excluded.outputs_json, metrics_json = excluded.metrics_json",
            [
                run_id,
                stage.name,
                out.status,
                k.digest,
                k.config_hash,
                k.inputs_hash,
                k.source_hash,
                k.seed,
                started,
                out.seconds,
                out.task_run_id,
                dumps(out.result.to_dict(ws.artifacts)["artifacts"]),
                dumps(out.result.metrics),
            ],
        )
        for ref in out.result.artifacts.values():
            manifest = ws.artifacts.manifest(ref)
            con.execute(
                "INSERT INTO artifacts VALUES (?, ?, ?, now(), ?, ?, ?) ON CONFLICT DO NOTHING",
                [
                    ref.kind,
                    ref.sha256,
                    ws.artifacts.stored(ref)["path"],
                    stage.name,
                    k.digest,
                    dumps(manifest.get("meta", {})),
                ],
            )
            for parent in inputs.values():
                con.execute(
                    "INSERT INTO artifact_edges VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    [parent.kind, parent.sha256, ref.kind, ref.sha256, stage.name, k.digest],
                )
        if stage.record is not None:
            stage.record(con, ctx, out.result, k.digest)


def finished_result(ws: Workspace, stage: str, key: CacheKey) -> StageResult | None:
    """The artifacts and metrics of the latest finished run of ``stage`` under ``key``, from the catalog."""
    import json

    rows = ws.catalog.query(
        "SELECT outputs_json, metrics_json FROM stage_runs WHERE stage = ? AND cache_key = ? "
        "ORDER BY finished_at DESC LIMIT 1",
        [stage, key.digest],
    )
    if not rows:
        return None
    return StageResult.from_dict(
        {
            "artifacts": json.loads(rows[0]["outputs_json"]),
            "metrics": json.loads(rows[0]["metrics_json"] or "{}"),
        },
        ws.artifacts,
    )


def replay_cached(
    cfg: Config, ws: Workspace, run_id: str, stages: list[str] | None = None, force: list[str] | None = None
) -> list[StageOutcome] | None:
    """A run in which nothing would run, without Prefect: when no stage is forced and every selected
    stage's key matches a finished run whose artifacts are in the store (what ``plan`` calls cached),
    each stage's outcome is read from the catalog and recorded like a cached Prefect task's (stage
    rows, lineage, tracker), and the run needs no orchestrator, so no Prefect server is started (its
    start is most of a cached rerun's time). Returns None, having written nothing, when any stage
    would run; the caller then runs the Prefect flow. Never used with ``PREFECT_API_URL`` set: runs
    reported to a server stay visible there."""
    import os

    from tasks.lineage import record_stage
    from tasks.tracking import log_stage

    if force or os.environ.get("PREFECT_API_URL"):
        return None
    from generation.model import resolve_device

    device = resolve_device(cfg.device)
    found: dict[str, tuple[StageOutcome, dict[str, ArtifactRef], float]] = {}
    for stage in STAGES:
        if stages is not None and stage.name not in stages:
            continue
        if any(src not in found for src, _ in stage.inputs.values()):
            return None
        t0 = time.perf_counter()
        inputs = {name: found[src][0].result.artifacts[o] for name, (src, o) in stage.inputs.items()}
        key = stage_key(stage, cfg, inputs, ws)
        result = finished_result(ws, stage.name, key)
        if result is None or not all(ws.artifacts.exists(r) for r in result.artifacts.values()):
            return None
        found[stage.name] = (
            StageOutcome(stage.name, "cached", time.perf_counter() - t0, key, result, None),
            inputs,
            t0,
        )
    outcomes: dict[str, StageOutcome] = {}
    for name, (outcome, inputs, _) in found.items():
        started = datetime.now(UTC)
        outcomes[name] = outcome
        record(ws, run_id, STAGE_BY_NAME[name], outcome, inputs, started, cfg, device)
        record_stage(ws, name, cfg, outcomes)
        log_stage(ws, name, outcome)
        print(f"laminar: stage {name:<14} cached {outcome.seconds:6.1f}s", flush=True)
    return list(outcomes.values())


@dataclass
class StagePlan:
    stage: str
    status: str  # "cached" | "stale"
    reason: str
    key: CacheKey | None


def plan(cfg: Config, ws: Workspace) -> list[StagePlan]:
    """Each stage cached or stale for ``cfg``, and why: read-only, no Prefect, no stage body."""
    cat = ws.catalog
    produced: dict[str, dict[str, ArtifactRef]] = {}
    out: list[StagePlan] = []
    for stage in STAGES:
        missing = [src for src, _ in stage.inputs.values() if src not in produced]
        if missing:
            out.append(
                StagePlan(
                    stage.name, "stale", f"upstream {', '.join(sorted(set(missing)))} must run first", None
                )
            )
            continue
        inputs = {name: produced[src][o] for name, (src, o) in stage.inputs.items()}
        key = stage_key(stage, cfg, inputs, ws)
        found = finished_result(ws, stage.name, key)
        refs = found.artifacts if found is not None else {}
        if found is not None and all(ws.artifacts.exists(r) for r in refs.values()):
            produced[stage.name] = refs
            out.append(StagePlan(stage.name, "cached", "key matches a finished run", key))
            continue
        last = cat.query(
            "SELECT config_hash, inputs_hash, source_hash, seed, cache_key FROM stage_runs "
            "WHERE stage = ? ORDER BY finished_at DESC LIMIT 1",
            [stage.name],
        )
        if not last:
            reason = "never ran in this workspace"
        elif found is not None:
            reason = "its artifact is missing from the store"
        else:
            prev = CacheKey(
                stage.name,
                last[0]["config_hash"],
                last[0]["inputs_hash"],
                last[0]["source_hash"],
                last[0]["seed"],
            )
            parts = key.changed_parts(prev) or ["key"]
            if "config" in parts:
                keys = changed_config_keys(ws, stage, cfg, last[0]["cache_key"])
                parts = [f"config ({keys})" if keys and p == "config" else p for p in parts]
            reason = "changed since last run: " + ", ".join(parts)
        out.append(StagePlan(stage.name, "stale", reason, key))
    return out


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def changed_config_keys(ws: Workspace, stage: Stage, cfg: Config, prev_key: str, limit: int = 4) -> str:
    """The config keys whose values differ from the stage's last run (``rl.lr 0.0001 -> 0.0003``), from
    the stage config the lineage recorded under ``prev_key``; "" when it was not recorded."""
    import json

    from conf.loader import to_dict
    from core.catalog import dumps as cat_dumps

    try:
        rows = ws.catalog.query("SELECT config_json FROM stage_lineage WHERE cache_key = ?", [prev_key])
    except Exception:  # noqa: BLE001 - a catalog from before stage_lineage existed: say only "config"
        return ""
    if not rows:
        return ""
    old = _flatten(json.loads(rows[0]["config_json"]))
    new = _flatten(json.loads(cat_dumps(stage.config(cfg))))
    full = _flatten(json.loads(cat_dumps(to_dict(cfg))))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k, "(unset)") != new.get(k, "(unset)"))

    def name(k: str) -> str:  # the stage's subtree key as the full config key that holds the new value
        hits = [f for f in full if (f == k or f.endswith("." + k)) and full[f] == new.get(k)]
        return min(hits, key=len) if hits else k

    text = ", ".join(f"{name(k)} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in changed[:limit])
    return text + (f", and {len(changed) - limit} more" if len(changed) > limit else "")
