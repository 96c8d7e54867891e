"""``warmup``: supervised fine-tuning of the base model on the pool's demonstrations."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import (
    MODEL,
    PROMPTS,
    produce,
    env_key,
    env_plugins,
    eval_name,
    lora_key,
    numerics,
    record_checkpoint,
    sandbox_key,
    template,
)

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

WARMUP_FLOOR = 0.05
"""A warm-up evaluation below this (avg@n) means the warm-up model solves almost nothing."""


def warmup_key(c: Config) -> dict:
    return {
        **c.sft.model_dump(),
        "template": template(c),
        **numerics(c),
        **lora_key(c, "warmup"),
        **env_key(c),
        **sandbox_key(c),
    }


def warmup_body(ctx: StageContext) -> StageResult:
    from generation.setup import setup_torch
    from training.warmup import warmup

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = produce(
        ctx,
        MODEL,
        lambda out: warmup(
            Path(ctx.inputs[MODEL].path),
            ctx.inputs[PROMPTS].file("prompts.parquet"),
            ctx.cfg.sft,
            template=template(ctx.cfg),
            seed=ctx.cfg.seed,
            device=ctx.device,
            out_dir=out,
            lora=ctx.cfg.model.lora,
            env=ctx.cfg.env,
            sandbox=ctx.cfg.sandbox,
        ),
    )
    return StageResult({MODEL: ref}, metrics)


def record_warmup(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    record_checkpoint(con, ctx, res, key, "warmup", ctx.cfg.sft.steps)


def warmup_headline(m: dict) -> str:
    return f"loss {m['sft_loss_first']:.3f} -> {m['sft_loss_ema']:.3f}"


def warmup_warnings(by: Mapping[str, dict]) -> list[str]:
    """A warm-up model that solves almost nothing (its evaluation under ``WARMUP_FLOOR``)."""
    out = []
    for bench, s in sorted(by.get(eval_name("warmup"), {}).items()):
        if isinstance(s, dict) and s.get("accuracy") is not None and s["accuracy"] < WARMUP_FLOOR:
            out.append(
                f"warm-up accuracy {s['accuracy']:.3f} on {bench}: the warm-up model solves almost nothing, "
                "so DART, RFT and RL have little to start from (more sft.steps, or another sft.lr)"
            )
    return out


STAGE = Stage(
    name="warmup",
    inputs={MODEL: ("base_model", MODEL), PROMPTS: ("decontaminate", PROMPTS)},
    config=warmup_key,
    body=warmup_body,
    record=record_warmup,
    headline=warmup_headline,
    plugins=env_plugins,
    policy=True,
    title="warm-up",
    warnings=warmup_warnings,
)
