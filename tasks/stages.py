"""The pipeline's stages: what each reads and writes, which config and code enter its cache key,
and which catalog rows it records. Bodies call one library function each; no stage logic here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from conf.schema import Config
from core.artifacts import ArtifactRef, ArtifactStore
from core.catalog import Catalog, dumps, insert_many

MODEL, DATASET, EVAL = "model", "dataset", "eval"
PROMPTS, ATTEMPTS, RFT_DATA, SELECTION = "prompts", "attempts", "rft_data", "selection"


@dataclass
class StageContext:
    cfg: Config
    store: ArtifactStore
    inputs: dict[str, ArtifactRef]
    device: str
    catalog: Catalog | None = None
    """Read-only use in bodies (HIVE's workspace history); only record hooks write."""
    state_dir: Path | None = None
    """Where a long stage keeps resumable state between attempts (RL checkpoints); None: no resume."""


@dataclass
class StageResult:
    """What a stage produced: named artifacts and headline metrics (JSON-ready)."""

    artifacts: dict[str, ArtifactRef]
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, store: ArtifactStore | None = None) -> dict:
        """JSON-ready; with ``store``, artifact paths as stored (relative to the workspace root)."""
        conv = store.stored if store is not None else ArtifactRef.to_dict
        return {"artifacts": {k: conv(v) for k, v in self.artifacts.items()}, "metrics": self.metrics}

    @classmethod
    def from_dict(cls, d: dict, store: ArtifactStore | None = None) -> StageResult:
        """With ``store``, stored paths (relative, or absolute from a workspace since moved) are located in it."""
        conv = store.locate if store is not None else ArtifactRef.from_dict
        return cls({k: conv(v) for k, v in d["artifacts"].items()}, d.get("metrics", {}))


@dataclass(frozen=True)
class Stage:
    """``inputs`` maps an input name to (upstream stage, its output name). ``config`` picks the
    config subtree that enters the cache key; ``modules`` the library code that does."""

    name: str
    inputs: dict[str, tuple[str, str]]
    config: Callable[[Config], dict]
    modules: tuple[str, ...]
    body: Callable[[StageContext], StageResult]
    record: Callable[[Any, StageContext, StageResult, str], None] | None = None
    headline: Callable[[dict], str] = lambda m: ""
    external: Callable[[Config, Catalog | None], dict[str, str]] | None = None
    """Hashes of inputs from outside the store (a local model folder, vendored benchmark files, the
    workspace's reward history): they enter the cache key like artifact inputs, so replacing them
    reruns the stage."""


def stage_headline(stage: str, metrics: dict) -> str:
    """The stage's one-line metric summary; empty when its metrics lack what the line shows."""
    try:
        return STAGE_BY_NAME[stage].headline(metrics)
    except (KeyError, TypeError, ValueError):
        return ""


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
    \\boxed{} instruction of the benchmarks for real pools (a chat template wraps either)."""
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.benchmarks import DEFAULT_TEMPLATE

    return PROMPT_TEMPLATE if cfg.data.source == "arith" else DEFAULT_TEMPLATE


def _eval_templates() -> dict[str, str | None]:
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.stages import HELDOUT

    return {HELDOUT: PROMPT_TEMPLATE}


def _data_body(ctx: StageContext) -> StageResult:
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
            )
            specs.append(dict(ARITH_SOURCE))
        specs += snapshot_sources(d.sources, out)
        write_sources(out, specs)
        return {**metrics, "sources": float(len(specs))}

    ref, metrics = _produce(ctx, DATASET, build)
    return StageResult({DATASET: ref}, metrics)


def _ingest_body(ctx: StageContext) -> StageResult:
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
            template_share=ctx.cfg.curation.templates.min_share if ctx.cfg.curation.templates.strip else None,
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
    """What ``decontaminate`` checks the pool against: ``eval.benchmarks`` and
    ``curation.decontam.benchmarks``, in that order, once each."""
    return list(dict.fromkeys([*cfg.eval.benchmarks, *cfg.curation.decontam.benchmarks]))


def _decontaminate_body(ctx: StageContext) -> StageResult:
    from data_curation.decontaminate import decontaminate
    from evaluation.stages import HELDOUT, benchmark_hash, load_items

    data = Path(ctx.inputs[DATASET].path)
    has_heldout = (data / "heldout.parquet").exists()
    names = [b for b in decontam_benchmarks(ctx.cfg) if b != HELDOUT or has_heldout]
    items = [it for b in names for it in load_items(b, data)]
    ref, metrics = _produce(
        ctx,
        PROMPTS,
        lambda out: decontaminate(
            Path(ctx.inputs[PROMPTS].file("prompts.parquet")),
            items,
            out,
            ngram=ctx.cfg.curation.decontam.ngram,
            min_coverage=ctx.cfg.curation.decontam.min_coverage,
            paraphrase=paraphrase_params(ctx.cfg),
            benchmark_hashes={b: benchmark_hash(b, data) for b in names},
        ),
    )
    return StageResult({PROMPTS: ref}, metrics)


def _base_model_body(ctx: StageContext) -> StageResult:
    from training.base import build_base_model
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    ref, metrics = _produce(ctx, MODEL, lambda out: build_base_model(ctx.cfg.model, ctx.cfg.seed, out))
    return StageResult({MODEL: ref}, metrics)


def _warmup_body(ctx: StageContext) -> StageResult:
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
        ),
    )
    return StageResult({MODEL: ref}, metrics)


def _difficulty_body(ctx: StageContext, max_prompts: Callable[[Config], int]) -> StageResult:
    from data_curation.sampling import estimate_difficulty
    from evaluation.verifier import Verifier
    from generation.setup import setup_torch

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    c = ctx.cfg.curation.difficulty

    def run(out: Path) -> dict:
        with Verifier(timeout_s=ctx.cfg.eval.verifier_timeout_s) as verifier:
            return estimate_difficulty(
                Path(ctx.inputs[MODEL].path),
                ctx.inputs[PROMPTS].file("prompts.parquet"),
                out,
                samples=c.samples,
                max_prompts=max_prompts(ctx.cfg),
                temperature=c.temperature,
                max_new_tokens=c.max_new_tokens,
                template=template(ctx.cfg),
                seed=ctx.cfg.seed,
                device=ctx.device,
                verifier=verifier,
            )

    ref, metrics = _produce(ctx, ATTEMPTS, run, {"model": ctx.inputs[MODEL].sha256})
    return StageResult({ATTEMPTS: ref}, metrics)


def _dart_body(ctx: StageContext) -> StageResult:
    from data_curation.dart import DartParams
    from data_curation.sampling import dart_sample
    from evaluation.verifier import Verifier
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

    def run(out: Path) -> dict:
        with Verifier(timeout_s=ctx.cfg.eval.verifier_timeout_s) as verifier:
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
            )

    ref, metrics = _produce(ctx, RFT_DATA, run)
    return StageResult({RFT_DATA: ref}, metrics)


def _rft_body(ctx: StageContext) -> StageResult:
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


def _select_body(ctx: StageContext) -> StageResult:
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


def _rl_body(ctx: StageContext) -> StageResult:
    from evaluation.stages import in_run_evaluator
    from evaluation.verifier import Verifier
    from generation.model import load_tokenizer
    from training.rl.stage import TIMING_KEYS, rl
    from generation.setup import setup_torch
    from tasks.tracking import active

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    meta: dict = {}
    data = Path(ctx.inputs[DATASET].path)

    def run(out: Path) -> dict:
        with Verifier(timeout_s=ctx.cfg.eval.verifier_timeout_s) as verifier:
            evaluate = None
            if ctx.cfg.rl.eval_every > 0:
                tokenizer = load_tokenizer(ctx.inputs[MODEL].path)
                evaluate = in_run_evaluator(
                    tokenizer,
                    data if (data / "heldout.parquet").exists() else None,
                    ctx.cfg.eval,
                    templates=_eval_templates(),
                    seed=ctx.cfg.seed,
                    device=ctx.device,
                    verifier=verifier,
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
                verifier=verifier,
                select=ctx.cfg.curation.select,
                history_path=sel.file("history.parquet"),
                evaluate=evaluate,
                cluster=ctx.cfg.cluster,
                state_dir=ctx.state_dir,
                trainer=ctx.cfg.trainer,
                rollout=ctx.cfg.rollout,
                on_metrics=active().step_logger("rl"),
                lora=ctx.cfg.model.lora,
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
        }

    ref, metrics = _produce(ctx, MODEL, run, meta)
    return StageResult({MODEL: ref}, metrics)


def eval_certificates(query, checkpoint: str, benchmarks, data_dir: Path | None) -> dict[str, dict]:
    """The decontamination certificate (``tasks.certificate``) of each benchmark an evaluation of
    ``checkpoint`` scores, against the hash of the very file it reads."""
    from evaluation.stages import benchmark_hash
    from tasks.certificate import certify

    return certify(query, checkpoint, {b: benchmark_hash(b, data_dir) for b in benchmarks})


def _eval_body(ctx: StageContext) -> StageResult:
    from evaluation.stages import evaluate_checkpoint
    from generation.setup import setup_torch
    from tasks.certificate import CERTIFICATE_FILE

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    data = ctx.inputs.get(DATASET)  # absent for `laminar eval` when no data artifact exists
    certificates: dict = {}

    def run(out: Path) -> dict:
        summary = evaluate_checkpoint(
            Path(ctx.inputs[MODEL].path),
            Path(data.path) if data else None,
            ctx.cfg.eval,
            templates=_eval_templates(),
            seed=ctx.cfg.seed,
            device=ctx.device,
            out_dir=out,
        )
        query = ctx.catalog.query if ctx.catalog is not None else _no_catalog
        certificates.update(
            eval_certificates(query, ctx.inputs[MODEL].sha256, summary, Path(data.path) if data else None)
        )
        with open(out / CERTIFICATE_FILE, "w") as f:
            json.dump(certificates, f, indent=1, sort_keys=True)
        return summary

    ref, summary = _produce(ctx, EVAL, run, meta={"checkpoint": ctx.inputs[MODEL].sha256})
    return StageResult(
        {EVAL: ref}, eval_metrics(ctx.inputs[MODEL].sha256, summary, ctx.cfg.eval.n_samples, certificates)
    )


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
    certificates = certificates or {}
    return {
        "checkpoint": checkpoint,
        **{
            b: {
                "accuracy": s["accuracy"],
                "mean_length": s["mean_length"],
                "by_level": {lv: v[avg] for lv, v in s.get("by_level", {}).items()},
                **{k: s[k] for k in ("n_problems", "problems_total", "too_long", "context") if k in s},
                **({"certificate": certificates[b]["status"]} if b in certificates else {}),
            }
            for b, s in summary.items()
        },
    }


# ---- catalog records beyond the generic lineage rows ---------------------------------------------


def _record_data(con, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[DATASET]
    for split in ("pool", "heldout"):
        if ref.file(f"{split}.parquet").exists():
            con.execute(
                "INSERT INTO prompts SELECT ?, prompt_id, 'arith', split, problem, answer, level "
                "FROM read_parquet(?) ON CONFLICT DO NOTHING",
                [ref.sha256, str(ref.file(f"{split}.parquet"))],
            )


def _insert_parquet(con, table: str, columns: str, ref: ArtifactRef, file: str) -> None:
    """Rows of one of the artifact's parquet files into ``table``, keyed by the artifact's sha."""
    con.execute(
        f"INSERT INTO {table} SELECT ?, {columns} FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file(file))],
    )


def _record_ingest(con, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[PROMPTS]
    _insert_parquet(
        con, "prompts", "prompt_id, source, 'pool', problem, answer, level", ref, "prompts.parquet"
    )
    _insert_parquet(con, "quarantine", "source, source_row, raw, reason", ref, "quarantine.parquet")
    _insert_parquet(
        con,
        "duplicates",
        "source, source_row, prompt_id, canonical_id, kind, similarity",
        ref,
        "duplicates.parquet",
    )
    if ref.file("templates.parquet").exists():
        _insert_parquet(
            con,
            "source_templates",
            "source, template, prefix, suffix, rows, matched",
            ref,
            "templates.parquet",
        )


def _record_decontaminate(con, ctx: StageContext, res: StageResult, key: str) -> None:
    _insert_parquet(
        con,
        "contamination",
        "prompt_id, source, benchmark, benchmark_problem_id, matched, overlap, rule, score",
        res.artifacts[PROMPTS],
        "contamination.parquet",
    )


def _record_history(con, ref: ArtifactRef, file: str) -> None:
    con.execute(
        "INSERT INTO reward_history SELECT ?, origin, step, idx, prompt_id, mean_reward, n, now() "
        "FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file(file))],
    )


def _record_difficulty(con, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[ATTEMPTS]
    con.execute(
        "INSERT INTO attempts SELECT ?, ?, prompt_id, n, n_correct, pass_rate, mean_length, mean_entropy, "
        "level FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, ctx.inputs[MODEL].sha256, str(ref.file("attempts.parquet"))],
    )
    _record_history(con, ref, "history.parquet")


def _record_dart(con, ctx: StageContext, res: StageResult, key: str) -> None:
    _insert_parquet(
        con,
        "dart_stats",
        "prompt_id, fail_rate, target, trials, corrects, stopped_reason, level",
        res.artifacts[RFT_DATA],
        "dart_stats.parquet",
    )


def _record_select(con, ctx: StageContext, res: StageResult, key: str) -> None:
    _insert_parquet(
        con,
        "selections",
        "prompt_id, pass_rate_est, score, n_observations, selected, reason",
        res.artifacts[SELECTION],
        "selection.parquet",
    )


def _record_checkpoint(
    con, ctx: StageContext, res: StageResult, key: str, stage: str, step: int | None
) -> None:
    ref = res.artifacts[MODEL]
    base = ctx.inputs.get(MODEL)
    con.execute(
        "INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT DO NOTHING",
        [ref.sha256, stage, step, base.sha256 if base else None, key],
    )


def _record_rl(con, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[MODEL]
    _record_checkpoint(con, ctx, res, key, "rl", int(res.metrics.get("steps") or 0))
    values: dict[tuple[int, str], float] = {}  # (step, name) -> value; timings after the history
    with open(ref.file("history.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    timings = ctx.store.manifest(ref).get("meta", {}).get("timings", [])
    for m in steps + timings:
        values.update({(int(m["step"]), name): float(v) for name, v in m.items() if name != "step"})
    insert_many(
        con,
        "metrics",
        ("cache_key", "stage", "step", "name", "value"),
        [(key, "rl", step, name, v) for (step, name), v in values.items()],
        "DO UPDATE SET value = excluded.value",
    )
    with open(ref.file("consumed.json")) as f:
        consumed = json.load(f)
    insert_many(
        con,
        "consumed_prompts",
        ("checkpoint_sha", "prompt_id", "n_trajectories"),
        [(ref.sha256, pid, n) for pid, n in consumed.items()],
    )
    _record_history(con, ref, "rewards.parquet")


def _record_eval(con, ctx: StageContext, res: StageResult, key: str) -> None:
    from tasks.certificate import connection_query

    ref = res.artifacts[EVAL]
    con.execute(
        "INSERT INTO eval_results BY NAME SELECT ? AS checkpoint_sha, ? AS eval_sha, benchmark, problem_id, "
        "sample_idx, response, pred, correct, error, length, truncated, level, subject FROM read_parquet(?, "
        "union_by_name = true) ON CONFLICT DO NOTHING",
        [ctx.inputs[MODEL].sha256, ref.sha256, str(ref.file("rows.parquet"))],
    )
    certificates = read_eval_certificates(ref)
    if not certificates:  # an evaluation artifact from before certificates: certify it now
        benches = [
            r[0]
            for r in con.execute(
                "SELECT DISTINCT benchmark FROM eval_results WHERE checkpoint_sha = ? AND eval_sha = ?",
                [ctx.inputs[MODEL].sha256, ref.sha256],
            ).fetchall()
        ]
        data = ctx.inputs.get(DATASET)
        try:
            certificates = eval_certificates(
                connection_query(con), ctx.inputs[MODEL].sha256, benches, Path(data.path) if data else None
            )
        except (OSError, ValueError):  # a benchmark file no longer there: nothing to certify against
            certificates = {}
    for bench, cert in certificates.items():
        con.execute(
            "UPDATE eval_results SET certificate = ?, certificate_json = ? WHERE checkpoint_sha = ? "
            "AND eval_sha = ? AND benchmark = ?",
            [cert["status"], dumps(cert), ctx.inputs[MODEL].sha256, ref.sha256, bench],
        )


def _record_adhoc_eval(con, ctx: StageContext, res: StageResult, key: str) -> None:
    """``laminar eval``: a checkpoint from outside the store gets a ``checkpoints`` row (stage
    ``external``); one from the store already has its row, which is left as it is."""
    con.execute(
        "INSERT INTO checkpoints VALUES (?, 'external', NULL, NULL, NULL, now()) ON CONFLICT DO NOTHING",
        [ctx.inputs[MODEL].sha256],
    )
    _record_eval(con, ctx, res, key)


def _eval_headline(m: dict) -> str:
    from evaluation.report import coverage_note

    return "  ".join(
        f"{b} acc {v['accuracy']:.3f}{coverage_note(v, short=True)}"
        + (f" ({v['certificate']})" if v.get("certificate", "clean") != "clean" else "")
        for b, v in m.items()
        if isinstance(v, dict)
    )


# ---- inputs from outside the store ---------------------------------------------------------------


def _model_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    from core.artifacts import hash_tree

    return {"model.path": hash_tree(Path(cfg.model.path).expanduser())} if cfg.model.kind == "hf" else {}


def _benchmark_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    from core.artifacts import hash_file
    from evaluation.benchmarks import benchmark_path
    from evaluation.stages import HELDOUT

    return {f"benchmark:{b}": hash_file(benchmark_path(b)) for b in cfg.eval.benchmarks if b != HELDOUT}


def _decontam_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    from core.artifacts import hash_file
    from evaluation.benchmarks import benchmark_path
    from evaluation.stages import HELDOUT

    return {f"benchmark:{b}": hash_file(benchmark_path(b)) for b in decontam_benchmarks(cfg) if b != HELDOUT}


def _source_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    from data_curation.sources import source_hashes

    return source_hashes(cfg.data.sources)


def _history_fingerprint(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    """With ``curation.select.history=workspace`` the selection depends on every RL reward recorded
    in the catalog: its fingerprint enters the key, so new history reruns ``select``."""
    if cfg.curation.select.history != "workspace" or catalog is None:
        return {}
    import hashlib

    rows = catalog.query(
        "SELECT source_sha, count(*) AS n FROM reward_history WHERE origin = 'rl' "
        "GROUP BY source_sha ORDER BY source_sha"
    )
    return {"history:workspace": hashlib.sha256(dumps(rows).encode()).hexdigest()}


# ---- the DAG --------------------------------------------------------------------------------------

_EVAL_MODULES = ("evaluation.stages", "data_curation.synthetic", "generation.setup", "tasks.certificate")
_SAMPLING_MODULES = (
    "data_curation.sampling",
    "generation.setup",
    "evaluation.verifier",
    "data_curation.synthetic",
    "evaluation.benchmarks",
)


def _select_config(c: Config) -> dict:
    """``curation.select`` as select and RL see it: ``history_prompts`` reaches them through the
    history's content (difficulty_rft's artifact), so it is not part of their keys."""
    return {k: v for k, v in asdict(c.curation.select).items() if k != "history_prompts"}


def _history_prompts(c: Config) -> int:
    """Prompts HIVE's history samples with the RL starting model (``difficulty_rft``)."""
    h, cap = c.curation.select.history_prompts, c.curation.difficulty.max_prompts
    if h is None:
        return cap
    return min(h, cap) if h > 0 and cap > 0 else h


def _difficulty_stage(
    name: str,
    model_stage: str,
    max_prompts: Callable[[Config], int] = lambda c: c.curation.difficulty.max_prompts,
) -> Stage:
    """k samples per prompt with ``model_stage``'s model: pass rate, length and entropy per prompt."""
    return Stage(
        name,
        {MODEL: (model_stage, MODEL), PROMPTS: ("decontaminate", PROMPTS)},
        lambda c: {
            **asdict(c.curation.difficulty),
            "max_prompts": max_prompts(c),
            "template": template(c),
            "verifier_timeout_s": c.eval.verifier_timeout_s,
            **_numerics(c),
        },
        _SAMPLING_MODULES,
        lambda ctx: _difficulty_body(ctx, max_prompts),
        _record_difficulty,
        _headline(
            "prompts {prompts_sampled:.0f}  pass {mean_pass_rate:.3f}  edge {learning_edge:.0f}  "
            "all-correct {all_correct:.0f}  all-wrong {all_wrong:.0f}",
            "prompts_sampled",
            "mean_pass_rate",
            "learning_edge",
            "all_correct",
            "all_wrong",
        ),
    )


def _lora_key(c: Config, stage: str) -> dict:
    """What ``model.lora`` adds to a training stage's key: nothing when the stage trains every weight
    (the keys of runs without LoRA stay as they were), else the adapter's settings."""
    lo = c.model.lora
    if not lo.on(stage):
        return {}
    return {"lora": {k: v for k, v in asdict(lo).items() if k not in ("enabled", "stages")}}


def _base_model_key(c: Config) -> dict:
    """The base model stage's key: the model fields less ``lora`` (adapters never change the base)."""
    return {k: v for k, v in asdict(c.model).items() if k != "lora"}


def _numerics(c: Config) -> dict:
    """What a stage that trains or samples with torch adds to its key: the thread count it computes
    with (``threads=0`` resolved to torch's default), since float results depend on it."""
    from generation.setup import resolve_threads

    return {"torch_threads": resolve_threads(c.threads)}


def _eval_config(c: Config) -> dict:
    return {**asdict(c.eval), **_numerics(c)}


def _headline(fmt: str, *keys: str) -> Callable[[dict], str]:
    return lambda m: fmt.format(**{k: m[k] for k in keys})


STAGES: tuple[Stage, ...] = (
    Stage(
        "data",
        {},
        lambda c: asdict(c.data),
        ("data_curation.synthetic", "data_curation.sources"),
        _data_body,
        _record_data,
        lambda m: (
            (
                f"pool {int(m['pool_prompts'])}  heldout {int(m['heldout_prompts'])}  "
                if "pool_prompts" in m
                else ""
            )
            + f"sources {int(m['sources'])}"
        ),
        _source_files,
    ),
    Stage(
        "ingest",
        {DATASET: ("data", DATASET)},
        lambda c: {
            **asdict(c.curation.dedup),
            "max_prompt_chars": c.data.max_prompt_chars,
            "templates": asdict(c.curation.templates),
        },
        ("data_curation.ingest", "data_curation.sources", "data_curation.dedup", "data_curation.templates"),
        _ingest_body,
        _record_ingest,
        _headline(
            "rows {rows_in:.0f}  ingested {ingested:.0f}  quarantined {quarantined:.0f}  "
            "duplicates {duplicates_exact:.0f}+{duplicates_near:.0f} near",
            "rows_in",
            "ingested",
            "quarantined",
            "duplicates_exact",
            "duplicates_near",
        ),
    ),
    Stage(
        "decontaminate",
        {PROMPTS: ("ingest", PROMPTS), DATASET: ("data", DATASET)},
        lambda c: {**asdict(c.curation.decontam), "benchmarks": decontam_benchmarks(c)},
        ("data_curation.decontaminate", "evaluation.stages"),
        _decontaminate_body,
        _record_decontaminate,
        lambda m: (
            f"clean {m['clean']:.0f}  contaminated {m['contaminated']:.0f}"
            + (
                f" ({m['contaminated_ngram']:.0f} n-gram, {m['contaminated_paraphrase']:.0f} paraphrase)"
                if "contaminated_paraphrase" in m
                else ""
            )
        ),
        _decontam_files,
    ),
    Stage(
        "base_model",
        {},
        _base_model_key,
        ("training.base", "generation.setup"),
        _base_model_body,
        lambda con, ctx, res, key: _record_checkpoint(con, ctx, res, key, "base_model", 0),
        lambda m: f"params {int(m['parameters']):,}",
        _model_files,
    ),
    Stage(
        "warmup",
        {MODEL: ("base_model", MODEL), PROMPTS: ("decontaminate", PROMPTS)},
        lambda c: {**asdict(c.sft), "template": template(c), **_numerics(c), **_lora_key(c, "warmup")},
        ("training.warmup", "generation.setup", "training.lora", "generation.adapter"),
        _warmup_body,
        lambda con, ctx, res, key: _record_checkpoint(con, ctx, res, key, "warmup", ctx.cfg.sft.steps),
        lambda m: f"loss {m['sft_loss_first']:.3f} -> {m['sft_loss_ema']:.3f}",
    ),
    Stage(
        "eval_warmup",
        {MODEL: ("warmup", MODEL), DATASET: ("data", DATASET)},
        _eval_config,
        _EVAL_MODULES,
        _eval_body,
        _record_eval,
        _eval_headline,
        _benchmark_files,
    ),
    _difficulty_stage("difficulty", "warmup"),
    Stage(
        "dart",
        {MODEL: ("warmup", MODEL), PROMPTS: ("decontaminate", PROMPTS), ATTEMPTS: ("difficulty", ATTEMPTS)},
        lambda c: {
            **asdict(c.curation.dart),
            "max_new_tokens": c.curation.difficulty.max_new_tokens,
            "template": template(c),
            "verifier_timeout_s": c.eval.verifier_timeout_s,
            **_numerics(c),
        },
        (*_SAMPLING_MODULES, "data_curation.dart"),
        _dart_body,
        _record_dart,
        lambda m: (
            f"{m.get('trials', 0):.0f} trials  {m['rft_examples']:.0f} correct responses"
            + (
                f"  ({m['rejected_arithmetic']:.0f} right answers with a false step turned down)"
                if m.get("rejected_arithmetic")
                else ""
            )
        ),
    ),
    Stage(
        "rft",
        {MODEL: ("warmup", MODEL), RFT_DATA: ("dart", RFT_DATA)},
        lambda c: {**asdict(c.curation.rft), "template": template(c), **_numerics(c), **_lora_key(c, "rft")},
        ("training.rft", "generation.setup", "training.lora", "generation.adapter"),
        _rft_body,
        lambda con, ctx, res, key: _record_checkpoint(con, ctx, res, key, "rft", ctx.cfg.curation.rft.steps),
        lambda m: (
            f"{m['rft_examples']:.0f} examples"
            + (
                f"  loss {m['rft_loss_first']:.3f} -> {m['rft_loss_ema']:.3f}"
                if m.get("rft_steps")
                else "  (passed through)"
            )
        ),
    ),
    Stage(
        "eval_rft",
        {MODEL: ("rft", MODEL), DATASET: ("data", DATASET)},
        _eval_config,
        _EVAL_MODULES,
        _eval_body,
        _record_eval,
        _eval_headline,
        _benchmark_files,
    ),
    # HIVE selects from the pass rates of the model RL starts from (the RFT model, often much better than
    # the warm-up model whose pass rates steered DART): stale rates put solved prompts on the "edge".
    _difficulty_stage("difficulty_rft", "rft", _history_prompts),
    Stage(
        "select",
        {PROMPTS: ("decontaminate", PROMPTS), ATTEMPTS: ("difficulty_rft", ATTEMPTS)},
        lambda c: {**_select_config(c), "min_prompts": c.rl.prompts_per_step},
        ("data_curation.hive",),
        _select_body,
        _record_select,
        _headline("selected {selected:.0f} of {candidates:.0f}", "selected", "candidates"),
        _history_fingerprint,
    ),
    Stage(
        "rl",
        {MODEL: ("rft", MODEL), SELECTION: ("select", SELECTION), DATASET: ("data", DATASET)},
        lambda c: {
            **asdict(c.rl),
            "verifier_timeout_s": c.eval.verifier_timeout_s,
            "template": template(c),
            **_numerics(c),
            **_lora_key(c, "rl"),
            "select": _select_config(c),
            **({"cluster": asdict(c.cluster)} if c.rl.uses_ray() else {}),
            **({"trainer": asdict(c.trainer)} if not c.trainer.is_default() else {}),
            "rollout": asdict(c.rollout),  # both drivers sample with the rollout engine
            **({"eval": asdict(c.eval)} if c.rl.eval_every else {}),
        },
        (
            "training.rl.stage",
            "training.rl.drivers.local",
            "training.rl.drivers.ray",
            "training.rl.actors",
            "training.rl.trainer",
            "generation.setup",
            "data_curation.hive",
            "evaluation.verifier",
            "evaluation.stages",
            "training.lora",
            "generation.adapter",
        ),
        _rl_body,
        _record_rl,
        lambda m: (
            (
                f"reward {m['reward_first']:.3f} -> {m['reward_last5']:.3f} (last 5)  "
                f"{m.get('generated', 0):.0f} rollouts"
            )
            if m.get("steps")
            else ""
        ),
    ),
    Stage(
        "eval_rl",
        {MODEL: ("rl", MODEL), DATASET: ("data", DATASET)},
        _eval_config,
        _EVAL_MODULES,
        _eval_body,
        _record_eval,
        _eval_headline,
        _benchmark_files,
    ),
)
STAGE_BY_NAME = {s.name: s for s in STAGES}

EVAL_STAGE = Stage(
    "eval",
    {MODEL: ("", MODEL), DATASET: ("", DATASET)},
    _eval_config,
    _EVAL_MODULES,
    _eval_body,
    _record_adhoc_eval,
    _eval_headline,
    _benchmark_files,
)
"""``laminar eval`` on any checkpoint: not part of the DAG (its inputs come from the command line:
a checkpoint and the latest data artifact, which may be absent), same body and key scheme as the
DAG's eval stages."""
