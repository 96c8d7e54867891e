"""``dart``: difficulty-aware rejection sampling (DART): more trials for the prompts the warm-up model
fails most, keeping the responses the verdict accepts (or the reward model ranks top)."""

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
    REWARD_MODEL,
    RFT_DATA,
    produce,
    drop_defaults,
    insert_parquet,
    numerics,
    reward_model_components,
    reward_model_key,
    template,
    verdict_key,
)

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection


def dart_ranks(c: Config) -> bool:
    """Whether DART keeps the reward model's top-ranked responses (``curation.dart.select``)."""
    return c.curation.dart.select == "reward_model"


def dart_key(c: Config) -> dict:
    """``select`` only when the reward model ranks (the key of verifier selection is as it was), then
    with the reward model's scoring settings."""
    dart = drop_defaults(c.curation.dart, "model")  # the warm-up's key is as it was
    if not dart_ranks(c):
        del dart["select"]
    return {
        **dart,
        "max_new_tokens": c.curation.difficulty.max_new_tokens,
        "template": template(c),
        "verifier_timeout_s": c.eval.verifier_timeout_s,
        **numerics(c),
        **(reward_model_key(c) if dart_ranks(c) else {}),
        **verdict_key(c),
        **episodes_key(c),
    }


def dart_teacher_files(cfg: Config, catalog=None) -> dict[str, str]:
    """``curation.dart.model=teacher``: the teacher's folder hash (in the key and the lineage)."""
    from core.artifacts import hash_tree

    if cfg.curation.dart.model != "teacher":
        return {}
    return {"teacher.path": hash_tree(Path(cfg.teacher.path).expanduser())}


def dart_model(ctx: StageContext) -> Path:
    """The model that synthesises DART's trials (``curation.dart.model``): the warm-up model, or the
    teacher checkpoint, which must share the warm-up's tokenizer (checked before anything is written)."""
    from generation.model import load_tokenizer

    warmup = Path(ctx.inputs[MODEL].path)
    if ctx.cfg.curation.dart.model != "teacher":
        return warmup
    path = ctx.cfg.teacher.path
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        raise ValueError(
            f"teacher.path={path}: no model folder (config.json) there (curation.dart.model=teacher)"
        )
    if load_tokenizer(folder).get_vocab() != load_tokenizer(warmup).get_vocab():
        raise ValueError(
            f"teacher.path={path}: its tokenizer differs from the warm-up model's; "
            "curation.dart.model=teacher needs the student's tokenizer"
        )
    return folder


def dart_body(ctx: StageContext) -> StageResult:
    from data_curation.dart import DartParams
    from data_curation.sampling import dart_sample
    from rewards.verdicts import open_verdict
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    c = ctx.cfg.curation.dart
    synthesiser = dart_model(ctx)
    params = DartParams(
        strategy=c.strategy,
        k_u=c.k_u,
        k_p=c.k_p,
        max_trials=c.max_trials,
        budget=c.budget,
        round_size=c.round_size,
    )
    ranker = None
    if c.select == "reward_model":  # rank instead of verify (validate() asks for reward=reward_model)
        ranker = next(iter(reward_model_components(ctx)), None)
        if ranker is None:
            raise ValueError(
                "curation.dart.select=reward_model but the dart stage has no reward model input; run it "
                "with reward=reward_model (the reward_model stage) or set curation.dart.select=verifier"
            )

    def run(out: Path) -> dict:
        with open_verdict(ctx.cfg.reward, ctx.cfg.eval.verifier_timeout_s, ctx.cfg.sandbox) as verifier:
            return dart_sample(
                synthesiser,
                ctx.inputs[PROMPTS].file("prompts.parquet"),
                ctx.inputs[ATTEMPTS].file("attempts.parquet"),
                out,
                params,
                max_new_tokens=ctx.cfg.curation.difficulty.max_new_tokens,
                temperature=c.temperature,
                template=template(ctx.cfg),
                seed=ctx.cfg.seed,
                device=ctx.device,
                verifier=verifier,
                check_arithmetic=c.check_arithmetic,
                ranker=ranker,
                env=ctx.cfg.env,
                sandbox=ctx.cfg.sandbox,
            )

    ref, metrics = produce(ctx, RFT_DATA, run)
    return StageResult({RFT_DATA: ref}, metrics)


def record_dart(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    insert_parquet(
        con,
        "dart_stats",
        "prompt_id, fail_rate, target, trials, corrects, stopped_reason, level",
        res.artifacts[RFT_DATA],
        "dart_stats.parquet",
    )


def dart_headline(m: dict) -> str:
    rejected = (
        f"  ({m['rejected_arithmetic']:.0f} right answers with a false step turned down)"
        if m.get("rejected_arithmetic")
        else ""
    )
    if "rm_kept_verified" in m:  # curation.dart.select=reward_model
        return (
            f"{m.get('trials', 0):.0f} trials  {m['rft_examples']:.0f} responses ranked top by the reward "
            f"model ({m['rm_kept_verified']:.0%} of them verified)"
        )
    return f"{m.get('trials', 0):.0f} trials  {m['rft_examples']:.0f} correct responses" + rejected


STAGE = Stage(
    name="dart",
    inputs={
        MODEL: ("warmup", MODEL),
        PROMPTS: ("decontaminate", PROMPTS),
        ATTEMPTS: ("difficulty", ATTEMPTS),
        REWARD_MODEL: ("reward_model", MODEL),
    },
    config=dart_key,
    body=dart_body,
    record=record_dart,
    headline=dart_headline,
    reads={REWARD_MODEL: dart_ranks},
    plugins=curation_plugins,
    external=dart_teacher_files,
    curates=True,
)
