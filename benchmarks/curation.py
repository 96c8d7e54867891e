"""HIVE's coarse selection (and GRESO's history load, and one DART round) at scale.

Builds a seeded synthetic attempts table (200k prompts) and reward history (one 'difficulty' row
and four 'rl' rows per prompt: 1,000,000 rows), then times ``select_learning_edge`` over it (target
under 2 s on the 2-core machine) and prints the selection counts; also times building a
``GresoFilter`` from the same history and planning/recording one DART round over the attempts.

    .venv/bin/python benchmarks/curation.py [--prompts 200000] [--observations 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import polars as pl

from data_curation.dart import DartParams, DartPlanner
from data_curation.hive import GresoFilter, select_learning_edge

G = 8  # responses per group


def synthetic(n_prompts: int, n_obs: int, seed: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """attempts (one row per prompt) and history (n_obs rows per prompt: the first is the difficulty
    stage's group, the rest RL groups whose pass rate drifts up as training goes on)."""
    rng = np.random.default_rng(seed)
    ids = np.char.add("p", np.arange(n_prompts).astype(str))
    true_p = rng.beta(0.7, 0.7, n_prompts)
    n_correct = rng.binomial(G, true_p)
    attempts = pl.DataFrame(
        {
            "prompt_id": ids,
            "n": np.full(n_prompts, G, np.int64),
            "n_correct": n_correct.astype(np.int64),
            "pass_rate": n_correct / G,
            "mean_length": rng.normal(120, 30, n_prompts),
            "mean_entropy": rng.gamma(2.0, 0.5, n_prompts),
            "level": rng.integers(1, 6, n_prompts).astype(np.int32),
        }
    )
    obs = np.arange(n_obs)
    drift = np.clip(true_p[:, None] + 0.03 * obs[None, :], 0, 1)
    rewards = rng.binomial(G, drift) / G
    # observations interleave across prompts, as RL steps do: seq = obs * n_prompts + a shuffled slot
    slot = np.stack([rng.permutation(n_prompts) for _ in range(n_obs)], axis=1)
    history = pl.DataFrame(
        {
            "prompt_id": np.repeat(ids, n_obs),
            "seq": (obs[None, :] * n_prompts + slot).ravel().astype(np.int64),
            "mean_reward": rewards.ravel(),
            "n": np.full(n_prompts * n_obs, G, np.int64),
            "origin": np.tile(np.where(obs == 0, "difficulty", "rl"), n_prompts),
        }
    )
    return attempts, history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200_000)
    ap.add_argument("--observations", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompts", type=int, default=50_000)
    args = ap.parse_args()

    t = time.perf_counter()
    attempts, history = synthetic(args.prompts, args.observations, args.seed)
    print(
        f"synthetic: {attempts.height:,} prompts, {history.height:,} history rows "
        f"({time.perf_counter() - t:.2f} s to build)"
    )

    select_learning_edge(attempts.head(1000), history.head(5000))  # warm up DuckDB's first-query costs
    t = time.perf_counter()
    sel = select_learning_edge(attempts, history, max_prompts=args.max_prompts)
    dt = time.perf_counter() - t
    print(f"select_learning_edge: {dt:.3f} s (target < 2 s) over {history.height:,} history rows")
    counts = sel.group_by("reason").len().sort("reason")
    print(
        "  "
        + ", ".join(f"{r}={n:,}" for r, n in counts.iter_rows())
        + f"; selected={int(sel['selected'].sum()):,}"
    )

    t = time.perf_counter()
    greso = GresoFilter(history)
    dt = time.perf_counter() - t
    skippable = sum(1 for pid in attempts["prompt_id"].to_list() if greso.skip_probability(pid) > 0)
    print(f"GresoFilter from history: {dt:.3f} s; prompts with skip probability > 0: {skippable:,}")

    t = time.perf_counter()
    planner = DartPlanner(attempts, DartParams(budget=4 * args.prompts, round_size=args.prompts))
    plan = planner.next_round()
    t_plan = time.perf_counter() - t
    rng = np.random.default_rng(args.seed)
    p = dict(zip(attempts["prompt_id"].to_list(), attempts["pass_rate"].to_list()))
    results = [(pid, bool(rng.random() < p[pid]), "", 10) for pid, n in plan for _ in range(n)]
    t = time.perf_counter()
    planner.record(results)
    t_rec = time.perf_counter() - t
    print(
        f"DART prop2diff round: plan {t_plan:.3f} s "
        f"({len(plan):,} prompts, {sum(n for _, n in plan):,} trials), "
        f"record {t_rec:.3f} s ({len(results):,} results)"
    )


if __name__ == "__main__":
    main()
