"""The DAG as one Prefect flow: every stage in order, each a cached Prefect task. No logic here."""

from __future__ import annotations

from prefect import flow

from conf.loader import load_config
from core.workspace import Workspace
from tasks.runner import run_stage
from tasks.stages import STAGES
from tasks.summary import publish_prefect_artifacts


@flow(name="laminar-pipeline", log_prints=False, persist_result=False)
def laminar_pipeline(overrides: list[str], workspace: str, run_id: str, force: list[str] | None = None) -> list:
    cfg = load_config(overrides)
    ws = Workspace.at(workspace)
    outcomes: dict = {}
    for stage in STAGES:
        outcomes[stage.name] = run_stage(stage.name, cfg, ws, run_id, outcomes,
                                         force=stage.name in (force or []))
    publish_prefect_artifacts(list(outcomes.values()))
    return list(outcomes.values())
