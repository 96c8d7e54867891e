"""``rft``: rejection-sampling fine-tuning of the warm-up model on DART's accepted responses."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import MODEL, RFT_DATA, produce, lora_key, numerics, record_checkpoint, template

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection


def rft_key(c: Config) -> dict:
    return {**c.curation.rft.model_dump(), "template": template(c), **numerics(c), **lora_key(c, "rft")}


def rft_body(ctx: StageContext) -> StageResult:
    from training.rft import rft
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = produce(
        ctx,
        MODEL,
        lambda out: rft(
            Path(ctx.inputs[MODEL].path),
            ctx.inputs[RFT_DATA].file("rft.parquet"),
            ctx.cfg.curation.rft,
            template=template(ctx.cfg),
            seed=ctx.cfg.seed,
            device=ctx.device,
            out_dir=out,
            lora=ctx.cfg.model.lora,
        ),
    )
    return StageResult({MODEL: ref}, metrics)


def record_rft(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    record_checkpoint(con, ctx, res, key, ctx.stage or "rft", ctx.cfg.curation.rft.steps)


def rft_headline(m: dict) -> str:
    loss = (
        f"  loss {m['rft_loss_first']:.3f} -> {m['rft_loss_ema']:.3f}"
        if m.get("rft_steps")
        else "  (passed through)"
    )
    return f"{m['rft_examples']:.0f} examples" + loss


STAGE = Stage(
    name="rft",
    inputs={MODEL: ("warmup", MODEL), RFT_DATA: ("dart", RFT_DATA)},
    config=rft_key,
    body=rft_body,
    record=record_rft,
    headline=rft_headline,
    policy=True,
    title="RFT",
)
