"""Seed-N measurement of the reward-model slice: simulated annotators (several, with disagreement)
rate arithmetic responses by a rubric the verifier cannot see (the final answer ends with a full
stop), the ratings go through ``data_curation.preferences`` (ratings shape, ties dropped), and a
Bradley-Terry RM on a tiny random backbone is trained; prints its held-out pairwise accuracy beside
the length baselines and the annotators' agreement (the ceiling).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/reward_model_rubric.py --seed 0 --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path


def simulated_rows(n: int, seed: int, annotators: int = 3, flip: float = 0.15) -> list[dict]:
    """Per prompt two responses (one ends with '.', lengths varied) rated 1-5 by each annotator;
    each annotator flips the rubric with probability ``flip`` (their disagreement)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        ans = str(a + b)
        styled = f"{a}+{b}={ans}."
        plain = f"{a}+{b}={ans}" + " " * rng.choice([0, 1, 2])
        resp = []
        for text, good in ((styled, True), (plain, False)):
            ratings = {}
            for k in range(annotators):
                g = good if rng.random() > flip else not good
                ratings[f"ann{k}"] = rng.choice([4, 5]) if g else rng.choice([1, 2])
            resp.append({"text": text, "ratings": ratings})
        rows.append({"prompt": f"{a}+{b}=", "responses": resp})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--steps", type=int, default=80)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from conf.schema import ModelConfig
    from data_curation.preferences import ingest_preferences
    from generation.model import build_char_tokenizer, build_tiny_model, save_model
    from training.reward_model import train_reward_model

    with tempfile.TemporaryDirectory(prefix="prefs-") as tmp:
        tmp = Path(tmp)
        counts = ingest_preferences(
            [("simulated", "ratings", simulated_rows(args.prompts, args.seed))], tmp / "prefs"
        )
        import pyarrow.parquet as pq

        comps = pq.read_table(tmp / "prefs" / "comparisons.parquet").to_pylist()
        tok = build_char_tokenizer()
        cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
        save_model(build_tiny_model(cfg, tok, args.seed), tok, tmp / "lm")
        m = train_reward_model(tmp / "lm", comps, tmp / "rm", steps=args.steps, lr=2e-3, seed=args.seed)
    print(json.dumps({"seed": args.seed, **counts, **m}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
