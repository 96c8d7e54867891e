"""DART ranking instead of verifying (``curation.dart.select=reward_model``): each prompt keeps its
target of the reward model's top-ranked trials, verified or not, from the very trials verifier
selection samples."""

from __future__ import annotations

import polars as pl

from conf.schema import ModelConfig
from data_curation.dart import DartParams, top_ranked
from data_curation.sampling import dart_sample
from generation.model import build_char_tokenizer, build_tiny_model, save_model
from rewards.verifier import Verifier


def test_each_prompt_keeps_its_target_of_the_best_scored_trials():
    trials = pl.DataFrame(
        {
            "prompt_id": ["a", "a", "a", "b", "b", "c", "c"],
            "response": ["a0", "a1", "a2", "b0", "b1", "c0", "c1"],
            "length": [1] * 7,
            "trial_idx": [0, 1, 2, 0, 1, 0, 1],
            "rm_score": [0.1, 0.9, 0.5, 0.3, 0.3, -1.0, 2.0],
            "verified": [True, False, False, False, True, False, False],
        }
    )
    stats = pl.DataFrame({"prompt_id": ["a", "b", "c"], "target": [2, 1, None]})
    kept = top_ranked(trials, stats, default_keep=1)
    assert kept["response"].to_list() == ["a1", "a2", "b0", "c1"]  # a: top 2; b: tie to the first; c: 1
    assert kept.columns == trials.columns


class _LengthRanker:
    """A stand-in reward model (a built component): prefers the longer response; keeps what it saw."""

    name = "reward_model"
    fallback = 0.0

    def __init__(self):
        self.seen: list[tuple[str, str]] = []  # (problem, response) in the order scored

    def score(self, samples, correct):
        self.seen += [(s.prompt, s.text) for s in samples]
        return [float(len(s.text)) for s in samples]


def test_dart_ranks_the_same_trials_that_verifier_selection_samples(tmp_path):
    tok = build_char_tokenizer()
    cfg = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    save_model(build_tiny_model(cfg, tok, 0), tok, tmp_path / "lm")
    ids = [f"p{i}" for i in range(3)]
    prompts = pl.DataFrame(
        {"prompt_id": ids, "problem": [f"What is {i}+1?" for i in range(3)], "answer": ["1", "2", "3"]}
    ).with_columns(level=pl.lit(1, pl.Int32))
    attempts = pl.DataFrame({"prompt_id": ids, "n": [4] * 3, "n_correct": [1] * 3, "pass_rate": [0.25] * 3})
    prompts.write_parquet(tmp_path / "prompts.parquet")
    attempts.write_parquet(tmp_path / "attempts.parquet")
    params = DartParams(strategy="uniform", k_u=2, k_p=2, max_trials=3, budget=9, round_size=4)
    out, length_ranker = {}, _LengthRanker()
    for name, ranker in (("verify", None), ("rank", length_ranker)):
        (tmp_path / name).mkdir()
        with Verifier(timeout_s=5.0) as verifier:
            metrics = dart_sample(
                tmp_path / "lm",
                tmp_path / "prompts.parquet",
                tmp_path / "attempts.parquet",
                tmp_path / name,
                params,
                max_new_tokens=8,
                temperature=1.0,
                template="{problem}",
                seed=0,
                device="cpu",
                verifier=verifier,
                ranker=ranker,
            )
        out[name] = (metrics, pl.read_parquet(tmp_path / name / "rft.parquet"))
    stats = [pl.read_parquet(tmp_path / n / "dart_stats.parquet") for n in ("verify", "rank")]
    assert stats[0].equals(stats[1])  # ranking changes what is kept, never what is sampled
    (m, kept), (m_verify, verified) = out["rank"], out["verify"]
    trials = dict(zip(stats[0]["prompt_id"], stats[0]["trials"]))
    assert kept.group_by("prompt_id").len().sort("prompt_id")["len"].to_list() == [
        min(2, trials[p]) for p in ids
    ]
    assert len(length_ranker.seen) == sum(trials.values())  # every trial scored once
    for i, pid in enumerate(ids):  # the longest two of the prompt's trials, ties to the earlier
        mine = [r for problem, r in length_ranker.seen if problem == f"What is {i}+1?"]
        best = sorted(range(len(mine)), key=lambda j: (-len(mine[j]), j))[:2]
        group = kept.filter(pl.col("prompt_id") == pid)
        assert group["trial_idx"].to_list() == sorted(best)
        assert group["response"].to_list() == [mine[j] for j in sorted(best)]
        assert group["rm_score"].to_list() == [float(len(mine[j])) for j in sorted(best)]
    assert m["rft_examples"] == kept.height and m["rm_fallbacks"] == 0
    assert m["rm_kept_verified"] == kept["verified"].mean()
    assert m_verify["rft_examples"] == verified.height == sum(stats[0]["corrects"])
    assert "rm_score" not in verified.columns and "rm_kept_verified" not in m_verify
