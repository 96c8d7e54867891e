"""`laminar run reward=reward_model` through the real CLI on the micro model: the preferences and
reward_model stages run, the comparisons land in the catalog, summary.json names the reward model's
held-out accuracy beside its baselines, RL scores with it, and `laminar lineage` of the RL checkpoint
reaches the reward model and the comparisons' source hash; `laminar eval` scores with the workspace's
reward model. About 90 s on 2 cores: marked slow."""

from __future__ import annotations

import json

import duckdb
import pytest

from tests.configs import TINY_CURATED
from tests.e2e.test_operate import laminar, latest_summary, summaries

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RM_RUN = ("reward=reward_model", "reward_model.prompts=20", "reward_model.steps=5")


def test_reward_model_run_end_to_end(tmp_path):
    ws = tmp_path / "ws"
    laminar("run", *TINY_CURATED, *RM_RUN, ws=ws)
    s = latest_summary(ws)
    stages = list(s["stages"])
    assert stages.index("preferences") < stages.index("reward_model") < stages.index("rl")
    m = s["metrics"]
    for key in ("heldout_accuracy", "baseline_random_accuracy", "baseline_longer_wins_accuracy",
                "baseline_shorter_wins_accuracy", "baseline_policy_logprob_accuracy"):  # fmt: skip
        assert 0.0 <= m[f"reward_model_{key}"] <= 1.0
    for stage in ("eval_warmup", "eval_rft", "eval_rl"):  # the reward model as a metric
        held = s["stages"][stage]["metrics"]["arith_heldout"]
        assert 0.0 <= held["rm_best@2"] <= 1.0 and "reward/reward_model" in held and "maj@2" in held
    rl = s["stages"]["rl"]["metrics"]
    assert "reward/reward_model_first" in rl and rl["reward_errors/reward_model"] == 0
    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        (n,) = con.execute(
            "SELECT count(*) FROM comparisons WHERE artifact_sha = ?",
            [s["stages"]["preferences"]["artifacts"]["comparisons"]],
        ).fetchone()
        certs = con.execute(
            "SELECT DISTINCT certificate_json FROM eval_results WHERE checkpoint_sha = ?",
            [s["checkpoints"]["rl"]],
        ).fetchall()
    finally:
        con.close()
    assert n == s["stages"]["preferences"]["metrics"]["comparisons"] > 0
    # the RL checkpoint's certificate covers the reward model's preference prompts too
    comparisons_sha = s["stages"]["preferences"]["artifacts"]["comparisons"]
    assert certs and all(comparisons_sha in json.loads(c)["pools"] for (c,) in certs)
    assert all(json.loads(c)["status"] in ("clean", "contaminated-removed") for (c,) in certs)
    out = laminar("lineage", s["checkpoints"]["rl"][:12], ws=ws).stdout
    rm_sha = s["stages"]["reward_model"]["artifacts"]["model"]
    assert f"input reward_model: model {rm_sha[:16]} (from reward_model)" in out
    source = s["stages"]["preferences"]["metrics"]["source_sha256"]["simulated_annotators"]
    assert f"preferences: source simulated_annotators sha256 {source}" in out
    laminar("report", s["run_id"], ws=ws)  # the report plots the reward model per checkpoint
    report = (ws / "runs" / s["run_id"] / "report" / "report.md").read_text()
    section = report.split("## Learned reward model per checkpoint")[1].split("\n## ")[0]
    for role, stage in (("warm-up", "eval_warmup"), ("RL", "eval_rl")):  # RFT may keep warm-up weights
        held = s["stages"][stage]["metrics"]["arith_heldout"]
        assert f"| {role} | arith_heldout | 2 | {held['reward/reward_model']:.3f} |" in section
        assert f"| {held['rm_best@2']:.3f} |" in section
    assert (ws / "runs" / s["run_id"] / "report" / "reward_model.png").exists()
    ev = laminar("eval", f"ckpt={s['checkpoints']['rl'][:12]}", *TINY_CURATED, "reward=reward_model", ws=ws)
    assert f"scoring with reward model {rm_sha[:12]}" in ev.stdout
    assert "arith_heldout best of 2 reranked by the reward model" in ev.stdout
    # rank instead of verify: DART keeps the reward model's top-ranked responses, and the RFT
    # checkpoint's lineage reaches the reward model through them
    before = set(summaries(ws))
    laminar("run", *TINY_CURATED, *RM_RUN, "curation.dart.select=reward_model", ws=ws)
    (ranked,) = (v for k, v in summaries(ws).items() if k not in before)
    assert (
        ranked["stages"]["reward_model"]["status"] == "cached" and ranked["stages"]["dart"]["status"] == "ran"
    )
    dart = ranked["stages"]["dart"]["metrics"]
    assert dart["rft_examples"] > 0 and 0.0 <= dart["rm_kept_verified"] <= 1.0 and dart["rm_fallbacks"] == 0
    out = laminar("lineage", ranked["checkpoints"]["rft"][:12], ws=ws).stdout
    assert f"input reward_model: model {rm_sha[:16]} (from reward_model)" in out
