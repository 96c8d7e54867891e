"""``laminar status``: each stage cached or stale for a config, and why; read-only (no Prefect, no
stage body, no catalog write)."""

from __future__ import annotations

import json

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.nested import flatten
from core.workspace import Workspace
from tasks.cache import CacheKey
from tasks.dag import missing_upstream, stage_inputs, stage_key, stages_of
from tasks.records import Stage, StagePlan, StageResult


def finished_result(ws: Workspace, stage: str, key: CacheKey) -> StageResult | None:
    """The artifacts and metrics of the latest finished run of ``stage`` under ``key``, from the catalog."""
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


def plan(cfg: Config, ws: Workspace) -> list[StagePlan]:
    """Each stage cached or stale for ``cfg``, and why."""
    produced: dict[str, dict[str, ArtifactRef]] = {}
    out: list[StagePlan] = []
    for stage in stages_of(cfg):
        inputs = stage_inputs(stage, produced, cfg)
        if inputs is None:
            missing = ", ".join(missing_upstream(stage, produced, cfg))
            out.append(StagePlan(stage.name, "stale", f"upstream {missing} must run first", None))
            continue
        key = stage_key(stage, cfg, inputs, ws)
        found = finished_result(ws, stage.name, key)
        refs = found.artifacts if found is not None else {}
        if found is not None and all(ws.artifacts.exists(r) for r in refs.values()):
            produced[stage.name] = refs
            out.append(StagePlan(stage.name, "cached", "key matches a finished run", key))
            continue
        out.append(StagePlan(stage.name, "stale", _stale_reason(ws, stage, cfg, key, found), key))
    return out


def _stale_reason(ws: Workspace, stage: Stage, cfg: Config, key: CacheKey, found: StageResult | None) -> str:
    last = ws.catalog.query(
        "SELECT config_hash, inputs_hash, source_hash, seed, cache_key FROM stage_runs "
        "WHERE stage = ? ORDER BY finished_at DESC LIMIT 1",
        [stage.name],
    )
    if not last:
        return "never ran in this workspace"
    if found is not None:
        return "its artifact is missing from the store"
    r = last[0]
    prev = CacheKey(stage.name, r["config_hash"], r["inputs_hash"], r["source_hash"], r["seed"])
    parts = key.changed_parts(prev) or ["key"]
    if "config" in parts:
        keys = changed_config_keys(ws, stage, cfg, r["cache_key"])
        parts = [f"config ({keys})" if keys and p == "config" else p for p in parts]
    return "changed since last run: " + ", ".join(parts)


def changed_config_keys(ws: Workspace, stage: Stage, cfg: Config, prev_key: str, limit: int = 4) -> str:
    """The config keys whose values differ from the stage's last run (``rl.lr 0.0001 -> 0.0003``), from
    the stage config the lineage recorded under ``prev_key``; "" when it was not recorded."""
    from conf.loader import to_dict
    from core.catalog import dumps

    try:
        rows = ws.catalog.query("SELECT config_json FROM stage_lineage WHERE cache_key = ?", [prev_key])
    except Exception:  # noqa: BLE001 - a catalog from before stage_lineage existed: say only "config"
        return ""
    if not rows:
        return ""
    old = flatten(json.loads(rows[0]["config_json"]))
    new = flatten(json.loads(dumps(stage.config(cfg))))
    full = flatten(json.loads(dumps(to_dict(cfg))))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k, "(unset)") != new.get(k, "(unset)"))

    def name(k: str) -> str:  # the stage's subtree key as the full config key that holds the new value
        hits = [f for f in full if (f == k or f.endswith("." + k)) and full[f] == new.get(k)]
        return min(hits, key=len) if hits else k

    text = ", ".join(f"{name(k)} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in changed[:limit])
    return text + (f", and {len(changed) - limit} more" if len(changed) > limit else "")
