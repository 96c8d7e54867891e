"""``select``: HIVE's selection of the prompts at the learning edge (from the RL starting model's pass
rates and the reward history), topped up to one RL batch."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import ATTEMPTS, PROMPTS, SELECTION, produce, dumps, insert_parquet, select_config

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

    from core.catalog import Catalog


def select_key(c: Config) -> dict:
    return {**select_config(c), "min_prompts": c.rl.prompts_per_step}


def history_fingerprint(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    """With ``curation.select.history=workspace`` the selection depends on every RL reward recorded
    in the catalog: its fingerprint enters the key, so new history reruns ``select``."""
    if cfg.curation.select.history != "workspace" or catalog is None:
        return {}
    rows = catalog.query(
        "SELECT source_sha, count(*) AS n FROM reward_history WHERE origin = 'rl' "
        "GROUP BY source_sha ORDER BY source_sha"
    )
    return {"history:workspace": hashlib.sha256(dumps(rows).encode()).hexdigest()}


def workspace_history(catalog: Catalog | None) -> Any:
    """Every RL group reward in the workspace's catalog, in the order it was recorded."""
    import polars as pl

    if catalog is None:
        return None
    rows = catalog.query(
        "SELECT prompt_id, mean_reward, n, origin FROM reward_history WHERE origin = 'rl' "
        "ORDER BY recorded_at, source_sha, step, idx"
    )
    return pl.DataFrame(
        rows, schema={"prompt_id": pl.Utf8, "mean_reward": pl.Float64, "n": pl.Int64, "origin": pl.Utf8}
    )


PRIOR_HISTORY, PRIOR_REWARDS = "prior_history", "prior_rewards"
"""A round's selection also reads the previous round's selection and RL model (``tasks.rounds``)."""


def carried_history(ctx: StageContext) -> list:
    """HIVE's history from the previous round (``tasks.rounds``), oldest first: that round's selection
    history (itself carried from the rounds before) and its RL model's group rewards; none in round 1."""
    import polars as pl

    files = [(PRIOR_HISTORY, "history.parquet"), (PRIOR_REWARDS, "rewards.parquet")]
    return [
        pl.read_parquet(ctx.inputs[name].file(file)).select("prompt_id", "mean_reward", "n", "origin")
        for name, file in files
        if name in ctx.inputs
    ]


def select_body(ctx: StageContext) -> StageResult:
    import polars as pl

    from data_curation.hive import select_learning_edge

    c = ctx.cfg.curation.select

    def run(out: Path) -> dict:
        prompts = pl.read_parquet(ctx.inputs[PROMPTS].file("prompts.parquet"))
        attempts = pl.read_parquet(ctx.inputs[ATTEMPTS].file("attempts.parquet"))
        history = pl.read_parquet(ctx.inputs[ATTEMPTS].file("history.parquet")).select(
            "prompt_id", "mean_reward", "n", "origin"
        )
        if c.history == "workspace":
            prior = workspace_history(ctx.catalog)
            if prior is not None and prior.height:
                history = pl.concat([history, prior])
        elif carried := carried_history(ctx):  # round k >= 2: round k-1's history comes first
            history = pl.concat([*carried, history], how="vertical_relaxed")
        history = history.with_columns(seq=pl.int_range(pl.len(), dtype=pl.Int64))
        history.write_parquet(out / "history.parquet")
        if c.strategy == "uniform":
            decisions = prompts.select("prompt_id").with_columns(
                pass_rate_est=pl.lit(None, pl.Float64),
                score=pl.lit(None, pl.Float64),
                n_observations=pl.lit(0, pl.Int64),
                selected=pl.lit(True),
                reason=pl.lit("uniform"),
            )
        else:
            decisions = top_up(
                select_learning_edge(attempts, history, max_prompts=c.max_prompts),
                prompts,
                ctx.cfg.rl.prompts_per_step,
            )
        decisions.write_parquet(out / "selection.parquet")
        chosen = decisions.filter(pl.col("selected"))["prompt_id"]
        kept = prompts.filter(pl.col("prompt_id").is_in(chosen.implode()))
        kept.write_parquet(out / "prompts.parquet")
        counts = decisions.group_by("reason").len().to_dicts()
        return {
            "candidates": float(prompts.height),
            "selected": float(kept.height),
            **{f"reason_{r['reason']}": float(r["len"]) for r in counts},
        }

    ref, metrics = produce(ctx, SELECTION, run)
    return StageResult({SELECTION: ref}, metrics)


def top_up(decisions, prompts, minimum: int):
    """With fewer than ``minimum`` prompts at the learning edge (a model that solves nothing yet),
    RL still needs a batch: the most uncertain of the rest are added, then unobserved prompts, each
    recorded with reason ``top_up``."""
    import polars as pl

    short = minimum - int(decisions["selected"].sum())
    if short <= 0:
        return decisions
    unseen = prompts.select("prompt_id").join(decisions.select("prompt_id"), on="prompt_id", how="anti")
    rest = pl.concat(
        [
            decisions.filter(~pl.col("selected"))
            .sort(["score", "prompt_id"], descending=[True, False], nulls_last=True)
            .select("prompt_id"),
            unseen.sort("prompt_id"),
        ]
    )
    extra = rest.head(short)["prompt_id"].implode()
    decisions = decisions.with_columns(
        reason=pl.when(pl.col("prompt_id").is_in(extra)).then(pl.lit("top_up")).otherwise(pl.col("reason")),
        selected=pl.col("selected") | pl.col("prompt_id").is_in(extra),
    )
    added = unseen.filter(pl.col("prompt_id").is_in(extra)).with_columns(
        selected=pl.lit(True), reason=pl.lit("top_up")
    )
    return pl.concat([decisions, added], how="diagonal_relaxed")


def record_select(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    insert_parquet(
        con,
        "selections",
        "prompt_id, pass_rate_est, score, n_observations, selected, reason",
        res.artifacts[SELECTION],
        "selection.parquet",
    )


def select_headline(m: dict) -> str:
    return f"selected {m['selected']:.0f} of {m['candidates']:.0f}"


STAGE = Stage(
    name="select",
    inputs={PROMPTS: ("decontaminate", PROMPTS), ATTEMPTS: ("difficulty_rft", ATTEMPTS)},
    config=select_key,
    body=select_body,
    record=record_select,
    headline=select_headline,
    external=history_fingerprint,
    curation=lambda m: {"selected": m["selected"]},
    curates=True,
)
