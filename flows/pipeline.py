"""The DAG as Prefect flows. No logic here.

``laminar_pipeline``: every selected stage in DAG order, each a cached Prefect task, then its lineage
record and its Prefect artifacts and asset events. ``laminar_run``: one whole run (workspace lock,
run record, summary) around ``laminar_pipeline``: what ``laminar serve`` deploys on a schedule.
"""

from __future__ import annotations

import logging

from prefect import flow, runtime

from conf.loader import load_config
from core.workspace import Workspace
from tasks.lineage import record_stage
from tasks.operate import record_flow_run, run_pipeline, select
from tasks.prefect_publish import publish_stage
from tasks.runner import run_stage
from tasks.serving import check_served_run
from tasks.stages import STAGES
from tasks.summary import publish_prefect_artifacts

LOG = logging.getLogger("laminar.flows")


@flow(name="laminar-pipeline", log_prints=False, persist_result=False)
def laminar_pipeline(
    overrides: list[str],
    workspace: str,
    run_id: str,
    force: list[str] | None = None,
    stages: list[str] | None = None,
) -> list:
    """``stages``: the stages to run (None: all); each must come with its upstream (``tasks.operate.select``)."""
    cfg = load_config(overrides)
    ws = Workspace.at(workspace)
    record_flow_run(ws, run_id, runtime.flow_run.id)
    outcomes: dict = {}
    for stage in STAGES:
        if stages is not None and stage.name not in stages:
            continue
        outcomes[stage.name] = run_stage(
            stage.name, cfg, ws, run_id, outcomes, force=stage.name in (force or [])
        )
        record_stage(ws, stage.name, cfg, outcomes)
        try:
            publish_stage(ws, stage.name, outcomes)
        except Exception as err:  # noqa: BLE001 - the UI's view never fails a run
            LOG.warning("stage %s: Prefect artifacts/assets not published: %s", stage.name, err)
    publish_prefect_artifacts(list(outcomes.values()))
    return list(outcomes.values())


@flow(name="laminar-run", log_prints=True, persist_result=False)
def laminar_run(overrides: list[str] | None = None, workspace: str | None = None) -> dict:
    """One run of ``laminar serve``'s deployment under the workspace lock, as ``laminar run`` does; fails
    at once when another laminar process holds the workspace. The serve process fixes the workspace
    (``workspace``: only that one), the stages and the recorded command; the overrides a caller passes
    are checked and validated before anything is written (``tasks.serving.check_served_run``)."""
    served = check_served_run(overrides, workspace)
    result = run_pipeline(
        served.cfg,
        Workspace.at(served.workspace),
        laminar_pipeline,
        overrides=served.overrides,
        selection=select(until=served.until, force=served.force),
        command=served.command,
        flow_run_id=str(runtime.flow_run.id),
    )
    return {"run_id": result.run_id, "metrics": result.summary["metrics"]}
