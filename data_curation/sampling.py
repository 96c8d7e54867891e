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


class Sampler:
    """How curation samples a batch of requests: the rollout engine's single-turn ``generate`` (the
    default ``env``: today's path, the same tokens for the same seed), or, under a multi-turn ``env``,
    whole episodes through the RL rollout's episode runner (``environments.registry.wrap_engine``: an
    ``EpisodeEngine`` on the same engine), ``max_new_tokens`` per policy turn. A trajectory of an
    episode holds every turn and observation with its ``loss_mask`` (1 policy, 0 observation), so the
    verifier judges the episode's text and RFT learns only the policy's turns."""

    def __init__(self, model_dir: Path, device: str, batch_size: int, env=None, sandbox=None):
        self.engine, self.tokenizer = _engine(model_dir, device, batch_size)
        self.env, self.sandbox, self.device, self.batch_size = env, sandbox, device, batch_size
        self.episodic = env is not None and not env.is_default()

    def sample(self, requests, max_new_tokens: int, temperature: float, generator, progress=None) -> list:
        """One trajectory per request, in request order; the noise seed is one draw from ``generator``."""
        if not self.episodic:
            return self.engine.generate(requests, max_new_tokens, temperature, generator, progress=progress)
        from environments.registry import wrap_engine
        from generation.engine import Engine
        from generation.sampler import seed_from

        options = EngineOptions(
            capacity=self.batch_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed_from(generator, None),
        )
        engine = Engine(self.engine.model, self.tokenizer, options, device=self.device)
        runner = wrap_engine(engine, self.env, self.tokenizer, self.sandbox)
        try:
            out = runner.generate(list(requests))
        finally:
            runner.close()
        if progress is not None:
            progress.update(len(out))
        return out


def episode_metrics(trajs) -> dict[str, float]:
    """Tool calls, tool errors and policy turns per episode (curation under a multi-turn ``env``)."""
    n = max(1, len(trajs))
    return {
        "tool_calls_per_episode": sum(t.tool_calls for t in trajs) / n,
        "tool_errors_per_episode": sum(t.tool_errors for t in trajs) / n,
        "turns_per_episode": sum(t.turns for t in trajs) / n,
    }


RESPONSES_SCHEMA = {
    "prompt_id": pl.Utf8,
    "sample_idx": pl.Int32,
    "response": pl.Utf8,
    "correct": pl.Boolean,
    "length": pl.Int32,
    "entropy": pl.Float64,
    "truncated": pl.Boolean,
}
EPISODE_SCHEMA = {"turns": pl.Int32, "tool_calls": pl.Int32, "tool_errors": pl.Int32}
"""The extra columns of ``responses.parquet`` under a multi-turn ``env``."""


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
    env=None,
    sandbox=None,
) -> dict[str, float]:
    """Sample ``samples`` responses per prompt (a seeded subset of ``max_prompts``) and verify them;
    under a multi-turn ``env`` (``conf.schema.EnvConfig``; tools under ``sandbox``) each sample is a
    whole episode (``Sampler``).

    Writes ``attempts.parquet`` (per prompt: n, n_correct, pass_rate, mean_length, mean_entropy,
    level), ``responses.parquet`` (every sample; with turns and tool calls under an ``env``) and
    ``history.parquet`` (one reward-history row per prompt: the group's mean reward, origin
    ``difficulty``)."""
    import torch

    from generation.records import GenRequest

    rows = seeded_subset(pl.read_parquet(prompts_path).to_dicts(), max_prompts, seed)
    sampler = Sampler(model_dir, device, batch_size, env, sandbox)
    items = prompt_items(rows, sampler.tokenizer, template)
    requests = [GenRequest(prompt=p, sample_idx=i) for p in items for i in range(samples)]
    trajs = sampler.sample(
        requests, max_new_tokens, temperature, torch.Generator().manual_seed(seed), progress
    )
    verdicts = verifier.verify_batch([t.text for t in trajs], [t.prompt.answer for t in trajs])
    responses = _responses(trajs, verdicts, sampler.episodic)
    attempts = _attempts(responses, rows)
    out = Path(out_dir)
    attempts.write_parquet(out / "attempts.parquet")
    responses.write_parquet(out / "responses.parquet")
    _history(attempts).write_parquet(out / "history.parquet")
    pr = attempts["pass_rate"]
    return {
        "prompts_sampled": float(attempts.height),
        "samples": float(responses.height),
        "mean_pass_rate": float(pr.mean() or 0.0),
        "all_correct": float((pr == 1.0).sum()),
        "all_wrong": float((pr == 0.0).sum()),
        "learning_edge": float(((pr > 0) & (pr < 1)).sum()),
        **(episode_metrics(trajs) if sampler.episodic else {}),
    }


def _responses(trajs, verdicts, episodic: bool) -> pl.DataFrame:
    """Every sample's row of ``responses.parquet``."""
    cols = {
        "prompt_id": [t.prompt.prompt_id for t in trajs],
        "sample_idx": [t.sample_idx for t in trajs],
        "response": [t.text for t in trajs],
        "correct": [v.correct for v in verdicts],
        "length": [len(t.response_tokens) for t in trajs],
        "entropy": [t.mean_entropy for t in trajs],
        "truncated": [not t.finished for t in trajs],
    }
    if not episodic:
        return pl.DataFrame(cols, schema=RESPONSES_SCHEMA)
    cols.update({k: [getattr(t, k) for t in trajs] for k in EPISODE_SCHEMA})
    return pl.DataFrame(cols, schema={**RESPONSES_SCHEMA, **EPISODE_SCHEMA})


def _history(attempts: pl.DataFrame) -> pl.DataFrame:
    """One reward-history row per prompt (step 0, origin ``difficulty``): its pass rate."""
    return attempts.select(
        pl.lit(0, pl.Int64).alias("step"),
        pl.int_range(pl.len(), dtype=pl.Int64).alias("idx"),
        "prompt_id",
        pl.col("pass_rate").alias("mean_reward"),
        "n",
        pl.lit("difficulty").alias("origin"),
    )


def _attempts(responses: pl.DataFrame, rows: list[dict]) -> pl.DataFrame:
    """Per prompt: n, n_correct, pass_rate, mean_length, mean_entropy and its level."""
    levels = pl.DataFrame(
        {"prompt_id": [r["prompt_id"] for r in rows], "level": [r.get("level") for r in rows]},
        schema={"prompt_id": pl.Utf8, "level": pl.Int32},
    )
    return (
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
    env=None,
    sandbox=None,
) -> dict[str, float]:
    """DART: rejection-sample the difficulty stage's prompts, trials allocated by
    ``data_curation.dart.DartPlanner`` (``params``: its ``DartParams``), round after round until every
    prompt stopped or the budget is spent. Writes ``rft.parquet`` (every correct response with its
    prompt) and ``dart_stats.parquet`` (per prompt: fail rate, target, trials, corrects). With
    ``check_arithmetic`` a response counts as correct only if its integer equations hold too
    (``data_curation.dart.arithmetic_consistent``); ``rejected_arithmetic`` counts the right answers
    that check turned down. With ``ranker`` (a built ``reward_model`` component) it ranks instead of
    verifying: ``rft.parquet`` holds each prompt's top-ranked trials (``data_curation.dart.top_ranked``,
    with their ``rm_score`` and whether the verifier accepted them, ``verified``). Under a multi-turn
    ``env`` every trial is a whole episode (``Sampler``) and ``rft.parquet`` also holds each kept
    episode's ``prompt_tokens``, ``response_tokens`` and ``loss_mask`` (what RFT trains on)."""
    import torch

    from data_curation.dart import DartPlanner, top_ranked

    attempts, prompts, by_id = _dart_inputs(Path(prompts_path), Path(attempts_path))
    sampler = Sampler(model_dir, device, batch_size, env, sandbox)
    items = {p.prompt_id: p for p in prompt_items(list(by_id.values()), sampler.tokenizer, template)}
    state = _DartRun(sampler, items, torch.Generator().manual_seed(seed))
    planner = DartPlanner(attempts, params)
    while plan := planner.next_round():
        state.round(plan, planner, verifier, max_new_tokens, temperature, check_arithmetic, ranker, by_id)
        if progress is not None:
            progress.update(sum(n for _, n in plan))
    stats = planner.stats()
    kept = (
        planner.correct_responses()
        if ranker is None
        else top_ranked(_trials_frame(state.ranked), stats, params.k_u)
    )
    data = _write_dart(state.with_episodes(kept), stats, prompts, Path(out_dir))
    return {
        **{k: float(v) for k, v in planner.summary().items()},
        "rounds": float(state.rounds),
        "rft_examples": float(data.height),
        "rejected_arithmetic": float(state.rejected),
        **(_rank_metrics(data, state.ranked) if ranker is not None else {}),
        **(episode_metrics(state.trajs) | _kept_tool_metrics(data) if sampler.episodic else {}),
    }


def _dart_inputs(prompts_path: Path, attempts_path: Path) -> tuple[pl.DataFrame, pl.DataFrame, dict]:
    """The difficulty stage's attempts, the prompt pool, and the attempted prompts' rows by id."""
    attempts = pl.read_parquet(attempts_path)
    prompts = pl.read_parquet(prompts_path)
    by_id = {
        r["prompt_id"]: r
        for r in prompts.filter(pl.col("prompt_id").is_in(attempts["prompt_id"].implode())).to_dicts()
    }
    return attempts, prompts, by_id


def _write_dart(kept: pl.DataFrame, stats: pl.DataFrame, prompts: pl.DataFrame, out: Path) -> pl.DataFrame:
    """``rft.parquet`` (the kept responses with their prompts) and ``dart_stats.parquet`` (with levels)."""
    data = kept.join(prompts.select("prompt_id", "problem", "answer", "level"), on="prompt_id", how="left")
    data.write_parquet(out / "rft.parquet")
    stats = stats.join(prompts.select("prompt_id", "level"), on="prompt_id", how="left")
    stats.write_parquet(out / "dart_stats.parquet")
    return data


class _DartRun:
    """DART's sampling rounds: what they sampled and counted, and under a multi-turn ``env`` each
    trial's episode tokens by (prompt id, trial index), numbered as ``DartPlanner.record`` numbers them."""

    def __init__(self, sampler: Sampler, items: dict, generator):
        self.sampler, self.items, self.generator = sampler, items, generator
        self.rounds = self.rejected = 0
        self.ranked: list[dict] = []  # with a ranker: every trial, scored
        self.trials: dict[str, int] = {}  # prompt id -> its trials so far (the ranker's numbering)
        self.numbered: dict[str, int] = {}  # the same numbering, for the episodes kept below
        self.episodes: dict[tuple[str, int], tuple] = {}
        self.trajs: list = []  # under an env: every trial (for its tool metrics)

    def round(self, plan, planner, verifier, max_new_tokens, temperature, check_arithmetic, ranker, by_id):
        from data_curation.dart import arithmetic_consistent
        from generation.records import GenRequest

        self.rounds += 1
        requests = [GenRequest(prompt=self.items[pid], sample_idx=i) for pid, n in plan for i in range(n)]
        trajs = self.sampler.sample(requests, max_new_tokens, temperature, self.generator)
        verdicts = verifier.verify_batch([t.text for t in trajs], [t.prompt.answer for t in trajs])
        correct = [
            v.correct and (not check_arithmetic or arithmetic_consistent(t.text))
            for t, v in zip(trajs, verdicts)
        ]
        self.rejected += sum(v.correct and not c for v, c in zip(verdicts, correct))
        if self.sampler.episodic:
            self._keep_episodes(trajs, correct, keep_all=ranker is not None)
        if ranker is not None:
            self.ranked += _rank_round(ranker, trajs, correct, by_id, max_new_tokens, self.trials)
        planner.record(
            (t.prompt.prompt_id, c, t.text, len(t.response_tokens)) for t, c in zip(trajs, correct)
        )

    def _keep_episodes(self, trajs, correct, keep_all: bool) -> None:
        self.trajs += trajs
        for t, c in zip(trajs, correct):
            pid = t.prompt.prompt_id
            idx = self.numbered[pid] = self.numbered.get(pid, -1) + 1
            if c or keep_all:
                self.episodes[(pid, idx)] = (t.prompt.prompt_tokens, t.response_tokens, t.policy_mask())

    def with_episodes(self, kept: pl.DataFrame) -> pl.DataFrame:
        """``kept`` with each episode's tokens and loss mask (unchanged for single-turn sampling)."""
        if not self.sampler.episodic:
            return kept
        toks = [self.episodes[(p, i)] for p, i in zip(kept["prompt_id"], kept["trial_idx"])]
        lists = pl.List(pl.Int64)
        return kept.with_columns(
            pl.Series("prompt_tokens", [list(x[0]) for x in toks], dtype=lists),
            pl.Series("response_tokens", [list(x[1]) for x in toks], dtype=lists),
            pl.Series("loss_mask", [list(x[2]) for x in toks], dtype=lists),
        )


def _kept_tool_metrics(data: pl.DataFrame) -> dict[str, float]:
    """The kept episodes that called a tool (their loss mask has an observation: a 0)."""
    with_obs = sum(1 for m in data["loss_mask"] if 0 in m) if data.height else 0
    return {"rft_tool_episodes": float(with_obs)}


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
