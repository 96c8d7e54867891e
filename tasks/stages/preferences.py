"""``preferences`` (with ``reward=reward_model``): simulated annotators rate the warm-up model's
sampled responses; the comparisons are checked against the benchmarks like any pool."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import (
    COMPARISONS,
    DATASET,
    MODEL,
    PROMPTS,
    produce,
    insert_parquet,
    numerics,
    template,
    uses_reward_model,
)
from tasks.stages.decontaminate import decontam_args, decontam_benchmarks, decontam_files

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection


def preferences_key(c: Config) -> dict:
    keys = ("prompts", "samples", "temperature", "max_new_tokens", "annotators", "flip", "rubric")
    return {
        **{k: getattr(c.reward_model, k) for k in keys},
        "template": template(c),
        "decontam": c.curation.decontam.model_dump(),
        "benchmarks": decontam_benchmarks(c),
        **numerics(c),
    }


def preferences_body(ctx: StageContext) -> StageResult:
    """Simulated annotators rate the warm-up model's sampled responses; comparisons ingested."""
    from data_curation.annotators import sample_groups, simulated_preferences
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    c = ctx.cfg.reward_model
    # the comparisons' prompts are checked like any pool, and their certificate counts downstream
    items, decontam = decontam_args(ctx)

    def run(out: Path) -> dict:
        groups = sample_groups(
            Path(ctx.inputs[MODEL].path),
            ctx.inputs[PROMPTS].file("prompts.parquet"),
            prompts=c.prompts,
            samples=c.samples,
            temperature=c.temperature,
            max_new_tokens=c.max_new_tokens,
            template=template(ctx.cfg),
            seed=ctx.cfg.seed,
            device=ctx.device,
        )
        return simulated_preferences(
            groups,
            out,
            rubric=c.rubric,
            annotators=c.annotators,
            flip=c.flip,
            seed=ctx.cfg.seed,
            benchmark_items=items,
            **decontam,
        )

    ref, metrics = produce(ctx, COMPARISONS, run)
    return StageResult({COMPARISONS: ref}, metrics)


def record_preferences(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[COMPARISONS]
    insert_parquet(
        con,
        "comparisons",
        "comparison_id, prompt, chosen, rejected, margin, annotator, source",
        ref,
        "comparisons.parquet",
    )
    insert_parquet(con, "preference_quarantine", 'source, "row", reason', ref, "quarantine.parquet")


def preferences_headline(m: dict) -> str:
    agree = f"  agreement {m['agreement']:.3f}" if "agreement" in m else ""
    return (
        f"comparisons {m['comparisons']:.0f}  quarantined {m['quarantined']:.0f}  "
        f"duplicates {m['duplicates']:.0f}  rubric share {m['rubric_share']:.2f}" + agree
    )


STAGE = Stage(
    name="preferences",
    inputs={MODEL: ("warmup", MODEL), PROMPTS: ("decontaminate", PROMPTS), DATASET: ("data", DATASET)},
    config=preferences_key,
    body=preferences_body,
    record=record_preferences,
    headline=preferences_headline,
    external=decontam_files,
    when=uses_reward_model,
    curates=True,
)
