"""The end-of-run summary says when a stage's output is clearly broken, and the torch thread count is
part of every training and sampling stage's cache key."""

from __future__ import annotations

import pytest

from conf.loader import load_config
from tasks.cache import CacheKey
from tasks.dag import STAGE_BY_NAME
from tasks.records import StageOutcome, StageResult
from tasks.summary import build_summary, format_table, run_warnings


def outcome(stage: str, metrics: dict) -> StageOutcome:
    return StageOutcome(stage, "ran", 1.0, CacheKey(stage, "c", "i", "s", 0), StageResult({}, metrics), None)


def held(acc: float) -> dict:
    return {"arith_heldout": {"accuracy": acc}}


def by(**stages: dict) -> dict:
    return {name: outcome(name, m) for name, m in stages.items()}


def test_a_healthy_run_has_no_warnings():
    assert (
        run_warnings(
            by(
                eval_warmup=held(0.45),
                eval_rft=held(0.80),
                eval_rl=held(0.86),
                rl={"reward_peak5": 0.8, "reward_last5": 0.78},
            )
        )
        == []
    )


def test_a_warmup_that_learned_nothing_is_named():
    (w,) = run_warnings(by(eval_warmup=held(0.01), eval_rft=held(0.02), eval_rl=held(0.03)))
    assert w.startswith("warm-up accuracy 0.010 on arith_heldout")


def test_a_collapsed_rl_reward_is_named():
    (w,) = run_warnings(by(rl={"reward_peak5": 0.7, "reward_last5": 0.2}))
    assert "RL reward collapsed" in w and "0.200" in w and "0.700" in w
    # a reward that never rose above noise is not a collapse
    assert run_warnings(by(rl={"reward_peak5": 0.05, "reward_last5": 0.0})) == []


def test_rl_ending_below_rft_is_named_beyond_noise():
    (w,) = run_warnings(by(eval_rft=held(0.80), eval_rl=held(0.70)))
    assert "RL ended below where it started on arith_heldout: 0.700 after RL against 0.800" in w
    assert run_warnings(by(eval_rft=held(0.80), eval_rl=held(0.79))) == []  # within 0.02: noise


def test_warnings_reach_the_summary_and_the_final_table():
    outcomes = [
        outcome("eval_warmup", held(0.0)),
        outcome("eval_rft", held(0.5)),
        outcome("eval_rl", held(0.3)),
    ]
    summary = build_summary("r1", outcomes, 12.0)
    assert len(summary.warnings) == 2
    table = format_table(summary)
    assert table.count("WARNING: ") == 2 and "RL ended below where it started" in table


@pytest.fixture(scope="module")
def configs():
    return {t: load_config([f"threads={t}"]) for t in (0, 1, 2)}


@pytest.mark.parametrize(
    "stage",
    ["warmup", "eval_warmup", "difficulty", "dart", "rft", "eval_rft", "difficulty_rft", "rl", "eval_rl"],
)
def test_threads_enter_the_cache_key_of_every_stage_that_computes_with_torch(stage, configs):
    one, two = configs[1], configs[2]
    s = STAGE_BY_NAME[stage]
    assert s.config(one)["torch_threads"] == 1 and s.config(two)["torch_threads"] == 2


def test_threads_zero_resolves_to_torchs_own_count(configs):
    from generation.setup import _DEFAULT_THREADS

    assert STAGE_BY_NAME["warmup"].config(configs[0])["torch_threads"] == _DEFAULT_THREADS >= 1
    # stages that compute nothing with torch floats keep their keys across thread counts
    for stage in ("data", "ingest", "decontaminate", "select"):
        assert "torch_threads" not in STAGE_BY_NAME[stage].config(configs[1])
