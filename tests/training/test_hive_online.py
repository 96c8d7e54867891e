"""HIVE's online selection inside the RL loop, the engine's prompt entropy, difficulty sampling and
the in-run evaluation hook, on a micro model."""

import math

import polars as pl
import torch
from rl_fakes import MICRO, Verdict, saved_model

from data_curation.hive import GresoFilter
from data_curation.sampling import estimate_difficulty, seeded_subset
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, save_model
from conf.schema import RLConfig
from training.objectives import PRESETS
from generation.engine import Engine
from training.rl.drivers.local import LocalDriver
from training.rl.loop import HiveSource, PromptCursor
from generation.records import PromptItem


class StartsWithDigit:
    def verify_batch(self, responses, golds):
        return [Verdict(r[:1].isdigit()) for r in responses]


def _prompts(tok, n=16):
    return [
        PromptItem(f"p{i}", f"What is {i}+{i % 3}?", "7", encode_prompt(tok, f"What is {i}+{i % 3}?\n"), 1)
        for i in range(n)
    ]


def test_prompt_entropy_is_one_forward_pass_over_prompt_positions():
    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    engine = Engine(model, tok)
    items = _prompts(tok, 3)
    got = engine.prompt_entropy(items)
    # by hand for the first prompt: mean entropy of the next-token distributions at positions 1..L-1
    ids = torch.tensor([items[0].prompt_tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    expected = float(-(logp.exp() * logp).sum(-1).mean())
    assert math.isclose(got[0], expected, rel_tol=1e-4)
    assert all(0 < v <= math.log(len(tok)) + 1e-6 for v in got)
    # padding must not change a prompt's value
    assert math.isclose(engine.prompt_entropy(items[:1])[0], got[0], rel_tol=1e-4)


def test_hive_source_skips_by_history_and_prunes_by_entropy():
    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(MICRO, tok, seed=0), tok)
    items = _prompts(tok, 64)
    # every even prompt has a long run of all-correct groups: GRESO skips it with prob 1 - 0.5**6
    history = pl.DataFrame(
        {
            "prompt_id": [p.prompt_id for p in items[::2] for _ in range(6)],
            "mean_reward": [1.0] * (32 * 6),
            "n": [8] * (32 * 6),
            "seq": list(range(32 * 6)),
        }
    )
    source = HiveSource(
        PromptCursor(items, 0), engine, greso=GresoFilter(history), entropy_rule="median", seed=0
    )
    taken = source.take(16)
    counts = source.step_counts()
    assert len(taken) == 16
    assert counts["skipped_prompts"] >= 20  # most even prompts skipped
    assert counts["pruned_prompts"] >= (counts["drawn_prompts"] - counts["skipped_prompts"]) // 2 - 1
    odd = sum(int(p.prompt_id[1:]) % 2 for p in taken)
    assert odd >= 13, [p.prompt_id for p in taken]
    # deterministic from the seed
    again = HiveSource(
        PromptCursor(items, 0), engine, greso=GresoFilter(history), entropy_rule="median", seed=0
    )
    assert [p.prompt_id for p in again.take(16)] == [p.prompt_id for p in taken]


def test_the_local_driver_with_hive_source_records_history_and_in_run_evals(tmp_path):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    calls = []

    def evaluate(m):
        calls.append(m.training)
        return {"eval_toy": 0.5, "eval_seconds": 0.0}

    greso = GresoFilter(None)
    rl = RLConfig(
        steps=5,
        prompts_per_step=4,
        group_size=4,
        lr=1e-2,
        max_new_tokens=3,
        micro_batch_tokens=0,
        eval_every=2,
    )
    result = LocalDriver(
        saved_model(tmp_path, model, tok),
        _prompts(tok, 32),
        StartsWithDigit(),
        PRESETS["grpo"],
        rl,
        seed=0,
        device="cpu",
        source=lambda cursor, engine: HiveSource(cursor, engine, greso=greso, seed=0),
        evaluate=evaluate,
    ).run()
    assert len(calls) == 2 and calls == [False, False]  # steps 2 and 4, model in eval mode
    assert [("eval_toy" in m.extra) for m in result.history] == [False, True, False, True, False]
    assert sum(m.extra["pruned_prompts"] for m in result.history) > 0
    assert all("skipped_prompts" in m.extra for m in result.history)
    assert len(result.rewards) == 5 * 4 and {r[0] for r in result.rewards} == {1, 2, 3, 4, 5}
    assert len(greso.history_rows()) == 20  # every rolled-out group observed


def test_difficulty_writes_attempts_and_history(tmp_path):
    tok = build_char_tokenizer()
    model_dir = tmp_path / "model"
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, model_dir)
    rows = [
        {"prompt_id": f"p{i}", "problem": f"What is {i}+1?", "answer": str(i + 1), "level": 1 + i % 5}
        for i in range(30)
    ]
    pl.DataFrame(rows).write_parquet(tmp_path / "prompts.parquet")

    class Judge:
        def verify_batch(self, responses, golds):
            return [Verdict(len(r) % 2 == 0) for r in responses]

    out = tmp_path / "out"
    out.mkdir()
    m = estimate_difficulty(
        model_dir,
        tmp_path / "prompts.parquet",
        out,
        samples=4,
        max_prompts=20,
        temperature=1.0,
        max_new_tokens=6,
        template="{problem}\n",
        seed=0,
        device="cpu",
        verifier=Judge(),
    )
    attempts = pl.read_parquet(out / "attempts.parquet")
    assert attempts.height == 20 and m["prompts_sampled"] == 20 and m["samples"] == 80
    assert set(attempts["prompt_id"]) == {r["prompt_id"] for r in seeded_subset(rows, 20, 0)}
    responses = pl.read_parquet(out / "responses.parquet")
    check = (
        responses.group_by("prompt_id")
        .agg(pl.col("correct").mean().alias("p"))
        .join(attempts, on="prompt_id")
    )
    assert (check["p"] - check["pass_rate"]).abs().max() < 1e-12
    assert attempts["mean_entropy"].min() > 0 and attempts["level"].null_count() == 0
    history = pl.read_parquet(out / "history.parquet")
    assert (
        history.columns == ["step", "idx", "prompt_id", "mean_reward", "n", "origin"] and history.height == 20
    )
    assert m["learning_edge"] + m["all_correct"] + m["all_wrong"] == 20


def test_greso_round_size_and_one_group_per_prompt():
    greso = HiveSource(None, None, round_headroom=1.25, min_round=0.25)  # GRESO's code
    assert greso.round_size(4, 0.5, 16) == 10  # ceil(1.25 * 4 / 0.5)
    assert greso.round_size(1, 0.0, 16) == 4  # at least a quarter batch
    assert greso.round_size(16, 0.9, 16) == 24  # at most 1.5 batches
    exact = HiveSource(None, None)  # the default: the expected need, no floor
    assert exact.round_size(4, 0.5, 16) == 8
    assert exact.round_size(1, 0.0, 16) == 1
    assert exact.round_size(3, 0.25, 16) == 4
    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(MICRO, tok, seed=0), tok)
    items = _prompts(tok, 5)  # fewer prompts than a raw batch: the cursor wraps into the next epoch
    source = HiveSource(PromptCursor(items, 0), engine, greso=None, entropy_rule="off", seed=0)
    for _ in range(12):  # a buffer whose leftovers repeat a prompt still fills the batch
        batch = source.take(4)
        assert len({p.prompt_id for p in batch}) == len(batch) == 4


def test_the_rl_stage_builds_greso_with_the_configured_thresholds():
    from conf.schema import SelectConfig
    from training.rl.stage import hive_source

    src = hive_source(SelectConfig(greso_easy_threshold=0.85, greso_hard_threshold=0.2), None, seed=0)(
        None, None
    )
    assert (src.greso.easy_threshold, src.greso.hard_threshold) == (0.85, 0.2)
    src.greso.observe("p", 7 / 8)  # 7 of 8 correct now counts as easy
    assert src.greso.runs("p") == (1, 0) and src.greso.skip_probability("p") == 0.5
    assert hive_source(SelectConfig(), None, seed=0)(None, None).greso.easy_threshold == 0.98  # GRESO's code
