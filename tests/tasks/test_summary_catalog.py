"""The run summary names what it knows: the headline evaluations a run left out (``laminar rerun rl``
does not rerun ``eval_warmup``) come from the catalog, marked so, never ``n/a``."""

from __future__ import annotations

from core.artifacts import ArtifactRef
from tasks.cache import CacheKey
from tasks.records import StageOutcome, StageResult
from tasks.summary import build_summary, format_table


def _outcome(stage: str, metrics: dict, status: str = "ran") -> StageOutcome:
    return StageOutcome(
        stage,
        status,
        1.0,
        CacheKey(stage, "c", "i", "s", 0),
        StageResult({"eval": ArtifactRef("eval", "e" * 64, "artifacts/eval/" + "e" * 64)}, metrics),
        None,
    )


def test_a_rerun_reports_the_cached_headline_evaluations_from_the_catalog():
    rl = _outcome("eval_rl", {"arith_heldout": {"accuracy": 0.695}})
    catalog = {
        "eval_warmup": {"arith_heldout": {"accuracy": 0.343}},
        "eval_rft": {"arith_heldout": {"accuracy": 0.817}},
    }
    summary = build_summary("run-2", [rl], 3.0, catalog)
    assert (
        summary.metrics["heldout_accuracy_warmup"] == 0.343
        and summary.metrics["heldout_accuracy_rft"] == 0.817
    )
    assert summary.metrics_from_catalog == ["eval_rft", "eval_warmup"]
    final = format_table(summary).splitlines()[-1]
    assert final.startswith(
        "held-out accuracy: warm-up 0.343 (cached, from the catalog) -> RFT 0.817 (cached, "
        "from the catalog) -> RL 0.695 "
    )
    alone = format_table(build_summary("run-3", [rl], 3.0)).splitlines()[-1]
    assert "warm-up n/a -> RFT n/a -> RL 0.695" in alone  # nothing known: said so


def test_the_prefect_benchmark_table_marks_certificates_and_shows_the_reward_model(tmp_path):
    import json

    from evaluation.report import markdown_benchmark_table
    from tasks.summary import run_evals

    base = {"n_samples": 2, "n_problems": 3, "avg@2": 0.5, "accuracy": 0.5, "pass@1": 0.5, "pass@2": 0.6}
    base |= {"maj@2": 0.4, "mean_length": 9.0, "truncation_rate": 0.0, "verifier_errors": 0}
    outcomes = []
    for stage, rm in (("eval_warmup", {}), ("eval_rl", {"reward/reward_model": 0.7, "rm_best@2": 0.9})):
        folder = tmp_path / stage
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({"arith_heldout": {**base, **rm}}))
        metrics = {"checkpoint": "c" * 64, "arith_heldout": {"certificate": "not-checked"}}
        key = CacheKey(stage, "c", "i", "s", 0)
        result = StageResult({"eval": ArtifactRef("eval", "e" * 64, str(folder))}, metrics)
        outcomes.append(StageOutcome(stage, "ran", 1.0, key, result, None))
    evals = run_evals(outcomes)
    assert [(e.role, e.certificate, e.own) for e in evals] == [
        ("warmup", "not-checked", True),
        ("rl", "not-checked", True),
    ]
    head, _, warm, rl = markdown_benchmark_table(evals).splitlines()
    assert "arith_heldout (not-checked)" in warm and head.endswith("| RM score | rm_best@n |")
    assert warm.endswith("| - | - |") and rl.endswith("| 0.700 | 0.900 |")
