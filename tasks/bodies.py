"""The stages' bodies: each calls one library function on its input artifacts and returns its
artifacts and headline metrics (``tasks.records.StageResult``). No stage logic here, no catalog write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.catalog import Catalog
from tasks.records import StageContext, StageResult

MODEL, DATASET, EVAL = "model", "dataset", "eval"
PROMPTS, ATTEMPTS, RFT_DATA, SELECTION = "prompts", "attempts", "rft_data", "selection"
COMPARISONS, REWARD_MODEL = "comparisons", "reward_model"


def _produce(
    ctx: StageContext, kind: str, fn: Callable[[Path], dict], meta: dict | None = None
) -> tuple[ArtifactRef, dict]:
    """Run ``fn`` into a new artifact of ``kind``; ``meta`` (which ``fn`` may fill) goes into its manifest."""
    with ctx.store.create(kind, meta) as pending:
        metrics = fn(pending.dir)
    assert pending.ref is not None
    return pending.ref, metrics


# ---- bodies -------------------------------------------------------------------------------------


def template(cfg: Config) -> str:
    """The prompt template of the training pool: the bare problem for the synthetic task, the
    \\boxed{} instruction of the benchmarks for real pools (a chat template wraps either), unless
    ``data.template`` names another."""
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.benchmarks import DEFAULT_TEMPLATE

    if cfg.data.template is not None:
        return cfg.data.template
    return PROMPT_TEMPLATE if cfg.data.source == "arith" else DEFAULT_TEMPLATE


def verifiability(cfg: Config) -> str:
    """``data.verifiability``: ingest's check that the math verifier can read a row's answer back, so
    ``off`` when another component is the run's verdict (it judges answers its own way)."""
    v = cfg.reward.verdict()
    return cfg.data.verifiability if v.is_builtin() and v.name == "math_verify" else "off"


def eval_templates(cfg: Config | None = None) -> dict[str, str | None]:
    """The synthetic held-out set's template: ``data.template`` when set, else the bare problem."""
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.stages import HELDOUT

    own = cfg.data.template if cfg is not None else None
    return {HELDOUT: own if own is not None else PROMPT_TEMPLATE}


def data_body(ctx: StageContext) -> StageResult:
    from data_curation.sources import ARITH_SOURCE, snapshot_sources, write_sources
    from data_curation.synthetic import write_dataset

    d = ctx.cfg.data

    def build(out: Path) -> dict:
        metrics: dict = {}
        specs = []
        if d.source == "arith":
            metrics = write_dataset(
                out,
                seed=ctx.cfg.seed,
                pool_size=d.pool_size,
                heldout_size=d.heldout_size,
                levels=list(d.levels),
                demo_error_rate=d.demo_error_rate,
                demo_restate_rate=d.demo_restate_rate,
                demo_full_stop_rate=d.demo_full_stop_rate,
            )
            specs.append(dict(ARITH_SOURCE))
        specs += snapshot_sources(d.sources, out)
        write_sources(out, specs)
        return {**metrics, "sources": float(len(specs))}

    ref, metrics = _produce(ctx, DATASET, build)
    return StageResult({DATASET: ref}, metrics)


def ingest_body(ctx: StageContext) -> StageResult:
    from data_curation.ingest import SourceSpec, ingest
    from data_curation.sources import read_sources

    specs = []
    for spec in read_sources(Path(ctx.inputs[DATASET].path)):
        spec["extra_fields"] = tuple(spec.get("extra_fields") or ())
        specs.append(SourceSpec(**spec))
    ref, metrics = _produce(
        ctx,
        PROMPTS,
        lambda out: ingest(
            specs,
            out,
            near_dup_threshold=ctx.cfg.curation.dedup.near_threshold,
            near_dup_same_answer=ctx.cfg.curation.dedup.same_answer,
            seed=ctx.cfg.seed,
            max_prompt_chars=ctx.cfg.data.max_prompt_chars,
            verifiability=verifiability(ctx.cfg),
            template_share=ctx.cfg.curation.templates.min_share if ctx.cfg.curation.templates.strip else None,
            allow_empty=ctx.cfg.data.allow_empty,
        ),
    )
    return StageResult({PROMPTS: ref}, metrics)


def paraphrase_params(cfg: Config):
    """``curation.decontam``'s paraphrase rule settings, or None when it is off."""
    from data_curation.decontaminate import ParaphraseParams

    d = cfg.curation.decontam
    if not d.paraphrase:
        return None
    return ParaphraseParams(
        high=d.paraphrase_high,
        moderate=d.paraphrase_moderate,
        ngram=d.paraphrase_ngram,
        num_perm=d.paraphrase_num_perm,
        bands=d.paraphrase_bands,
        seed=cfg.seed,
    )


def decontam_benchmarks(cfg: Config) -> list[str]:
    """What ``decontaminate`` checks the pool against: ``eval.benchmarks`` (file benchmarks too) and
    ``curation.decontam.benchmarks``, in that order, once each."""
    return list(dict.fromkeys([*cfg.eval.benchmark_names(), *cfg.curation.decontam.benchmarks]))


def file_benchmarks(cfg: Config) -> dict:
    """The file benchmarks of ``eval.benchmarks``, read (name -> ``evaluation.benchmarks.FileBenchmark``)."""
    from data_curation.benchmark_files import load_file_benchmarks

    return load_file_benchmarks(cfg.eval.benchmark_files().values())


def decontam_args(ctx: StageContext) -> tuple[list, dict]:
    """The benchmark items prompts are checked against (``decontam_benchmarks``; the held-out split
    only where the data stage wrote one) and ``data_curation.decontaminate.decontaminate``'s keywords,
    with each benchmark file's sha256 for the pool's certificate (``tasks.certificate``)."""
    from evaluation.stages import HELDOUT, benchmark_hash, load_items

    data = Path(ctx.inputs[DATASET].path)
    has_heldout = (data / "heldout.parquet").exists()
    names = [b for b in decontam_benchmarks(ctx.cfg) if b != HELDOUT or has_heldout]
    files = file_benchmarks(ctx.cfg)
    items = [it for b in names for it in load_items(b, data, files)]
    return items, dict(
        ngram=ctx.cfg.curation.decontam.ngram,
        min_coverage=ctx.cfg.curation.decontam.min_coverage,
        paraphrase=paraphrase_params(ctx.cfg),
        benchmark_hashes={b: benchmark_hash(b, data, files) for b in names},
    )


def decontaminate_body(ctx: StageContext) -> StageResult:
    from data_curation.decontaminate import decontaminate

    items, decontam = decontam_args(ctx)
    ref, metrics = _produce(
        ctx,
        PROMPTS,
        lambda out: decontaminate(Path(ctx.inputs[PROMPTS].file("prompts.parquet")), items, out, **decontam),
    )
    return StageResult({PROMPTS: ref}, metrics)


def base_model_body(ctx: StageContext) -> StageResult:
    from training.base import build_base_model
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = _produce(ctx, MODEL, lambda out: build_base_model(ctx.cfg.model, ctx.cfg.seed, out))
    return StageResult({MODEL: ref}, metrics)


def warmup_body(ctx: StageContext) -> StageResult:
    from generation.setup import setup_torch
    from training.warmup import warmup

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = _produce(
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


def history_prompts(c: Config) -> int:
    """Prompts HIVE's history samples with the RL starting model (``difficulty_rft``)."""
    h, cap = c.curation.select.history_prompts, c.curation.difficulty.max_prompts
    if h is None:
        return cap
    return min(h, cap) if h > 0 and cap > 0 else h


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
            )

    ref, metrics = _produce(ctx, ATTEMPTS, run, {"model": ctx.inputs[MODEL].sha256})
    return StageResult({ATTEMPTS: ref}, metrics)


def dart_body(ctx: StageContext) -> StageResult:
    from data_curation.dart import DartParams
    from data_curation.sampling import dart_sample
    from rewards.verdicts import open_verdict
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    c = ctx.cfg.curation.dart
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
                Path(ctx.inputs[MODEL].path),
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
            )

    ref, metrics = _produce(ctx, RFT_DATA, run)
    return StageResult({RFT_DATA: ref}, metrics)


def rft_body(ctx: StageContext) -> StageResult:
    from training.rft import rft
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = _produce(
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

    ref, metrics = _produce(ctx, COMPARISONS, run)
    return StageResult({COMPARISONS: ref}, metrics)


def reward_model_body(ctx: StageContext) -> StageResult:
    """A Bradley-Terry reward model trained on the comparisons (or ``reward_model.path`` measured on
    them), with the baselines and the annotators' agreement (the ceiling) in its metrics."""
    import pyarrow.parquet as pq

    from data_curation.preferences import agreement
    from generation.setup import setup_torch
    from training import reward_model as rm

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

    ref, metrics = _produce(ctx, MODEL, run)
    return StageResult({MODEL: ref}, metrics)


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

    ref, metrics = _produce(ctx, SELECTION, run)
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


def rl_body(ctx: StageContext) -> StageResult:
    from evaluation.stages import in_run_evaluator
    from rewards.compose import Reward
    from rewards.verdicts import open_verdict
    from rewards.verifier import Verifier
    from generation.model import load_tokenizer
    from training.rl.stage import TIMING_KEYS, rl
    from generation.setup import setup_torch
    from tasks.tracking import active

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    meta: dict = {}
    data = Path(ctx.inputs[DATASET].path)
    rm_ref = ctx.inputs.get(REWARD_MODEL)
    if ctx.cfg.reward.uses_reward_model() and rm_ref is None:
        raise ValueError("reward.components names reward_model but no reward_model stage ran before rl")

    def run(out: Path) -> dict:
        with (
            open_verdict(ctx.cfg.reward, ctx.cfg.eval.verifier_timeout_s, ctx.cfg.sandbox) as verifier,
            ExitStack() as stack,
        ):
            evaluate = None
            if ctx.cfg.rl.eval_every > 0:
                tokenizer = load_tokenizer(ctx.inputs[MODEL].path)
                evaluate = in_run_evaluator(
                    tokenizer,
                    data if (data / "heldout.parquet").exists() else None,
                    ctx.cfg.eval,
                    templates=eval_templates(ctx.cfg),
                    seed=ctx.cfg.seed,
                    device=ctx.device,
                    verifier=verifier
                    if isinstance(verifier, Verifier)
                    else stack.enter_context(
                        Verifier(timeout_s=ctx.cfg.eval.verifier_timeout_s)  # vendored math benchmarks
                    ),
                    files=file_benchmarks(ctx.cfg),
                    env=ctx.cfg.env,
                    judges=open_judges(ctx.cfg, stack, verifier),
                    sandbox=ctx.cfg.sandbox,
                )
            sel = ctx.inputs[SELECTION]
            result = rl(
                Path(ctx.inputs[MODEL].path),
                sel.file("prompts.parquet"),
                ctx.cfg.rl,
                template=template(ctx.cfg),
                seed=ctx.cfg.seed,
                device=ctx.device,
                out_dir=out,
                reward=Reward.of(
                    verifier,
                    ctx.cfg.reward,
                    rm_ref.path if rm_ref else None,
                    template(ctx.cfg),
                    sandbox=ctx.cfg.sandbox,
                ),
                select=ctx.cfg.curation.select,
                history_path=sel.file("history.parquet"),
                evaluate=evaluate,
                cluster=ctx.cfg.cluster,
                state_dir=ctx.state_dir,
                trainer=ctx.cfg.trainer,
                rollout=ctx.cfg.rollout,
                env=ctx.cfg.env,
                sandbox=ctx.cfg.sandbox,
                on_metrics=active().step_logger("rl"),
                lora=ctx.cfg.model.lora,
                teacher=ctx.cfg.teacher,
            )
        rows = [m.as_dict() for m in result.history]
        meta["timings"] = [{k: m[k] for k in ("step", *TIMING_KEYS) if k in m} for m in rows]
        rewards = [m.reward for m in result.history]
        window = (
            [sum(rewards[i : i + 5]) / len(rewards[i : i + 5]) for i in range(max(1, len(rewards) - 4))]
            if rewards
            else []
        )
        return {
            "steps": len(result.history),
            "trajectories": sum(result.consumed.values()),
            "generated": int(sum(m.generated_trajectories for m in result.history)),
            "reward_last5": window[-1] if window else None,
            "reward_first5": window[0] if window else None,
            "reward_peak5": max(window) if window else None,
            "reward_first": rewards[0] if rewards else None,
            **_term_summary(rows),
        }

    ref, metrics = _produce(ctx, MODEL, run, meta)
    return StageResult({MODEL: ref}, metrics)


def _term_summary(rows: list[dict]) -> dict[str, float]:
    """Each reward component's mean (``reward/<name>``) at the first step and over the last 5 steps,
    and its fallback count over the run (``reward_errors/<name>``)."""
    out: dict[str, float] = {}
    for key in sorted({k for m in rows for k in m if k.startswith("reward/")}):
        values = [m[key] for m in rows if key in m]
        out[f"{key}_first"], out[f"{key}_last5"] = values[0], sum(values[-5:]) / len(values[-5:])
    for key in sorted({k for m in rows for k in m if k.startswith("reward_errors/")}):
        out[key] = sum(m.get(key, 0.0) for m in rows)
    return out


def eval_certificates(
    query,
    checkpoint: str,
    benchmarks,
    data_dir: Path | None,
    files: dict | None = None,
    root: Path | None = None,
) -> dict[str, dict]:
    """The decontamination certificate (``tasks.certificate``) of each benchmark an evaluation of
    ``checkpoint`` scores, against the hash of the very file it reads (``files``: the file
    benchmarks, read; ``root``: the workspace root the catalog's artifact paths are under)."""
    from evaluation.stages import benchmark_hash
    from tasks.certificate import certify

    hashes = {b: benchmark_hash(b, data_dir, files or {}) for b in benchmarks}
    return certify(query, checkpoint, hashes, root=root)


def eval_body(ctx: StageContext) -> StageResult:
    from evaluation.stages import evaluate_checkpoint
    from generation.setup import setup_torch
    from tasks.certificate import CERTIFICATE_FILE

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    data = ctx.inputs.get(DATASET)  # absent for `laminar eval` when no data artifact exists
    certificates: dict = {}
    files = file_benchmarks(ctx.cfg)
    components = reward_model_components(ctx)

    def run(out: Path) -> dict:
        with ExitStack() as stack:
            summary = evaluate_checkpoint(
                Path(ctx.inputs[MODEL].path),
                Path(data.path) if data else None,
                ctx.cfg.eval,
                templates=eval_templates(ctx.cfg),
                seed=ctx.cfg.seed,
                device=ctx.device,
                out_dir=out,
                files=files,
                env=ctx.cfg.env,
                components=components,
                judges=open_judges(ctx.cfg, stack),
                sandbox=ctx.cfg.sandbox,
            )
        query = ctx.catalog.query if ctx.catalog is not None else _no_catalog
        certificates.update(
            eval_certificates(
                query,
                ctx.inputs[MODEL].sha256,
                summary,
                Path(data.path) if data else None,
                files,
                ctx.store.workspace_root,
            )
        )
        with open(out / CERTIFICATE_FILE, "w") as f:
            json.dump(certificates, f, indent=1, sort_keys=True)
        return summary

    ref, summary = _produce(ctx, EVAL, run, meta={"checkpoint": ctx.inputs[MODEL].sha256})
    return StageResult(
        {EVAL: ref}, eval_metrics(ctx.inputs[MODEL].sha256, summary, ctx.cfg.eval.n_samples, certificates)
    )


def open_judges(cfg: Config, stack: ExitStack, run_verdict=None) -> dict:
    """Benchmark -> its verdict where it is not the math verifier: the run's verdict judges the pool's
    held-out set (``run_verdict``, else opened here), a file benchmark its own ``verdict``; each is
    closed with ``stack``. Vendored benchmarks keep theirs (math, or a code benchmark's tests)."""
    from evaluation.stages import HELDOUT
    from rewards.verdicts import MATH_VERIFY, benchmark_verdict, open_verdict

    timeout = cfg.eval.verifier_timeout_s
    out: dict = {}
    spec = cfg.reward.verdict()
    if HELDOUT in cfg.eval.benchmark_names() and not (spec.is_builtin() and spec.name == MATH_VERIFY):
        out[HELDOUT] = (
            run_verdict
            if run_verdict is not None
            else stack.enter_context(open_verdict(cfg.reward, timeout, cfg.sandbox))
        )
    for name, b in cfg.eval.benchmark_files().items():
        if b.verdict_name() != MATH_VERIFY:
            out[name] = stack.enter_context(
                benchmark_verdict(b.verdict_name(), b.verdict_params, timeout, cfg.sandbox)
            )
    return out


def reward_model_components(ctx: StageContext) -> list:
    """The learned reward model as an evaluation scorer, built like RL's ``reward_model`` component
    (its normalisation and clip), when the stage reads a reward model; else none."""
    from rewards.compose import REWARD_MODEL as NAME
    from rewards.compose import build_component

    ref = ctx.inputs.get(REWARD_MODEL)
    if ref is None:
        return []
    spec = next(c for c in ctx.cfg.reward.components if c.name == NAME)
    return [build_component(spec, ref.path, template(ctx.cfg))]


def _no_catalog(sql: str, params=()) -> list[dict]:
    """No catalog, no lineage: the checkpoint is of unknown origin."""
    return []


def read_eval_certificates(ref: ArtifactRef) -> dict[str, dict]:
    """An evaluation artifact's certificates (empty for one made before certificates existed)."""
    from tasks.certificate import CERTIFICATE_FILE

    path = ref.file(CERTIFICATE_FILE)
    return json.loads(path.read_text()) if path.exists() else {}


def eval_metrics(checkpoint: str, summary: dict, n_samples: int, certificates: dict | None = None) -> dict:
    """A stage result's metrics from an evaluation summary (benchmark -> evaluation.metrics summary),
    with each benchmark's decontamination certificate status when given."""
    avg = f"avg@{n_samples}"
    rm_keys = ("reward/reward_model", f"rm_best@{n_samples}", f"maj@{n_samples}")  # with a reward model
    episode_keys = (
        "tool_calls_per_episode",
        "tool_errors_per_episode",
        "turns_per_episode",
    )  # env != single_turn
    certificates = certificates or {}
    return {
        "checkpoint": checkpoint,
        **{
            b: {
                "accuracy": s["accuracy"],
                "mean_length": s["mean_length"],
                "by_level": {lv: v[avg] for lv, v in s.get("by_level", {}).items()},
                **{k: s[k] for k in ("n_problems", "problems_total", "too_long", "context") if k in s},
                **({k: s[k] for k in rm_keys if k in s} if "reward/reward_model" in s else {}),
                **{k: s[k] for k in episode_keys if k in s},
                **({"certificate": certificates[b]["status"]} if b in certificates else {}),
            }
            for b, s in summary.items()
        },
    }
