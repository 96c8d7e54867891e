"""The evaluation stages: held-out and benchmark accuracy of a checkpoint (``eval_warmup``,
``eval_rft``, ``eval_rl`` in the DAG, one per evaluated stage: ``stage_for``) and ``laminar eval``'s
stage (``ADHOC``), each benchmark with its decontamination certificate."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from core.artifacts import ArtifactRef
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import (
    DATASET,
    EVAL,
    MODEL,
    REWARD_MODEL,
    produce,
    benchmark_hashes,
    coverage_note,
    dumps,
    env_key,
    env_plugins,
    eval_name,
    file_benchmarks,
    numerics,
    reward_model_components,
    reward_model_key,
    reward_targets,
    sandbox_key,
    verdict_key,
)

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

    from core.catalog import Catalog


def eval_key(c: Config) -> dict:
    from training.rl.mix import mix_key

    own = {"template": c.data.template} if c.data.template is not None else {}
    return {
        **c.eval.model_dump(),
        **numerics(c),
        **env_key(c),
        **reward_model_key(c),
        **sandbox_key(c),
        **verdict_key(c),
        **mix_key(c.envs),  # with several environments, each one's held-out accuracy (absent when none)
        **own,
    }


def benchmark_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    return benchmark_hashes(cfg, cfg.eval.benchmark_names())


def eval_plugins(cfg: Config) -> list[str]:
    """The verdicts and ``score_with`` components of the benchmarks (the run's verdict judges the
    pool's held-out set), and the environment."""
    from conf.schema import RewardComponentConfig
    from evaluation.stages import HELDOUT

    specs = [cfg.reward.verdict()] if HELDOUT in cfg.eval.benchmark_names() else []
    for b in cfg.eval.benchmark_files().values():
        specs += [RewardComponentConfig.of(name=n) for n in (b.verdict_name(), *b.score_with)]
    return [*reward_targets(specs), *env_plugins(cfg)]


# ---- the body ------------------------------------------------------------------------------------


def eval_templates(cfg: Config | None = None) -> dict[str, str | None]:
    """The synthetic held-out set's template: ``data.template`` when set, else the bare problem."""
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.stages import HELDOUT

    own = cfg.data.template if cfg is not None else None
    return {HELDOUT: own if own is not None else PROMPT_TEMPLATE}


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
    from training.rl.mix import env_names
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
                envs=list(zip(env_names(ctx.cfg.envs), ctx.cfg.envs)),
            )
        query = ctx.catalog.query if ctx.catalog is not None else _no_catalog
        certificates.update(
            eval_certificates(
                query,
                ctx.inputs[MODEL].sha256,
                [b for b in summary if "@" not in b],  # a mixed environment's rows: its held-out set's
                Path(data.path) if data else None,
                files,
                ctx.store.workspace_root,
            )
        )
        with open(out / CERTIFICATE_FILE, "w") as f:
            json.dump(certificates, f, indent=1, sort_keys=True)
        return summary

    ref, summary = produce(ctx, EVAL, run, meta={"checkpoint": ctx.inputs[MODEL].sha256})
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
                **{k: s[k] for k in ("weighted_accuracy", "by_env") if k in s},  # envs: the overall row
                **({"certificate": certificates[b]["status"]} if b in certificates else {}),
            }
            for b, s in summary.items()
        },
    }


# ---- catalog rows, headline ----------------------------------------------------------------------


def record_eval(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
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
                connection_query(con),
                ctx.inputs[MODEL].sha256,
                benches,
                Path(data.path) if data else None,
                root=ctx.store.workspace_root,
            )
        except (OSError, ValueError):  # a benchmark file no longer there: nothing to certify against
            certificates = {}
    for bench, cert in certificates.items():
        con.execute(
            "UPDATE eval_results SET certificate = ?, certificate_json = ? WHERE checkpoint_sha = ? "
            "AND eval_sha = ? AND benchmark = ?",
            [cert["status"], dumps(cert), ctx.inputs[MODEL].sha256, ref.sha256, bench],
        )


def record_adhoc_eval(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    """``laminar eval``: a checkpoint from outside the store gets a ``checkpoints`` row (stage
    ``external``); one from the store already has its row, which is left as it is."""
    con.execute(
        "INSERT INTO checkpoints VALUES (?, 'external', NULL, NULL, NULL, now()) ON CONFLICT DO NOTHING",
        [ctx.inputs[MODEL].sha256],
    )
    record_eval(con, ctx, res, key)


def eval_headline(m: dict) -> str:
    return "  ".join(
        f"{b} acc {v['accuracy']:.3f}{coverage_note(v, short=True)}"
        + "".join(f" {k} {v[k]:.3f}" for k in v if k.startswith("rm_best@"))
        + (f" ({v['certificate']})" if v.get("certificate", "clean") != "clean" else "")
        for b, v in m.items()
        if isinstance(v, dict)
    )


def stage_for(model_stage: str) -> Stage:
    """Held-out and benchmark accuracy of ``model_stage``'s model (``eval_<model_stage>``)."""
    return Stage(
        name=eval_name(model_stage),
        inputs={
            MODEL: (model_stage, MODEL),
            DATASET: ("data", DATASET),
            REWARD_MODEL: ("reward_model", MODEL),
        },
        config=eval_key,
        body=eval_body,
        record=record_eval,
        headline=eval_headline,
        external=benchmark_files,
        plugins=eval_plugins,
        evaluates=model_stage,
    )


ADHOC = Stage(
    name="eval",
    inputs={MODEL: ("", MODEL), DATASET: ("", DATASET)},
    config=eval_key,
    body=eval_body,
    record=record_adhoc_eval,
    headline=eval_headline,
    external=benchmark_files,
    plugins=eval_plugins,
)
"""``laminar eval`` on any checkpoint: not part of the DAG (its inputs come from the command line:
a checkpoint and the latest data artifact, which may be absent), same body and key scheme as the
DAG's eval stages."""
