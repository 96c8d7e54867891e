"""``base_model``: the model the pipeline starts from (the tiny embedded Llama built from its config,
or a local Hugging Face folder)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import MODEL, folder_hash, produce, record_checkpoint

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

    from core.catalog import Catalog


def base_model_key(c: Config) -> dict:
    """The model fields less ``lora`` (adapters never change the base)."""
    return {k: v for k, v in c.model.model_dump().items() if k != "lora"}


def model_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    return {"model.path": folder_hash(cfg.model.path)} if cfg.model.kind == "hf" else {}


def base_model_body(ctx: StageContext) -> StageResult:
    from training.base import build_base_model
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = produce(ctx, MODEL, lambda out: build_base_model(ctx.cfg.model, ctx.cfg.seed, out))
    return StageResult({MODEL: ref}, metrics)


def record_base_model(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    record_checkpoint(con, ctx, res, key, "base_model", 0)


def base_model_headline(m: dict) -> str:
    return f"params {int(m['parameters']):,}"


STAGE = Stage(
    name="base_model",
    inputs={},
    config=base_model_key,
    body=base_model_body,
    record=record_base_model,
    headline=base_model_headline,
    external=model_files,
    policy=True,
)
