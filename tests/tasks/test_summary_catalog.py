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
