"""Every catalog write of a run, and only the runner (``tasks.runner``) calls this module: the run's
row (opened, closed as completed, failed or interrupted), each stage's rows (``stage_runs``, its
artifacts and their edges, what its cache key was made of) and each stage's own rows (its
``Stage.record`` hook, declared in its module of ``tasks.stages``, given the runner's transaction,
after its ``Stage.tables``). Each write is one transaction with
idempotent keys, so a retried or replayed stage never double-counts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.catalog import dumps
from core.workspace import Workspace
from tasks.cache import _digest, source_files
from tasks.records import INTERRUPTED, Stage, StageContext, StageOutcome

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
        if stage.tables:
            con.execute(stage.tables)
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
