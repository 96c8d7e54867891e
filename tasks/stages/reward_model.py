"""``reward_model`` (with ``reward=reward_model``): a Bradley-Terry reward model trained on the
preference comparisons (or ``reward_model.path`` measured on them)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import (
    folder_hash,
    COMPARISONS,
    MODEL,
    produce,
    numerics,
    record_checkpoint,
    uses_reward_model,
)

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

    from core.catalog import Catalog


def reward_model_key(c: Config) -> dict:
    keys = ("backbone", "path", "steps", "batch_size", "lr", "heldout_share", "max_len")
    return {**{k: getattr(c.reward_model, k) for k in keys}, **numerics(c)}


def reward_model_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    """The folders ``reward_model.path`` and a ``reward_model.backbone`` other than the warm-up model."""
    c, out = cfg.reward_model, {}
    if c.path is not None:
        out["reward_model.path"] = folder_hash(c.path)
    if c.backbone != "warmup":
        out["reward_model.backbone"] = folder_hash(c.backbone)
    return out


def reward_model_body(ctx: StageContext) -> StageResult:
    """A Bradley-Terry reward model trained on the comparisons (or ``reward_model.path`` measured on
    them), with the baselines and the annotators' agreement (the ceiling) in its metrics."""
    import pyarrow.parquet as pq

    from data_curation.preferences import agreement
    from generation.setup import setup_torch
    import training.reward_model as rm

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    c = ctx.cfg.reward_model
    comparisons = pq.read_table(ctx.inputs[COMPARISONS].file("comparisons.parquet")).to_pylist()
    warmup = Path(ctx.inputs[MODEL].path)

    def run(out: Path) -> dict:
        if c.path is not None:
            model, tok = rm.load_backbone(Path(c.path).expanduser())
            held, metrics = comparisons, {"train_comparisons": 0.0}
        else:
            backbone = warmup if c.backbone == "warmup" else Path(c.backbone).expanduser()
            model, tok = rm.load_backbone(backbone)
            held, train = rm.split_by_prompt(comparisons, c.heldout_share, ctx.cfg.seed)
            losses = rm.fit(
                model,
                tok,
                train,
                steps=c.steps,
                batch_size=c.batch_size,
                lr=c.lr,
                max_len=c.max_len,
                seed=ctx.cfg.seed,
            )
            metrics = {"train_comparisons": float(len(train))}
            if losses:
                metrics.update(rm_loss_first=losses[0], rm_loss_last=losses[-1])
        measured, stats = rm.measure(model, tok, held, c.max_len)
        rm.save(model, tok, out, stats)
        metrics.update(measured)
        metrics["baseline_policy_logprob_accuracy"] = rm.policy_logprob_baseline(warmup, held, c.max_len)
        ceiling = agreement(held)
        if "agreement" in ceiling:
            metrics["agreement_ceiling"] = ceiling["agreement"]
        return metrics

    ref, metrics = produce(ctx, MODEL, run)
    return StageResult({MODEL: ref}, metrics)


def record_reward_model(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    record_checkpoint(con, ctx, res, key, "reward_model", ctx.cfg.reward_model.steps)


def reward_model_headline(m: dict) -> str:
    base = (
        f"longer {m['baseline_longer_wins_accuracy']:.3f}, "
        f"shorter {m['baseline_shorter_wins_accuracy']:.3f}, "
        f"policy log-prob {m['baseline_policy_logprob_accuracy']:.3f}"
    )
    ceiling = f", ceiling {m['agreement_ceiling']:.3f}" if "agreement_ceiling" in m else ""
    return f"held-out accuracy {m['rm_heldout_accuracy']:.3f}  ({base}{ceiling})"


REWARD_MODEL_METRICS = (
    ("reward_model_heldout_accuracy", "rm_heldout_accuracy"),
    ("reward_model_baseline_random_accuracy", "baseline_random_accuracy"),
    ("reward_model_baseline_longer_wins_accuracy", "baseline_longer_wins_accuracy"),
    ("reward_model_baseline_shorter_wins_accuracy", "baseline_shorter_wins_accuracy"),
    ("reward_model_baseline_policy_logprob_accuracy", "baseline_policy_logprob_accuracy"),
    ("reward_model_agreement_ceiling", "agreement_ceiling"),
)
"""summary.json's reward-model keys -> the reward_model stage's metric of the same meaning."""


def reward_model_metrics(m: dict) -> dict[str, float | None]:
    """The reward model's held-out pairwise accuracy, its baselines and the annotators' ceiling."""
    return {label: m.get(key) for label, key in REWARD_MODEL_METRICS}


STAGE = Stage(
    name="reward_model",
    inputs={MODEL: ("warmup", MODEL), COMPARISONS: ("preferences", COMPARISONS)},
    config=reward_model_key,
    body=reward_model_body,
    record=record_reward_model,
    headline=reward_model_headline,
    external=reward_model_files,
    when=uses_reward_model,
    summary=reward_model_metrics,
)
