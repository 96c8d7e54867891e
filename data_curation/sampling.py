"""Curation steps that sample the current model: difficulty estimation and DART rejection sampling.

Both drive the rollout engine (``generation.engine.Engine``) and the shared verifier, so a
prompt's pass rate here means exactly what the RL reward means. Outputs are parquet files; the
selection logic itself lives in ``data_curation.dart`` and ``data_curation.hive`` (SQL).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from collections.abc import Sequence

import polars as pl
from conf.schema import EngineOptions


def prompt_items(rows: Sequence[dict], tokenizer, template: str) -> list:
    """``PromptItem``s from curated prompt rows (prompt_id, problem, answer, level)."""
    from generation.model import encode_problem
    from generation.records import PromptItem

    return [
        PromptItem(
            prompt_id=r["prompt_id"],
            text=r["problem"],
            answer=r["answer"],
            prompt_tokens=encode_problem(tokenizer, template, r["problem"]),
            level=r.get("level"),
        )
        for r in rows
    ]


def seeded_subset(rows: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` rows chosen by a seeded hash of their prompt id (all when ``n`` is 0 or too large);
    independent of row order, so the same prompts are chosen whatever the pool's order."""
    if n <= 0 or n >= len(rows):
        return rows

    def key(r: dict) -> str:
        return hashlib.sha256(f"{seed}:{r['prompt_id']}".encode()).hexdigest()

    chosen = {r["prompt_id"] for r in sorted(rows, key=key)[:n]}
    return [r for r in rows if r["prompt_id"] in chosen]


def _engine(model_dir: Path, device: str, batch_size: int):
    from generation.model import load_model
    from generation.engine import Engine

    model, tokenizer = load_model(model_dir, device)
    return Engine(model, tokenizer, EngineOptions(capacity=batch_size), device=device), tokenizer


def estimate_difficulty(
    model_dir: Path,
    prompts_path: Path,
    out_dir: Path,
    *,
    samples: int,
    max_prompts: int,
    temperature: float,
    max_new_tokens: int,
    template: str,
    seed: int,
    device: str,
    verifier,
    batch_size: int = 256,
    progress=None,
) -> dict[str, float]:
    """Sample ``samples`` responses per prompt (a seeded subset of ``max_prompts``) and verify them.

    Writes ``attempts.parquet`` (per prompt: n, n_correct, pass_rate, mean_length, mean_entropy,
    level), ``responses.parquet`` (every sample) and ``history.parquet`` (one reward-history row per
    prompt: the group's mean reward, origin ``difficulty``)."""
    import torch

    from generation.records import GenRequest

    rows = seeded_subset(pl.read_parquet(prompts_path).to_dicts(), max_prompts, seed)
    engine, tokenizer = _engine(model_dir, device, batch_size)
    items = prompt_items(rows, tokenizer, template)
    requests = [GenRequest(prompt=p, sample_idx=i) for p in items for i in range(samples)]
    trajs = engine.generate(
        requests, max_new_tokens, temperature, torch.Generator().manual_seed(seed), progress=progress
    )
    verdicts = verifier.verify_batch([t.text for t in trajs], [t.prompt.answer for t in trajs])
    responses = pl.DataFrame(
        {
            "prompt_id": [t.prompt.prompt_id for t in trajs],
            "sample_idx": [t.sample_idx for t in trajs],
            "response": [t.text for t in trajs],
            "correct": [v.correct for v in verdicts],
            "length": [len(t.response_tokens) for t in trajs],
            "entropy": [t.mean_entropy for t in trajs],
            "truncated": [not t.finished for t in trajs],
        },
        schema={
            "prompt_id": pl.Utf8,
            "sample_idx": pl.Int32,
            "response": pl.Utf8,
            "correct": pl.Boolean,
            "length": pl.Int32,
            "entropy": pl.Float64,
            "truncated": pl.Boolean,
        },
    )
    levels = pl.DataFrame(
        {"prompt_id": [r["prompt_id"] for r in rows], "level": [r.get("level") for r in rows]},
        schema={"prompt_id": pl.Utf8, "level": pl.Int32},
    )
    attempts = (
        responses.group_by("prompt_id", maintain_order=True)
        .agg(
            n=pl.len().cast(pl.Int64),
            n_correct=pl.col("correct").sum().cast(pl.Int64),
            mean_length=pl.col("length").cast(pl.Float64).mean(),
            mean_entropy=pl.col("entropy").mean(),
        )
        .with_columns(pass_rate=pl.col("n_correct") / pl.col("n"))
        .join(levels, on="prompt_id", how="left", maintain_order="left")
        .select("prompt_id", "n", "n_correct", "pass_rate", "mean_length", "mean_entropy", "level")
    )
    history = attempts.select(
        pl.lit(0, pl.Int64).alias("step"),
        pl.int_range(pl.len(), dtype=pl.Int64).alias("idx"),
        "prompt_id",
        pl.col("pass_rate").alias("mean_reward"),
        "n",
        pl.lit("difficulty").alias("origin"),
    )
    out = Path(out_dir)
    attempts.write_parquet(out / "attempts.parquet")
    responses.write_parquet(out / "responses.parquet")
    history.write_parquet(out / "history.parquet")
    pr = attempts["pass_rate"]
    return {
        "prompts_sampled": float(attempts.height),
        "samples": float(responses.height),
        "mean_pass_rate": float(pr.mean() or 0.0),
        "all_correct": float((pr == 1.0).sum()),
        "all_wrong": float((pr == 0.0).sum()),
        "learning_edge": float(((pr > 0) & (pr < 1)).sum()),
    }


def dart_sample(
    model_dir: Path,
    prompts_path: Path,
    attempts_path: Path,
    out_dir: Path,
    params,
    *,
    max_new_tokens: int,
    temperature: float,
    template: str,
    seed: int,
    device: str,
    verifier,
    batch_size: int = 256,
    progress=None,
    check_arithmetic: bool = False,
    ranker=None,
) -> dict[str, float]:
    """DART: rejection-sample the difficulty stage's prompts, trials allocated by
    ``data_curation.dart.DartPlanner`` (``params``: its ``DartParams``), round after round until every
    prompt stopped or the budget is spent. Writes ``rft.parquet`` (every correct response with its
    prompt) and ``dart_stats.parquet`` (per prompt: fail rate, target, trials, corrects). With
    ``check_arithmetic`` a response counts as correct only if its integer equations hold too
    (``data_curation.dart.arithmetic_consistent``); ``rejected_arithmetic`` counts the right answers
    that check turned down. With ``ranker`` (a built ``reward_model`` component) it ranks instead of
    verifying: ``rft.parquet`` holds each prompt's top-ranked trials (``data_curation.dart.top_ranked``,
    with their ``rm_score`` and whether the verifier accepted them, ``verified``)."""
    import torch

    from data_curation.dart import DartPlanner, arithmetic_consistent, top_ranked
    from generation.records import GenRequest

    attempts = pl.read_parquet(attempts_path)
    prompts = pl.read_parquet(prompts_path)
    by_id = {
        r["prompt_id"]: r
        for r in prompts.filter(pl.col("prompt_id").is_in(attempts["prompt_id"].implode())).to_dicts()
    }
    engine, tokenizer = _engine(model_dir, device, batch_size)
    items = {p.prompt_id: p for p in prompt_items(list(by_id.values()), tokenizer, template)}
    planner = DartPlanner(attempts, params)
    generator = torch.Generator().manual_seed(seed)
    rounds = rejected = 0
    ranked: list[dict] = []  # with a ranker: every trial, scored
    trials: dict[str, int] = {}  # prompt id -> its trials so far, as the planner numbers them
    while plan := planner.next_round():
        rounds += 1
        requests = [GenRequest(prompt=items[pid], sample_idx=i) for pid, n in plan for i in range(n)]
        trajs = engine.generate(requests, max_new_tokens, temperature, generator)
        verdicts = verifier.verify_batch([t.text for t in trajs], [t.prompt.answer for t in trajs])
        correct = [
            v.correct and (not check_arithmetic or arithmetic_consistent(t.text))
            for t, v in zip(trajs, verdicts)
        ]
        rejected += sum(v.correct and not c for v, c in zip(verdicts, correct))
        if ranker is not None:
            ranked += _rank_round(ranker, trajs, correct, by_id, max_new_tokens, trials)
        planner.record(
            (t.prompt.prompt_id, c, t.text, len(t.response_tokens)) for t, c in zip(trajs, correct)
        )
        if progress is not None:
            progress.update(len(requests))
    stats = planner.stats()
    kept = (
        planner.correct_responses()
        if ranker is None
        else top_ranked(_trials_frame(ranked), stats, params.k_u)
    )
    data = kept.join(prompts.select("prompt_id", "problem", "answer", "level"), on="prompt_id", how="left")
    data.write_parquet(Path(out_dir) / "rft.parquet")
    stats = stats.join(prompts.select("prompt_id", "level"), on="prompt_id", how="left")
    stats.write_parquet(Path(out_dir) / "dart_stats.parquet")
    return {
        **{k: float(v) for k, v in planner.summary().items()},
        "rounds": float(rounds),
        "rft_examples": float(data.height),
        "rejected_arithmetic": float(rejected),
        **(_rank_metrics(data, ranked) if ranker is not None else {}),
    }


def _rank_round(
    ranker, trajs, correct, by_id: dict, max_new_tokens: int, trials: dict[str, int]
) -> list[dict]:
    """One round's trials scored by ``ranker`` (``rewards.compose.safe_scores``: a failed score is the
    component's fallback, counted), numbered per prompt after its earlier ``trials`` (updated) in the
    order ``DartPlanner.record`` numbers them."""
    from rewards.compose import safe_scores
    from rewards.components import Sample

    samples = [
        Sample(
            text=t.text,
            answer=t.prompt.answer or "",
            n_tokens=len(t.response_tokens),
            max_tokens=max_new_tokens,
            prompt=by_id[t.prompt.prompt_id]["problem"],
        )
        for t in trajs
    ]
    scores, failed = safe_scores(ranker, samples, correct)
    out = []
    for t, c, x, f in zip(trajs, correct, scores, failed):
        pid = t.prompt.prompt_id
        out.append(
            {
                "prompt_id": pid,
                "response": t.text,
                "length": len(t.response_tokens),
                "trial_idx": trials.get(pid, 0),
                "rm_score": x,
                "verified": bool(c),
                "rm_failed": f,
            }
        )
        trials[pid] = trials.get(pid, 0) + 1
    return out


def _trials_frame(ranked: list[dict]) -> pl.DataFrame:
    schema = {
        "prompt_id": pl.Utf8,
        "response": pl.Utf8,
        "length": pl.Int64,
        "trial_idx": pl.Int64,
        "rm_score": pl.Float64,
        "verified": pl.Boolean,
    }
    return pl.DataFrame([{k: r[k] for k in schema} for r in ranked], schema=schema)


def _rank_metrics(data: pl.DataFrame, ranked: list[dict]) -> dict[str, float]:
    """What ranking kept: the share of the kept responses the verifier accepts, their mean score, and
    the trials the reward model failed to score (given its fallback)."""
    return {
        "rm_kept_verified": float(data["verified"].mean()) if data.height else 0.0,
        "rm_kept_mean_score": float(data["rm_score"].mean()) if data.height else 0.0,
        "rm_fallbacks": float(sum(r["rm_failed"] for r in ranked)),
    }
