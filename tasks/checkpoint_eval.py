"""``laminar eval``: evaluate one checkpoint, outside the DAG, through the eval stage's body.

The checkpoint is a sha prefix resolved through the catalog (``checkpoints`` / ``artifacts``) or a
``save_pretrained`` folder (hashed like a store artifact, so a store folder resolves to its own
sha). The evaluation has a cache key of the pipeline's scheme; an artifact already recorded under
that key is reused, and its rows are (re)recorded with idempotent keys, so a rerun or a rerun after
a crash never double counts. No Prefect: an ad-hoc evaluation needs no server.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime, UTC
from pathlib import Path
from collections.abc import Callable

from conf.schema import Config
from core.artifacts import ArtifactRef, hash_tree, write_json_atomic
from core.workspace import Workspace
from tasks.stages.common import DATASET, EVAL, MODEL, REWARD_MODEL
from tasks.stages.evaluate import eval_metrics, read_eval_certificates
from tasks.dag import EVAL_STAGE, stage_key
from tasks.records import StageContext, StageOutcome, StageResult
from tasks.runner import record_outcome, recorded_run

_SHA_PREFIX = re.compile(r"[0-9a-f]{4,64}")


class EvalInputError(ValueError):
    """A checkpoint or data input that cannot be evaluated; the message says what to pass instead."""


@dataclass(frozen=True)
class EvalReport:
    run_id: str
    status: str  # "ran" | "cached"
    checkpoint: ArtifactRef
    eval: ArtifactRef
    summary: dict  # benchmark -> evaluation.metrics summary
    seconds: float
    certificates: dict = dataclasses.field(default_factory=dict)  # benchmark -> tasks.certificate certificate


def resolve_checkpoint(ws: Workspace, spec: str) -> ArtifactRef:
    """A ``save_pretrained`` folder, a PEFT adapter folder (its base found beside it in the store or at
    the path it names), or the unique model artifact whose sha starts with ``spec``."""
    from generation.adapter import base_dir, is_adapter_dir

    path = Path(spec).expanduser()
    if path.exists() and is_adapter_dir(path):
        if not (path / "adapter_model.safetensors").is_file():
            raise EvalInputError(
                f"ckpt={spec} has no adapter_model.safetensors; pickled adapter weights are never loaded"
            )
        try:
            base_dir(path)
        except FileNotFoundError as err:
            raise EvalInputError(f"ckpt={spec}: {err}") from None
        return ArtifactRef(MODEL, hash_tree(path.resolve()), str(path.resolve()))
    if path.exists():
        if not (path / "config.json").is_file():
            raise EvalInputError(f"ckpt={spec} is not a save_pretrained folder (no config.json)")
        if not list(path.glob("*.safetensors")):
            raise EvalInputError(
                f"ckpt={spec} has no *.safetensors weights; pickled weights are never loaded, "
                "convert them to safetensors first"
            )
        return ArtifactRef(MODEL, hash_tree(path.resolve()), str(path.resolve()))
    prefix = spec.lower()
    if not _SHA_PREFIX.fullmatch(prefix):
        raise EvalInputError(
            f"ckpt={spec}: no such folder, and not a checkpoint sha prefix (at least 4 hex "
            "characters); pass a save_pretrained folder or a sha from `checkpoints` in the catalog"
        )
    rows = ws.catalog.query(
        "SELECT c.checkpoint_sha AS sha, c.stage, c.step, a.path FROM checkpoints c "
        "LEFT JOIN artifacts a ON a.kind = 'model' AND a.sha256 = c.checkpoint_sha "
        "WHERE c.checkpoint_sha LIKE ? UNION "
        "SELECT a.sha256, a.stage, NULL, a.path FROM artifacts a WHERE a.kind = 'model' AND a.sha256 LIKE ? "
        "AND a.sha256 NOT IN (SELECT checkpoint_sha FROM checkpoints)",
        [prefix + "%", prefix + "%"],
    )
    if not rows:
        known = ws.catalog.query(
            "SELECT checkpoint_sha, stage, step FROM checkpoints ORDER BY created_at DESC LIMIT 10"
        )
        listing = "; ".join(f"{r['checkpoint_sha'][:12]} ({r['stage']}, step {r['step']})" for r in known)
        raise EvalInputError(
            f"ckpt={spec}: no checkpoint in {ws.root} starts with {prefix!r}"
            + (f"; recent ones: {listing}" if listing else " (the catalog has none; run `laminar run`)")
        )
    if len({r["sha"] for r in rows}) > 1:
        listing = "; ".join(f"{r['sha'][:16]} ({r['stage']})" for r in rows)
        raise EvalInputError(f"ckpt={spec} is ambiguous: {listing}; give more characters")
    row = rows[0]
    if row["path"] is None:
        raise EvalInputError(
            f"checkpoint {row['sha'][:12]} ({row['stage']}) is not in the artifact store; "
            "pass ckpt=<its save_pretrained folder>"
        )
    ref = ws.artifacts.locate(ArtifactRef(MODEL, row["sha"], row["path"]))
    if not ws.artifacts.exists(ref):
        raise EvalInputError(
            f"checkpoint {row['sha'][:12]} is missing from the store ({row['path']}); "
            "rerun the stage that made it (`laminar run --force STAGE`)"
        )
    if is_adapter_dir(ref.path):  # a LoRA checkpoint: its base (the lineage's root model) must be there too
        try:
            base_dir(ref.path)
        except FileNotFoundError as err:
            raise EvalInputError(f"ckpt={spec} is a LoRA adapter: {err}") from None
    return ref


def latest_dataset(ws: Workspace) -> ArtifactRef | None:
    for row in ws.catalog.query(
        "SELECT sha256, path FROM artifacts WHERE kind = ? ORDER BY created_at DESC", [DATASET]
    ):
        ref = ws.artifacts.locate(ArtifactRef(DATASET, row["sha256"], row["path"]))
        if ws.artifacts.exists(ref):
            return ref
    return None


def latest_reward_model(ws: Workspace) -> ArtifactRef | None:
    """The reward model the workspace's reward_model stage made last (still in the store), or None."""
    for row in ws.catalog.query(
        "SELECT a.sha256, a.path FROM checkpoints c JOIN artifacts a ON a.sha256 = c.checkpoint_sha "
        "WHERE c.stage = 'reward_model' AND a.kind = ? ORDER BY c.created_at DESC",
        [MODEL],
    ):
        ref = ws.artifacts.locate(ArtifactRef(MODEL, row["sha256"], row["path"]))
        if ws.artifacts.exists(ref):
            return ref
    return None


def _inputs(
    cfg: Config, ws: Workspace, spec: str, say: Callable[[str], None]
) -> tuple[Config, dict[str, ArtifactRef]]:
    from evaluation.stages import HELDOUT

    inputs = {MODEL: resolve_checkpoint(ws, spec)}
    if HELDOUT in cfg.eval.benchmark_names():
        data = latest_dataset(ws)
        if data is not None:
            inputs[DATASET] = data
        else:
            rest = [b for b in cfg.eval.benchmarks if b != HELDOUT]
            if not rest:
                raise EvalInputError(
                    f"{HELDOUT} needs a data artifact and {ws.root} has none (run `laminar run` "
                    "first), or pick other benchmarks: eval.benchmarks=[gsm8k,math500]"
                )
            say(f"laminar: skipping {HELDOUT}: no dataset artifact in {ws.root}")
            cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"benchmarks": rest})})
    if cfg.reward.uses_reward_model():
        rm = latest_reward_model(ws)
        if rm is None:
            raise EvalInputError(
                f"reward.components names reward_model and {ws.root} has no reward model; run "
                "`laminar run reward=reward_model` first, or evaluate without it (reward=verifier)"
            )
        say(f"laminar: scoring with reward model {rm.sha256[:12]} (the workspace's latest)")
        inputs[REWARD_MODEL] = rm
    return cfg, inputs


def _cached(ws: Workspace, key: str) -> ArtifactRef | None:
    """The eval artifact of an earlier ``laminar eval`` with this cache key, if it is still in the store."""
    for row in ws.catalog.query(
        "SELECT outputs_json FROM stage_runs WHERE stage = ? AND cache_key = ? ORDER BY finished_at DESC",
        [EVAL_STAGE.name, key],
    ):
        out = json.loads(row["outputs_json"] or "{}")
        if EVAL in out and ws.artifacts.exists(out[EVAL]):
            return ws.artifacts.locate(out[EVAL])
    return None


def evaluate(
    cfg: Config, ws: Workspace, spec: str, run_id: str, command: str, say: Callable[[str], None] = print
) -> EvalReport:
    """Evaluate checkpoint ``spec`` under run ``run_id``; the caller holds the workspace lock."""
    from generation.model import resolve_device

    t0 = time.perf_counter()
    started = datetime.now(UTC)
    cfg, inputs = _inputs(cfg, ws, spec, say)
    device = resolve_device(cfg.device)
    key = stage_key(EVAL_STAGE, cfg, inputs)
    with recorded_run(ws, run_id, command, cfg.model_dump(mode="json")) as status:
        ref = _cached(ws, key.digest)
        if ref is not None:
            with open(ref.file("summary.json")) as f:
                summary = json.load(f)
            result = StageResult(
                {EVAL: ref},
                eval_metrics(inputs[MODEL].sha256, summary, cfg.eval.n_samples, read_eval_certificates(ref)),
            )
            outcome_status = "cached"
        else:
            names = ", ".join(cfg.eval.benchmark_names())
            say(f"evaluating checkpoint {inputs[MODEL].sha256[:12]} on {names} (n={cfg.eval.n_samples})")
            ctx = StageContext(cfg=cfg, store=ws.artifacts, inputs=inputs, device=device, catalog=ws.catalog)
            result = EVAL_STAGE.body(ctx)
            ref = result.artifacts[EVAL]
            with open(ref.file("summary.json")) as f:
                summary = json.load(f)
            outcome_status = "ran"
        outcome = StageOutcome(EVAL_STAGE.name, outcome_status, time.perf_counter() - t0, key, result, None)
        record_outcome(ws, run_id, EVAL_STAGE, outcome, inputs, started, cfg, device, lineage=False)
        certificates = {
            r["benchmark"]: json.loads(r["certificate_json"])
            for r in ws.catalog.query(
                "SELECT DISTINCT benchmark, certificate_json FROM eval_results WHERE checkpoint_sha = ? "
                "AND eval_sha = ? AND certificate_json IS NOT NULL",
                [inputs[MODEL].sha256, ref.sha256],
            )
        }
        report = EvalReport(
            run_id, outcome_status, inputs[MODEL], ref, summary, time.perf_counter() - t0, certificates
        )
        write_json_atomic(
            ws.run_dir(run_id) / "summary.json",
            {
                "run_id": run_id,
                "kind": "eval",
                "status": outcome_status,
                "seconds": report.seconds,
                "checkpoint": ws.artifacts.stored(inputs[MODEL]),
                "dataset": inputs[DATASET].sha256 if DATASET in inputs else None,
                "eval": ref.sha256,
                "cache_key": key.digest,
                "benchmarks": summary,
                "certificates": certificates,
            },
        )
        status.value = "completed"
        return report


def format_eval(report: EvalReport) -> str:
    """The per-benchmark table ``laminar eval`` prints."""
    from evaluation.report import format_eval_table

    head = (
        f"checkpoint {report.checkpoint.sha256[:12]}  eval {report.eval.sha256[:12]}  {report.status}  "
        f"{report.seconds:.1f}s  run {report.run_id}"
    )
    return head + "\n" + format_eval_table(report.summary) + format_certificates(report.certificates)


def format_certificates(certificates: dict) -> str:
    """One line per benchmark: its decontamination certificate (empty when there are none)."""
    if not certificates:
        return ""
    lines = [
        "",
        "decontamination certificate (was the checkpoint's training data checked against this file?):",
    ]
    for bench, c in certificates.items():
        lines.append(
            f"  {bench:<14} {c['status']:<21} {bench} sha256 {str(c.get('benchmark_sha256'))[:12]}"
            + (f"  {c['detail']}" if c.get("detail") else "")
        )
    return "\n".join(lines)
