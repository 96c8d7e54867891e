"""The DAG as Prefect flows. No logic here.

``laminar_pipeline``: every selected stage in DAG order, each a cached Prefect task, then its lineage
record and its Prefect artifacts and asset events (``tasks.runner.run_stages``). ``laminar_run``: one
whole run (workspace lock, run record, summary) around ``laminar_pipeline``: what ``laminar serve``
deploys on a schedule.
"""

from __future__ import annotations

from prefect import flow, runtime

from conf.loader import load_config
from core.workspace import Workspace
from tasks.dag import Selection, select
from tasks.prefect_env import one_line_failures
from tasks.records import StageOutcome
from tasks.runner import run_pipeline, run_stages
from tasks.serving import check_served_run


@flow(name="laminar-pipeline", log_prints=False, persist_result=False)
def laminar_pipeline(
    overrides: list[str],
    workspace: str,
    run_id: str,
    force: list[str] | None = None,
    stages: list[str] | None = None,
) -> list[StageOutcome]:
    """``stages``: the stages to run (None: all); each must come with its upstream (``tasks.dag.select``)."""
    one_line_failures()
    return run_stages(
        load_config(overrides),
        Workspace.at(workspace),
        run_id,
        Selection(stages, list(force or [])),
        flow_run_id=str(runtime.flow_run.id),
    )


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
        selection=select(until=served.until, force=served.force, cfg=served.cfg),
        command=served.command,
        flow_run_id=str(runtime.flow_run.id),
    )
    return {"run_id": result.run_id, "metrics": result.summary.metrics}
