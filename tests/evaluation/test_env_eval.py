"""Evaluation per mixed environment (issue 52, part 5): with ``envs=[...]`` the eval stages score each
environment on its own held-out items, in that environment, and report every one beside the overall
(pooled, and weighted by the environments' weights), in the stage's metrics (catalog and summary) and
in ``rows.parquet`` (the catalog's ``eval_results``)."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from conf.loader import load_config
from conf.schema import EnvMixConfig, EvalConfig
from evaluation.stages import HELDOUT, evaluate_checkpoint
from generation.model import build_char_tokenizer
from tasks.stages.evaluate import eval_key, eval_metrics
from tests.training.rl_fakes import saved_model
from tests.training.test_env_mix import _items, ends_at_once

CALLS = "tests.training.test_env_mix:CallsOnce"


class GoldIsOne:
    """A verdict that marks a response correct when its problem's answer is ``1``: each environment's
    accuracy is then its items' share of answer ``1`` (known here), whatever the tiny model says."""

    def verify_batch(self, responses, golds):
        from rewards.verifier import Verdict

        return [Verdict(g == "1", r) for r, g in zip(responses, golds)]


def _rows(prefix: str, answers: list[str]) -> list[dict]:
    return [
        {"prompt_id": f"{prefix}{i}", "problem": f"What is {i}+{i}?", "answer": a, "level": 2}
        for i, a in enumerate(answers)
    ]


def test_each_mixed_environment_gets_its_own_heldout_accuracy_and_the_overall(tmp_path):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model_dir = saved_model(tmp_path / "model", ends_at_once(tok, _items(tok, 8)), tok)
    data = tmp_path / "data"
    data.mkdir()
    pl.DataFrame(_rows("h", ["1", "2", "1", "3"])).write_parquet(data / "heldout.parquet")  # 0.5 correct
    pool = tmp_path / "pool.parquet"
    pl.DataFrame(_rows("p", ["1", "1", "5"])).write_parquet(pool)  # 2/3 correct
    envs = [
        ("tool", EnvMixConfig(target=CALLS, max_turns=2, name="tool", weight=0.6)),
        ("single_turn", EnvMixConfig(target="single_turn", weight=0.3)),
        ("pooled", EnvMixConfig(target="single_turn", weight=0.1, name="pooled", pool=str(pool))),
    ]
    cfg = EvalConfig(n_samples=2, max_new_tokens=4, batch_size=8)
    out = tmp_path / "eval"
    out.mkdir()
    summary = evaluate_checkpoint(
        model_dir, data, cfg, templates={HELDOUT: "{problem}\n"}, seed=0, device="cpu", out_dir=out,
        judges={HELDOUT: GoldIsOne()}, envs=envs,
    )  # fmt: skip
    assert set(summary) == {HELDOUT, *(f"{HELDOUT}@{n}" for n in ("tool", "single_turn", "pooled", "all"))}
    tool, plain, pooled, overall = (
        summary[f"{HELDOUT}@{n}"] for n in ("tool", "single_turn", "pooled", "all")
    )
    # each in its own environment: the tool environment's episodes call once and answer (two turns)
    assert tool["turns_per_episode"] == 2.0 and tool["tool_calls_per_episode"] == 1.0
    assert "turns_per_episode" not in plain and "turns_per_episode" not in pooled  # single turn
    # each on its own items: the held-out set, or the item's own pool
    assert (tool["n_problems"], plain["n_problems"], pooled["n_problems"]) == (4, 4, 3)
    assert tool["accuracy"] == plain["accuracy"] == 0.5 and pooled["accuracy"] == pytest.approx(2 / 3)
    assert overall["n_problems"] == 11 and overall["accuracy"] == pytest.approx((2 + 2 + 2) / 11)
    assert overall["by_env"] == pytest.approx({"tool": 0.5, "single_turn": 0.5, "pooled": 2 / 3})
    assert overall["weighted_accuracy"] == pytest.approx(0.6 * 0.5 + 0.3 * 0.5 + 0.1 * 2 / 3)
    # the catalog's rows and the stage's metrics (what the summary and the catalog's stage row hold)
    rows = pl.read_parquet(out / "rows.parquet")
    counts = dict(rows.group_by("benchmark").len().iter_rows())
    assert counts == {HELDOUT: 8, f"{HELDOUT}@tool": 8, f"{HELDOUT}@single_turn": 8, f"{HELDOUT}@pooled": 6}
    metrics = eval_metrics("c" * 64, summary, 2)
    assert metrics[f"{HELDOUT}@pooled"]["accuracy"] == pytest.approx(2 / 3)
    assert metrics[f"{HELDOUT}@all"]["weighted_accuracy"] == overall["weighted_accuracy"]
    assert metrics[f"{HELDOUT}@all"]["by_env"] == overall["by_env"]


def test_the_eval_key_holds_the_mix_and_is_unchanged_without_one():
    plain = load_config([])
    mixed = load_config(
        ["envs=[{target: calculator, weight: 0.7, max_turns: 3}, {target: single_turn, weight: 0.3}]"]
    )
    assert "envs" not in eval_key(plain) and eval_key(mixed)["envs"][0]["target"] == "calculator"
