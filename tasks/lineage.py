"""Lineage of an artifact (a checkpoint, usually): its full upstream tree from the catalog.

For every stage that led to the artifact: its config subtree, cache key and key parts (config,
inputs, source fingerprint, seed), the source files behind the fingerprint with their hashes, its
inputs from outside the store (a model folder, benchmark files) with their hashes, its metrics (the
curation counts), the Prefect task run, the laminar run and the time it ran. Then the raw roots
(artifacts no stage read anything to make), the base model, the prompts an RL checkpoint trained
on, and the checkpoint's evaluations. ``openlineage_events`` turns the tree into OpenLineage run
events, one per stage.

What each cache key was made of comes from ``stage_lineage`` (written by
``tasks.recording.record_lineage`` after every stage): the catalog's ``stage_runs`` stores only the
key parts' hashes.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

from conf.schema import Config
from core.artifacts import hash_tree
from core.workspace import Workspace
from tasks.dag import MODEL, STAGE_BY_NAME, stage_headline

PRODUCER = "https://github.com/laminar-pipeline/laminar"
OPENLINEAGE_SCHEMA = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/definitions/RunEvent"
NAMESPACE = "laminar"


class LineageError(ValueError):
    pass


# ---- reading ---------------------------------------------------------------------------------------


def _q(ws: Workspace, sql: str, params=()) -> list[dict]:
    return ws.catalog.query(sql, params)


def _has_table(ws: Workspace, name: str) -> bool:
    return bool(_q(ws, "SELECT 1 FROM information_schema.tables WHERE table_name = ?", [name]))


def _time(v: Any) -> str | None:
    if isinstance(v, datetime):
        return (v if v.tzinfo else v.replace(tzinfo=UTC)).isoformat().replace("+00:00", "Z")
    return None


def resolve(ws: Workspace, spec: str) -> dict:
    """An artifact by sha prefix (a checkpoint first), or a ``save_pretrained`` folder hashed like one."""
    path = Path(spec).expanduser()
    if path.is_dir():
        spec = hash_tree(path.resolve())
    prefix = spec.lower()
    if len(prefix) < 4 or any(c not in "0123456789abcdef" for c in prefix):
        raise LineageError(
            f"{spec!r} is neither a folder nor an artifact sha prefix (at least 4 hex characters); "
            "`laminar runs` lists the checkpoints"
        )
    rows = _q(
        ws,
        "SELECT kind, sha256, path, stage, cache_key FROM artifacts WHERE sha256 LIKE ? "
        "ORDER BY kind = 'model' DESC, created_at DESC",
        [prefix + "%"],
    )
    if not rows:
        known = _q(ws, "SELECT checkpoint_sha, stage FROM checkpoints ORDER BY created_at DESC LIMIT 8")
        listing = "; ".join(f"{r['checkpoint_sha'][:12]} ({r['stage']})" for r in known)
        raise LineageError(
            f"no artifact in {ws.root} starts with {prefix!r}"
            + (f"; checkpoints: {listing}" if listing else " (its catalog has none; run `laminar run`)")
        )
    shas = {r["sha256"] for r in rows}
    if len(shas) > 1:
        listing = "; ".join(f"{r['sha256'][:16]} ({r['kind']}, {r['stage']})" for r in rows)
        raise LineageError(f"{spec!r} is ambiguous: {listing}; give more characters")
    row = dict(rows[0])
    row["path"] = ws.artifacts.locate_path(row["kind"], row["sha256"], row["path"])
    return row


def _producer(ws: Workspace, kind: str, sha: str, stage: str | None = None) -> dict | None:
    """The stage run that made an artifact: a run that ran it (else served it from cache), latest first.
    ``stage``: the stage the reader's input comes from (one artifact can be the output of two stages,
    e.g. a stage that passes its input model through)."""
    rows = _q(
        ws,
        "SELECT s.*, r.prefect_flow_run_id FROM stage_runs s LEFT JOIN runs r USING (run_id) "
        "WHERE s.outputs_json LIKE ? ORDER BY s.status = 'ran' DESC, s.finished_at DESC",
        [f"%{sha}%"],
    )
    rows = [
        r
        for r in rows
        if any(
            v["sha256"] == sha and v["kind"] == kind for v in json.loads(r["outputs_json"] or "{}").values()
        )
    ]
    preferred = [r for r in rows if r["stage"] == stage]
    return (preferred or rows or [None])[0]


def _run_config(ws: Workspace, run_id: str) -> dict:
    rows = _q(ws, "SELECT config_json FROM runs WHERE run_id = ?", [run_id])
    return json.loads(rows[0]["config_json"] or "{}") if rows else {}


def _stage_config_fallback(stage_name: str, run_cfg: dict) -> Any:
    """The stage's config subtree rebuilt from the run's config (for keys recorded before
    ``stage_lineage``)."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), run_cfg))
        return STAGE_BY_NAME[stage_name].config(cfg)
    except Exception:  # noqa: BLE001 - a config of an older schema: show the run's whole config
        return {"run_config": run_cfg}


def _node(ws: Workspace, kind: str, sha: str, lineage_ok: bool, stage: str | None = None) -> dict:
    """One stage of the tree: the stage run that made (kind, sha) and its input artifacts."""
    prod = _producer(ws, kind, sha, stage)
    if prod is None:
        art = _q(ws, "SELECT stage, cache_key FROM artifacts WHERE kind = ? AND sha256 = ?", [kind, sha])
        return {
            "stage": art[0]["stage"] if art else None,
            "cache_key": art[0]["cache_key"] if art else None,
            "outputs": {kind: sha},
            "inputs": {},
            "external": {},
            "status": "unknown",
        }
    key = prod["cache_key"]
    rec = _q(ws, "SELECT * FROM stage_lineage WHERE cache_key = ?", [key]) if lineage_ok else []
    runs = _q(ws, "SELECT run_id, status FROM stage_runs WHERE cache_key = ? ORDER BY finished_at", [key])
    if rec:
        r = rec[0]
        inputs = {
            n: {"kind": v["kind"], "sha256": v["sha256"]} for n, v in json.loads(r["inputs_json"]).items()
        }
        config, external = json.loads(r["config_json"]), json.loads(r["external_json"])
        sources, verified = json.loads(r["sources_json"]), r["verified"]
    else:
        edges = _q(
            ws,
            "SELECT parent_kind, parent_sha FROM artifact_edges WHERE child_sha = ? AND cache_key = ? "
            "ORDER BY parent_kind",
            [sha, key],
        )
        stage = STAGE_BY_NAME.get(prod["stage"])
        names = {o: n for n, (_, o) in stage.inputs.items()} if stage else {}
        inputs = {
            names.get(e["parent_kind"], e["parent_kind"]): {
                "kind": e["parent_kind"],
                "sha256": e["parent_sha"],
            }
            for e in edges
        }
        config, external, sources, verified = (
            _stage_config_fallback(prod["stage"], _run_config(ws, prod["run_id"])),
            {},
            {},
            None,
        )
    metrics = json.loads(prod["metrics_json"] or "{}")
    return {
        "stage": prod["stage"],
        "cache_key": key,
        "config_hash": prod["config_hash"],
        "inputs_hash": prod["inputs_hash"],
        "source_hash": prod["source_hash"],
        "seed": prod["seed"],
        "config": config,
        "inputs": inputs,
        "external": external,
        "source_files": sources,
        "inputs_verified": verified,
        "outputs": {n: v["sha256"] for n, v in json.loads(prod["outputs_json"] or "{}").items()},
        "metrics": metrics,
        "headline": stage_headline(prod["stage"], metrics),
        "run_id": prod["run_id"],
        "status": prod["status"],
        "prefect_task_run_id": prod["prefect_task_run_id"],
        "prefect_flow_run_id": prod["prefect_flow_run_id"],
        "started_at": _time(prod["started_at"]),
        "finished_at": _time(prod["finished_at"]),
        "seconds": prod["seconds"],
        "runs": [{"run_id": x["run_id"], "status": x["status"]} for x in runs],
    }


def lineage(ws: Workspace, spec: str, prompts: bool = False) -> dict:
    """The upstream tree of the artifact ``spec`` names (see the module doc), JSON-ready."""
    if not ws.catalog.path.exists():
        raise LineageError(f"no catalog in {ws.root}; pass --workspace DIR of a workspace `laminar run` used")
    target = resolve(ws, spec)
    lineage_ok = _has_table(ws, "stage_lineage")
    stages: list[dict] = []  # upstream first
    seen: dict[str, dict] = {}  # cache key -> node
    made_by: dict[str, str] = {}  # artifact sha -> cache key of the stage that made it

    def visit(kind: str, sha: str, stage: str | None) -> str:
        node = _node(ws, kind, sha, lineage_ok, stage)
        key = node["cache_key"] or f"unknown:{sha}"
        made_by.setdefault(sha, key)
        if key in seen:
            return key
        seen[key] = node
        spec = STAGE_BY_NAME.get(node["stage"] or "")
        node["upstream"] = {
            name: visit(
                v["kind"], v["sha256"], spec.inputs[name][0] if spec and name in spec.inputs else None
            )
            for name, v in node["inputs"].items()
        }
        stages.append(node)
        return key

    visit(target["kind"], target["sha256"], None)
    for node in stages:
        node["upstream_keys"] = node.pop("upstream")
        node["upstream_stages"] = {name: seen[k]["stage"] for name, k in node["upstream_keys"].items()}

    arts = {}
    for node in stages:
        for sha in node["outputs"].values():
            rows = _q(ws, "SELECT kind, sha256, path, meta_json FROM artifacts WHERE sha256 = ?", [sha])
            if rows:
                arts[sha] = {
                    "kind": rows[0]["kind"],
                    "sha256": sha,
                    "path": ws.artifacts.locate_path(rows[0]["kind"], sha, rows[0]["path"]),
                    "meta": json.loads(rows[0]["meta_json"] or "{}"),
                    "stage": node["stage"],
                }
    roots = []
    for node in stages:
        if not node["inputs"]:
            for name, sha in node["outputs"].items():
                roots.append(
                    {
                        "stage": node["stage"],
                        "artifact": name,
                        "sha256": sha,
                        "made_from": "its config and seed" if not node["external"] else "external inputs",
                    }
                )
        for name, h in node["external"].items():
            roots.append({"stage": node["stage"], "external": name, "sha256": h})
        for name, h in (
            node["metrics"].get("source_sha256") or {}
        ).items():  # files a stage made its rows from
            roots.append({"stage": node["stage"], "source": name, "sha256": h})

    ckpt = _q(
        ws,
        "SELECT checkpoint_sha, stage, step, base_sha FROM checkpoints WHERE checkpoint_sha = ?",
        [target["sha256"]],
    )
    base = _base_model(seen, seen[made_by[target["sha256"]]], target)
    if base is not None:
        base["provenance"] = _provenance(ws, base["sha256"])
    result = {
        "workspace": str(ws.root),
        "artifact": {
            "kind": target["kind"],
            "sha256": target["sha256"],
            "path": target["path"],
            "stage": seen[made_by[target["sha256"]]]["stage"],
        },
        "checkpoint": (
            {
                "sha256": ckpt[0]["checkpoint_sha"],
                "stage": ckpt[0]["stage"],
                "step": ckpt[0]["step"],
                "base_sha": ckpt[0]["base_sha"],
            }
            if ckpt
            else None
        ),
        "base_model": base,
        "stages": stages,
        "artifacts": arts,
        "sources": roots,
        "curation": [
            {"stage": n["stage"], "config": n["config"], "metrics": n["metrics"], "headline": n["headline"]}
            for n in stages
            if _is_curation(n["stage"])
        ],
        "evaluations": _evaluations(ws, target["sha256"]) if target["kind"] == MODEL else [],
    }
    if prompts:
        result["prompts"] = _prompts(ws, stages, target)
    return result


def _is_curation(stage_name: str | None) -> bool:
    stage = STAGE_BY_NAME.get(stage_name or "")
    return bool(stage and stage.curates)


def _base_model(seen: dict[str, dict], node: dict, target: dict) -> dict | None:
    """The model at the root of the checkpoint's chain of model inputs."""
    if target["kind"] != MODEL:
        return None
    sha = target["sha256"]
    for _ in range(len(seen)):
        name = next((n for n, v in node["inputs"].items() if v["kind"] == MODEL), None)
        if name is None:
            break
        sha, node = node["inputs"][name]["sha256"], seen[node["upstream_keys"][name]]
    return {
        "sha256": sha,
        "stage": node["stage"],
        "config": node["config"],
        "metrics": node["metrics"],
        "external": node["external"],
    }


def _provenance(ws: Workspace, sha: str) -> dict | None:
    """Where a fetched pretrained base came from (``generation.pretrained``: wheel, GGUF hash,
    conversion), from the ``provenance.json`` the base-model stage copied; None for other bases."""
    from generation.pretrained import read_provenance

    return read_provenance(ws.artifacts.root / MODEL / sha)


def _evaluations(ws: Workspace, sha: str) -> list[dict]:
    has_cert = bool(
        _q(
            ws,
            "SELECT 1 FROM information_schema.columns WHERE table_name = 'eval_results' "
            "AND column_name = 'certificate_json'",
        )
    )
    cert = "any_value(e.certificate_json)" if has_cert else "NULL"
    rows = _q(
        ws,
        "SELECT e.eval_sha, e.benchmark, count(DISTINCT e.problem_id) AS problems, count(*) AS samples, "
        "avg(CAST(e.correct AS DOUBLE)) AS accuracy, avg(e.length) AS mean_length, "
        f"avg(CAST(e.truncated AS DOUBLE)) AS truncation_rate, {cert} AS certificate FROM eval_results e "
        "WHERE e.checkpoint_sha = ? GROUP BY e.eval_sha, e.benchmark ORDER BY e.eval_sha, e.benchmark",
        [sha],
    )
    out = []
    for r in rows:
        runs = _q(
            ws,
            "SELECT run_id, stage, status FROM stage_runs WHERE outputs_json LIKE ? AND metrics_json LIKE ? "
            "ORDER BY finished_at",
            [f"%{r['eval_sha']}%", f"%{sha}%"],
        )
        out.append(
            {
                "eval": r["eval_sha"],
                "benchmark": r["benchmark"],
                "problems": r["problems"],
                "samples": r["samples"],
                "accuracy": r["accuracy"],
                "mean_length": r["mean_length"],
                "truncation_rate": r["truncation_rate"],
                "certificate": json.loads(r["certificate"]) if r["certificate"] else None,
                "by": [{"run_id": x["run_id"], "stage": x["stage"], "status": x["status"]} for x in runs],
            }
        )
    return out


def _prompts(ws: Workspace, stages: list[dict], target: dict) -> dict:
    """Prompts each trained checkpoint of the tree consumed (``consumed_prompts``), with their text
    and level."""
    datasets = sorted({v["sha256"] for n in stages for v in n["inputs"].values() if v["kind"] != MODEL})
    models = [sha for n in stages for sha in n["outputs"].values()]
    per: dict[str, list[dict]] = {}
    join = (
        (
            "LEFT JOIN (SELECT prompt_id, any_value(problem) AS problem, any_value(level) AS level, "
            "any_value(split) AS split FROM prompts WHERE artifact_sha IN ("
            + ", ".join("?" * len(datasets))
            + ") GROUP BY prompt_id) p USING (prompt_id) "
        )
        if datasets
        else ""
    )
    cols = "p.problem, p.level, p.split" if datasets else "NULL AS problem, NULL AS level, NULL AS split"
    for sha in models:
        rows = _q(
            ws,
            f"SELECT c.prompt_id, c.n_trajectories, {cols} FROM consumed_prompts c {join}"
            "WHERE c.checkpoint_sha = ? ORDER BY c.prompt_id",
            [*datasets, sha],
        )
        if rows:
            per[sha] = [
                {
                    "prompt_id": r["prompt_id"],
                    "n": r["n_trajectories"],
                    "problem": r["problem"],
                    "level": r["level"],
                    "split": r["split"],
                }
                for r in rows
            ]
    own = per.get(target["sha256"], [])
    return {
        "checkpoint": target["sha256"],
        "trajectories": sum(p["n"] for p in own),
        "distinct": len(own),
        "prompts": own,
        "upstream": {
            sha: {"trajectories": sum(p["n"] for p in v), "prompts": v}
            for sha, v in per.items()
            if sha != target["sha256"]
        },
    }


# ---- text --------------------------------------------------------------------------------------------


def _short(obj: Any, width: int = 100) -> str:
    text = json.dumps(obj, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def reward_line(spec: list[dict]) -> str:
    """The reward components a stage scored with (``rewards.compose.Reward.spec``), on one line:
    ``math_verify x1 + cosine_length x0.5 {"max_len": null, ...}``; a plug-in with its target
    (``judge (my_pkg.rewards:judge) [verdict] x1``), a verdict other than ``math_verify`` marked."""
    parts = []
    for c in spec:
        params = {k: v for k, v in (c.get("params") or {}).items() if v is not None}
        name = c["name"] + (f" ({c['target']})" if c.get("target") else "")
        name += " [verdict]" if c.get("correctness") and c["name"] != "math_verify" else ""
        shown = f" {json.dumps(params, sort_keys=True)}" if params else ""
        parts.append(f"{name} x{c['weight']:g}{shown}")
    return " + ".join(parts)


def _model_shown(config: Any) -> Any:
    """A base model's config as lineage shows it: a loaded model (``kind=hf``) by its kind and the
    name it was fetched as (its store folder is the base model's sha), else its folder; the
    architecture fields are the built-in tiny model's and say nothing about it."""
    if isinstance(config, dict) and config.get("kind") == "hf":
        return {k: config.get(k) for k in ("kind", "pretrained" if config.get("pretrained") else "path")}
    return config


def format_lineage(lin: dict) -> str:
    a = lin["artifact"]
    lines = [f"lineage of {a['kind']} {a['sha256']}  (made by {a['stage']})", f"  path {a['path']}"]
    if lin["checkpoint"]:
        c = lin["checkpoint"]
        lines.append(f"  checkpoint of stage {c['stage']}, step {c['step']}")
    if lin["base_model"]:
        b = lin["base_model"]
        lines.append(
            f"  base model {b['sha256'][:16]} (stage {b['stage']}; {_short(_model_shown(b['config']), 80)})"
        )
        p = b.get("provenance")
        if p:
            lines.append(
                f"    fetched: {p['model']} ({p['licence']}) from wheel {p['wheel']} "
                f"sha256 {p['wheel_sha256']}"
            )
            lines.append(f"    gguf {p['gguf']} sha256 {p['gguf_sha256']}")
            lines.append(f"    conversion: {p['conversion']} (with {p['converter']})")
    adapter = Path(a["path"]) / "adapter_config.json"
    if a["kind"] == "model" and adapter.is_file():  # a LoRA checkpoint: its own artifact on top of a base
        conf = json.loads(adapter.read_text())
        lines.append(
            f"  LoRA adapter (rank {conf.get('r')}, alpha {conf.get('lora_alpha')}) on base "
            f"{str(conf.get('base_model_name_or_path'))[:16]}"
        )
    lines += ["", f"stages ({len(lin['stages'])}, upstream first):"]
    for n in lin["stages"]:
        lines.append(f"  {n['stage']}")
        lines.append(
            f"    ran {n.get('started_at') or '?'} in run {n.get('run_id') or '?'}"
            f"  ({len(n.get('runs', []))} runs used this key)"
        )
        lines.append(
            f"    prefect task run {n.get('prefect_task_run_id') or '-'}  flow run "
            f"{n.get('prefect_flow_run_id') or '-'}"
        )
        lines.append(f"    cache key {n['cache_key']}")
        lines.append(f"    config {_short(n.get('config'))}")
        reward = (n.get("config") or {}).get("reward")
        if isinstance(reward, list):
            lines.append(f"    reward {reward_line(reward)}")
        src = n.get("source_files") or {}
        lines.append(
            f"    source fingerprint {n.get('source_hash') or '?'} ({len(src)} files"
            + (
                ": "
                + ", ".join(f"{v['path']} {v['sha256'][:12]}" for v in list(src.values())[:4])
                + (" ..." if len(src) > 4 else "")
                if src
                else ""
            )
            + ")"
        )
        lines.append(
            f"    seed {n.get('seed')}  config hash {str(n.get('config_hash'))[:16]}  inputs hash "
            f"{str(n.get('inputs_hash'))[:16]}"
            + ("" if n.get("inputs_verified") in (None, True) else "  (inputs differ from the key's hash!)")
        )
        for name, v in n["inputs"].items():
            up = n.get("upstream_stages", {}).get(name, "?")
            lines.append(f"    input {name}: {v['kind']} {v['sha256'][:16]} (from {up})")
        for name, h in n.get("external", {}).items():
            lines.append(f"    external {name}: {h}")
        for name, sha in n["outputs"].items():
            lines.append(f"    output {name}: {sha}")
        if n.get("headline") or n.get("metrics"):
            lines.append(f"    metrics {n.get('headline') or _short(n.get('metrics'))}")
    lines += ["", "sources (the roots of the tree):"]
    for s in lin["sources"]:
        if "external" in s:
            lines.append(f"  {s['stage']}: external {s['external']} sha256 {s['sha256']}")
        elif "source" in s:
            lines.append(f"  {s['stage']}: source {s['source']} sha256 {s['sha256']}")
        else:
            lines.append(f"  {s['stage']}: {s['artifact']} sha256 {s['sha256']} (made from {s['made_from']})")
    if lin["curation"]:
        lines += ["", "curation decisions:"]
        for c in lin["curation"]:
            lines.append(f"  {c['stage']}: {c['headline'] or _short(c['metrics'])}")
            lines.append(f"    parameters {_short(c['config'])}")
    lines += ["", "evaluations:"]
    for e in lin["evaluations"]:
        by = ", ".join(f"{x['stage']} in {x['run_id']}" for x in e["by"][:3])
        lines.append(
            f"  {e['benchmark']:<14} acc {e['accuracy']:.3f}  {e['problems']} problems, "
            f"{e['samples']} samples  eval {e['eval'][:12]}" + (f"  ({by})" if by else "")
        )
        c = e.get("certificate")
        if c:
            lines.append(
                f"    decontamination: {c['status']} against {e['benchmark']} sha256 "
                f"{str(c.get('benchmark_sha256'))[:12]}"
                + (f"; {c['detail']}" if c.get("detail") else "")
                + (f"; rules {', '.join(c['rules'])}" if c.get("rules") else "")
            )
    if not lin["evaluations"]:
        lines.append("  (none; `laminar eval ckpt=...` evaluates it)")
    if "prompts" in lin:
        p = lin["prompts"]
        lines += ["", f"prompts trained on: {p['distinct']} prompts, {p['trajectories']} trajectories"]
        for r in p["prompts"]:
            lines.append(
                f"  {r['prompt_id']:<24} x{r['n']:<4} level {r['level'] if r['level'] is not None else '-'}"
                f"  {(r['problem'] or '')[:60]!r}"
            )
        for sha, u in p["upstream"].items():
            lines.append(
                f"  upstream checkpoint {sha[:12]}: {len(u['prompts'])} prompts, "
                f"{u['trajectories']} trajectories"
            )
    return "\n".join(lines)


# ---- OpenLineage -----------------------------------------------------------------------------------


def _uuid(value: str | None, fallback: str) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except (ValueError, TypeError):
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"laminar:{fallback}"))


def _facet(schema: str, **fields) -> dict:
    return {"_producer": PRODUCER, "_schemaURL": schema, **fields}


def _dataset(lin: dict, kind: str, sha: str) -> dict:
    art = lin["artifacts"].get(sha)
    path = art["path"] if art else str(Path(lin["workspace"]) / "artifacts" / kind / sha)
    return {
        "namespace": "file",
        "name": path,
        "facets": {
            "version": _facet(
                "https://openlineage.io/spec/facets/1-0-1/DatasetVersionDatasetFacet.json"
                "#/$defs/DatasetVersionDatasetFacet",
                datasetVersion=sha,
            ),
            "dataSource": _facet(
                "https://openlineage.io/spec/facets/1-0-1/DatasourceDatasetFacet.json"
                "#/$defs/DatasourceDatasetFacet",
                name=f"laminar-{kind}",
                uri=f"file://{path}",
            ),
            "laminar_artifact": _facet(
                f"{PRODUCER}/blob/main/docs/openlineage.json#/$defs/ArtifactFacet", kind=kind, sha256=sha
            ),
        },
    }


def openlineage_events(lin: dict) -> list[dict]:
    """One OpenLineage ``RunEvent`` (eventType COMPLETE) per stage of the tree, upstream first."""
    events = []
    for n in lin["stages"]:
        run_facets = {
            "laminar_stage": _facet(
                f"{PRODUCER}/blob/main/docs/openlineage.json#/$defs/StageRunFacet",
                cacheKey=n["cache_key"],
                configHash=n.get("config_hash"),
                inputsHash=n.get("inputs_hash"),
                sourceHash=n.get("source_hash"),
                seed=n.get("seed"),
                config=n.get("config"),
                metrics=n.get("metrics"),
                status=n.get("status"),
                laminarRunId=n.get("run_id"),
                prefectTaskRunId=n.get("prefect_task_run_id"),
                sourceFiles=n.get("source_files"),
                external=n.get("external"),
            ),
            "processing_engine": _facet(
                "https://openlineage.io/spec/facets/1-1-1/ProcessingEngineRunFacet.json"
                "#/$defs/ProcessingEngineRunFacet",
                version=_prefect_version(),
                name="prefect",
                openlineageAdapterVersion="laminar",
            ),
        }
        if n.get("run_id"):
            run_facets["parent"] = _facet(
                "https://openlineage.io/spec/facets/1-1-0/ParentRunFacet.json#/$defs/ParentRunFacet",
                run={"runId": _uuid(n.get("prefect_flow_run_id"), n["run_id"])},
                job={"namespace": NAMESPACE, "name": "laminar-pipeline"},
            )
        inputs = [_dataset(lin, v["kind"], v["sha256"]) for v in n["inputs"].values()]
        inputs += [
            {
                "namespace": f"{NAMESPACE}-external",
                "name": name,
                "facets": {
                    "version": _facet(
                        "https://openlineage.io/spec/facets/1-0-1/DatasetVersionDatasetFacet.json"
                        "#/$defs/DatasetVersionDatasetFacet",
                        datasetVersion=h,
                    )
                },
            }
            for name, h in n.get("external", {}).items()
        ]
        outputs = [
            _dataset(lin, lin["artifacts"].get(sha, {}).get("kind", name), sha)
            for name, sha in n["outputs"].items()
        ]
        events.append(
            {
                "eventType": "COMPLETE",
                "eventTime": n.get("finished_at") or datetime.now(UTC).isoformat().replace("+00:00", "Z"),
                "producer": PRODUCER,
                "schemaURL": OPENLINEAGE_SCHEMA,
                "run": {"runId": _uuid(n.get("prefect_task_run_id"), n["cache_key"]), "facets": run_facets},
                "job": {
                    "namespace": NAMESPACE,
                    "name": n["stage"] or "unknown",
                    "facets": {
                        "jobType": _facet(
                            "https://openlineage.io/spec/facets/2-0-3/JobTypeJobFacet.json#/$defs/JobTypeJobFacet",
                            processingType="BATCH",
                            integration="LAMINAR",
                            jobType="STAGE",
                        )
                    },
                },
                "inputs": inputs,
                "outputs": outputs,
            }
        )
    return events


def _prefect_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prefect")
    except PackageNotFoundError:
        return "unknown"
