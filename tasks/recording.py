"""Every catalog write of a run, and only the runner (``tasks.runner``) calls this module: the run's
row (opened, closed as completed, failed or interrupted), each stage's rows (``stage_runs``, its
artifacts and their edges, what its cache key was made of) and each stage's own rows (its ``record``
hook in ``tasks.dag.STAGES``, given the runner's transaction). Each write is one transaction with
idempotent keys, so a retried or replayed stage never double-counts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.catalog import dumps, insert_many
from core.workspace import Workspace
from tasks.bodies import (
    ATTEMPTS,
    COMPARISONS,
    DATASET,
    EVAL,
    MODEL,
    PROMPTS,
    RFT_DATA,
    SELECTION,
    eval_certificates,
    read_eval_certificates,
)
from tasks.cache import _digest, source_files
from tasks.certificate import connection_query
from tasks.records import INTERRUPTED, Stage, StageContext, StageOutcome, StageResult

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

LINEAGE_SCHEMA = """
CREATE TABLE IF NOT EXISTS stage_lineage (
    cache_key VARCHAR PRIMARY KEY, stage VARCHAR,
    config_json VARCHAR,   -- the config subtree in the key
    inputs_json VARCHAR,   -- input name -> {kind, sha256, path} of store artifacts
    external_json VARCHAR, -- name -> sha256 of inputs from outside the store
    sources_json VARCHAR,  -- module -> {path, sha256}: the files behind the source fingerprint
    verified BOOLEAN       -- the recorded inputs and external hashes reproduce the key's inputs hash
);
"""


# ---- the run's row ---------------------------------------------------------------------------------


def open_run(ws: Workspace, run_id: str, command: str, config: dict, flow_run_id: str | None) -> None:
    """The ``runs`` row of a starting run, status ``running``."""
    with ws.catalog.transaction() as con:
        con.execute(
            "INSERT INTO runs VALUES (?, now(), NULL, 'running', ?, ?, ?)",
            [run_id, command, dumps(config), flow_run_id],
        )


def record_flow_run(ws: Workspace, run_id: str, flow_run_id: str | None) -> None:
    """The Prefect flow run of a laminar run, unless an outer (scheduled) flow run is recorded already."""
    if flow_run_id:
        with ws.catalog.transaction() as con:
            con.execute(
                "UPDATE runs SET prefect_flow_run_id = coalesce(prefect_flow_run_id, ?) WHERE run_id = ?",
                [str(flow_run_id), run_id],
            )


def mark_interrupted(ws: Workspace) -> list[str]:
    """Runs whose row still says ``running``: their process died (SIGKILL, OOM, power). The caller
    holds the workspace lock, so none of them is still running. Returns their ids."""
    if not ws.catalog.path.exists():
        return []
    with ws.catalog.transaction() as con:
        rows = con.execute("SELECT run_id FROM runs WHERE status = 'running' ORDER BY started_at").fetchall()
        if rows:
            con.execute("UPDATE runs SET status = ? WHERE status = 'running'", [INTERRUPTED])
    return [r[0] for r in rows]


class RunRecordError(RuntimeError):
    """The run finished but its catalog row could not be closed."""


def finish_run(ws: Workspace, run_id: str, status: str, error: BaseException | None) -> None:
    """Close the ``runs`` row with ``status``. When the run is failing with ``error``, a failure here
    (a full disk, a catalog held open too long) never replaces it: ``error`` keeps propagating with
    this failure added as a note, and the row stays ``running`` (the next run marks it interrupted)."""
    try:
        with ws.catalog.transaction() as con:
            con.execute("UPDATE runs SET finished_at = now(), status = ? WHERE run_id = ?", [status, run_id])
    except Exception as close_err:  # noqa: BLE001 - reported on the error that matters
        detail = (
            f"{type(close_err).__name__}: {close_err}"
            if type(close_err) is not type(error)
            else f"{type(close_err).__name__}, as above"
        )
        note = f"laminar: also, run {run_id} could not be recorded as {status} in the catalog ({detail})"
        if error is None:
            raise RunRecordError(note.removeprefix("laminar: also, ")) from close_err
        logging.getLogger("laminar").error(note)
        error.add_note(note)


# ---- one stage's rows ------------------------------------------------------------------------------


def record_stage_run(
    ws: Workspace,
    run_id: str,
    stage: Stage,
    out: StageOutcome,
    inputs: Mapping[str, ArtifactRef],
    started: datetime,
    cfg: Config,
    device: str,
) -> None:
    """Lineage rows for one stage of a run (its ``stage_runs`` row, artifacts and edges) and the
    stage's own rows (``stage.record``), all or nothing."""
    ctx = StageContext(cfg=cfg, store=ws.artifacts, inputs=dict(inputs), device=device)
    k = out.key
    with ws.catalog.transaction() as con:
        con.execute(
            "INSERT INTO stage_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, now(), ?, ?, ?, ?) "
            "ON CONFLICT DO UPDATE SET status = excluded.status, finished_at = excluded.finished_at, "
            "seconds = excluded.seconds, outputs_json = excluded.outputs_json, "
            "metrics_json = excluded.metrics_json",
            [
                run_id,
                stage.name,
                out.status,
                k.digest,
                k.config_hash,
                k.inputs_hash,
                k.source_hash,
                k.seed,
                started,
                out.seconds,
                out.task_run_id,
                dumps(out.result.to_dict(ws.artifacts)["artifacts"]),
                dumps(out.result.metrics),
            ],
        )
        for ref in out.result.artifacts.values():
            manifest = ws.artifacts.manifest(ref)
            con.execute(
                "INSERT INTO artifacts VALUES (?, ?, ?, now(), ?, ?, ?) ON CONFLICT DO NOTHING",
                [
                    ref.kind,
                    ref.sha256,
                    ws.artifacts.stored(ref)["path"],
                    stage.name,
                    k.digest,
                    dumps(manifest.get("meta", {})),
                ],
            )
            for parent in inputs.values():
                con.execute(
                    "INSERT INTO artifact_edges VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    [parent.kind, parent.sha256, ref.kind, ref.sha256, stage.name, k.digest],
                )
        if stage.record is not None:
            stage.record(con, ctx, out.result, k.digest)


def _jsonable(obj: Any) -> Any:
    from dataclasses import asdict, is_dataclass

    if hasattr(obj, "model_dump"):  # a config section
        return obj.model_dump()
    return asdict(obj) if is_dataclass(obj) else obj


def record_lineage(
    ws: Workspace, stage: Stage, cfg: Config, out: StageOutcome, inputs: Mapping[str, ArtifactRef]
) -> None:
    """What ``out``'s cache key was made of (``stage_lineage``), once per key: the catalog's
    ``stage_runs`` stores only the key parts' hashes. Written after every stage, ran or cached
    (idempotent), so a stage that finished before a crash is completed on the rerun."""
    key = out.key
    with ws.catalog.transaction() as con:
        con.execute(LINEAGE_SCHEMA)
        if con.execute("SELECT 1 FROM stage_lineage WHERE cache_key = ?", [key.digest]).fetchall():
            return
    external = stage.external_hashes(cfg, ws.catalog)
    hashes = {**{k: v.sha256 for k, v in inputs.items()}, **external}
    verified = _digest(dict(sorted(hashes.items()))) == key.inputs_hash
    with ws.catalog.transaction() as con:
        con.execute(LINEAGE_SCHEMA)
        con.execute(
            "INSERT INTO stage_lineage VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [
                key.digest,
                stage.name,
                dumps(_jsonable(stage.config(cfg))),
                dumps({k: ws.artifacts.stored(v) for k, v in inputs.items()}),
                dumps(external),
                dumps(source_files(stage.modules)),
                verified,
            ],
        )


# ---- each stage's own rows (``Stage.record``) --------------------------------------------------------


def record_data(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[DATASET]
    for split in ("pool", "heldout"):
        if ref.file(f"{split}.parquet").exists():
            con.execute(
                "INSERT INTO prompts SELECT ?, prompt_id, 'arith', split, problem, answer, level "
                "FROM read_parquet(?) ON CONFLICT DO NOTHING",
                [ref.sha256, str(ref.file(f"{split}.parquet"))],
            )


def _insert_parquet(con: Connection, table: str, columns: str, ref: ArtifactRef, file: str) -> None:
    """Rows of one of the artifact's parquet files into ``table``, keyed by the artifact's sha."""
    con.execute(
        f"INSERT INTO {table} SELECT ?, {columns} FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file(file))],
    )


def record_ingest(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
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


def record_decontaminate(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    _insert_parquet(
        con,
        "contamination",
        "prompt_id, source, benchmark, benchmark_problem_id, matched, overlap, rule, score",
        res.artifacts[PROMPTS],
        "contamination.parquet",
    )


def _record_history(con: Connection, ref: ArtifactRef, file: str) -> None:
    con.execute(
        "INSERT INTO reward_history SELECT ?, origin, step, idx, prompt_id, mean_reward, n, now() "
        "FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file(file))],
    )


def record_difficulty(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[ATTEMPTS]
    con.execute(
        "INSERT INTO attempts SELECT ?, ?, prompt_id, n, n_correct, pass_rate, mean_length, mean_entropy, "
        "level FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, ctx.inputs[MODEL].sha256, str(ref.file("attempts.parquet"))],
    )
    _record_history(con, ref, "history.parquet")


def record_dart(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    _insert_parquet(
        con,
        "dart_stats",
        "prompt_id, fail_rate, target, trials, corrects, stopped_reason, level",
        res.artifacts[RFT_DATA],
        "dart_stats.parquet",
    )


def record_select(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    _insert_parquet(
        con,
        "selections",
        "prompt_id, pass_rate_est, score, n_observations, selected, reason",
        res.artifacts[SELECTION],
        "selection.parquet",
    )


def record_preferences(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[COMPARISONS]
    _insert_parquet(
        con,
        "comparisons",
        "comparison_id, prompt, chosen, rejected, margin, annotator, source",
        ref,
        "comparisons.parquet",
    )
    _insert_parquet(con, "preference_quarantine", 'source, "row", reason', ref, "quarantine.parquet")


def record_reward_model(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    _record_checkpoint(con, ctx, res, key, "reward_model", ctx.cfg.reward_model.steps)


def _record_checkpoint(
    con: Connection, ctx: StageContext, res: StageResult, key: str, stage: str, step: int | None
) -> None:
    ref = res.artifacts[MODEL]
    base = ctx.inputs.get(MODEL)
    con.execute(
        "INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT DO NOTHING",
        [ref.sha256, stage, step, base.sha256 if base else None, key],
    )


def record_base_model(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    _record_checkpoint(con, ctx, res, key, "base_model", 0)


def record_warmup(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    _record_checkpoint(con, ctx, res, key, "warmup", ctx.cfg.sft.steps)


def record_rft(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    _record_checkpoint(con, ctx, res, key, "rft", ctx.cfg.curation.rft.steps)


def record_rl(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
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
    record_reward(con, ref)


def record_reward(con: Connection, ref: ArtifactRef) -> None:
    """``reward_components`` (the reward the checkpoint trained under) and ``reward_terms`` (every
    response's score per component): the RL artifact's ``reward.json`` and ``reward_terms.parquet``."""
    with open(ref.file("reward.json")) as f:
        spec = json.load(f)
    rows = [
        (ref.sha256, i, c["name"], c["weight"], c["correctness"], dumps(c["params"]))
        for i, c in enumerate(spec)
    ]
    insert_many(
        con,
        "reward_components",
        ("checkpoint_sha", "position", "component", "weight", "correctness", "params_json"),
        rows,
    )
    con.execute(
        "INSERT INTO reward_terms SELECT ?, idx, step, prompt_id, sample_idx, component, value "
        "FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file("reward_terms.parquet"))],
    )


def record_eval(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
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
