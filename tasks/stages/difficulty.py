"""``difficulty`` and ``difficulty_rft``: pass rates of a model on the pool, sampled and judged by
the run's verdict. The warm-up model's steer DART; the RFT model's (the one RL starts from) steer
HIVE's selection."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import (
    curation_plugins,
    episodes_key,
    ATTEMPTS,
    MODEL,
    PROMPTS,
    produce,
    numerics,
    record_history,
    template,
    verdict_key,
)

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection


def history_prompts(c: Config) -> int:
    """Prompts HIVE's history samples with the RL starting model (``difficulty_rft``)."""
    h, cap = c.curation.select.history_prompts, c.curation.difficulty.max_prompts
    if h is None:
        return cap
    return min(h, cap) if h > 0 and cap > 0 else h


def _difficulty_key(c: Config, max_prompts: int) -> dict:
    return {
        **c.curation.difficulty.model_dump(),
        "max_prompts": max_prompts,
        "template": template(c),
        "verifier_timeout_s": c.eval.verifier_timeout_s,
        **numerics(c),
        **verdict_key(c),
        **episodes_key(c),
    }


def difficulty_key(c: Config) -> dict:
    return _difficulty_key(c, c.curation.difficulty.max_prompts)


def difficulty_rft_key(c: Config) -> dict:
    return _difficulty_key(c, history_prompts(c))


def difficulty_body(ctx: StageContext) -> StageResult:
    """Pass rates of the warm-up model (they steer DART)."""
    return _difficulty(ctx, ctx.cfg.curation.difficulty.max_prompts)


def difficulty_rft_body(ctx: StageContext) -> StageResult:
    """Pass rates of the RFT model, the one RL starts from (they steer HIVE's selection)."""
    return _difficulty(ctx, history_prompts(ctx.cfg))


def _difficulty(ctx: StageContext, max_prompts: int) -> StageResult:
    from data_curation.sampling import estimate_difficulty
    from rewards.verdicts import open_verdict
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    c = ctx.cfg.curation.difficulty

    def run(out: Path) -> dict:
        with open_verdict(ctx.cfg.reward, ctx.cfg.eval.verifier_timeout_s, ctx.cfg.sandbox) as verifier:
            return estimate_difficulty(
                Path(ctx.inputs[MODEL].path),
                ctx.inputs[PROMPTS].file("prompts.parquet"),
                out,
                samples=c.samples,
                max_prompts=max_prompts,
                temperature=c.temperature,
                max_new_tokens=c.max_new_tokens,
                template=template(ctx.cfg),
                seed=ctx.cfg.seed,
                device=ctx.device,
                verifier=verifier,
                env=ctx.cfg.env,
                sandbox=ctx.cfg.sandbox,
            )

    ref, metrics = produce(ctx, ATTEMPTS, run, {"model": ctx.inputs[MODEL].sha256})
    return StageResult({ATTEMPTS: ref}, metrics)


def record_difficulty(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[ATTEMPTS]
    con.execute(
        "INSERT INTO attempts SELECT ?, ?, prompt_id, n, n_correct, pass_rate, mean_length, mean_entropy, "
        "level FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, ctx.inputs[MODEL].sha256, str(ref.file("attempts.parquet"))],
    )
    record_history(con, ref, "history.parquet")


def difficulty_headline(m: dict) -> str:
    return (
        f"prompts {m['prompts_sampled']:.0f}  pass {m['mean_pass_rate']:.3f}  edge {m['learning_edge']:.0f}  "
        f"all-correct {m['all_correct']:.0f}  all-wrong {m['all_wrong']:.0f}"
    )


STAGE = Stage(
    name="difficulty",
    inputs={MODEL: ("warmup", MODEL), PROMPTS: ("decontaminate", PROMPTS)},
    config=difficulty_key,
    body=difficulty_body,
    record=record_difficulty,
    headline=difficulty_headline,
    plugins=curation_plugins,
    curates=True,
)

# HIVE selects from the pass rates of the model RL starts from (the RFT model, often much better than
# the warm-up model whose pass rates steered DART): stale rates put solved prompts on the "edge".
RFT_STAGE = Stage(
    name="difficulty_rft",
    inputs={MODEL: ("rft", MODEL), PROMPTS: ("decontaminate", PROMPTS)},
    config=difficulty_rft_key,
    body=difficulty_rft_body,
    record=record_difficulty,
    headline=difficulty_headline,
    plugins=curation_plugins,
    curates=True,
)
