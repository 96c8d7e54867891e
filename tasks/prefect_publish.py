"""Each stage as Prefect sees it: artifacts in the flow run, and asset events for what it wrote.

After every stage the flow calls ``publish_stage``:

- a **table artifact** ``laminar-<stage>`` (one row per metric, nested metrics flattened with dots),
- a **markdown artifact** ``laminar-<stage>-lineage`` (ran or cached, cache key and its parts, input
  and output artifacts with their hashes),
- for a stage that ran, one ``prefect.asset.materialization.succeeded`` event per output, and one
  ``prefect.asset.referenced`` event per input, exactly as Prefect's ``@materialize`` emits them
  (``prefect.context.AssetContext.emit_events``). ``@materialize`` itself does not fit: it needs the
  asset keys before the task runs, and a laminar output is known only once written. The asset is
  the stage's output slot, ``laminar://<workspace>/<stage>/<output>``; each materialisation carries
  the content hash and path of that version in its payload. Like Prefect, a cached stage
  materialises nothing.

Prefect's events reach the API in the background; the flow's end flushes them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from core.artifacts import ArtifactRef
from core.nested import flatten
from core.workspace import Workspace
from tasks.dag import STAGE_BY_NAME, stage_headline
from tasks.records import Stage, StageOutcome

_BANNED = re.compile(r"[\s#?&%\"'<>\[\]{}|\\^`]")


def artifact_key(stage: str, suffix: str = "") -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"laminar-{stage}{'-' + suffix if suffix else ''}".lower()).strip("-")


def asset_key(ws: Workspace, stage: str, output: str) -> str:
    root = _BANNED.sub("_", ws.root.as_posix().strip("/")) or "workspace"
    return f"laminar://{root}/{stage}/{output}"


def metric_rows(metrics: Mapping[str, Any]) -> list[dict]:
    """A stage's metrics as table rows, nested keys joined with dots."""
    return [{"metric": k, "value": v} for k, v in flatten(metrics).items()]


def stage_markdown(
    ws: Workspace, stage_name: str, outcome: StageOutcome, inputs: Mapping[str, ArtifactRef]
) -> str:
    k = outcome.key
    lines = [
        f"# {stage_name}: {outcome.status}",
        "",
        f"{stage_headline(stage_name, outcome.result.metrics) or ''}",
        "",
        "| | |",
        "|---|---|",
        f"| cache key | `{k.digest}` |",
        f"| config hash | `{k.config_hash}` |",
        f"| inputs hash | `{k.inputs_hash}` |",
        f"| source fingerprint | `{k.source_hash}` |",
        f"| seed | {k.seed} |",
        f"| seconds | {outcome.seconds:.2f} |",
        f"| prefect task run | `{outcome.task_run_id}` |",
        "",
        "| direction | name | kind | sha256 | asset |",
        "|---|---|---|---|---|",
    ]
    for name, ref in inputs.items():
        src, out = STAGE_BY_NAME[stage_name].inputs[name]
        lines.append(f"| input | {name} | {ref.kind} | `{ref.sha256}` | `{asset_key(ws, src, out)}` |")
    for name, ref in outcome.result.artifacts.items():
        lines.append(
            f"| output | {name} | {ref.kind} | `{ref.sha256}` | `{asset_key(ws, stage_name, name)}` |"
        )
    lines += [
        "",
        f"`laminar lineage {next(iter(outcome.result.artifacts.values())).sha256[:12]} "
        f"--workspace {ws.root}` shows its full upstream tree."
        if outcome.result.artifacts
        else "",
    ]
    return "\n".join(lines)


def asset_events(
    ws: Workspace, stage_name: str, outcome: StageOutcome, inputs: Mapping[str, ArtifactRef]
) -> list[dict]:
    """The events ``publish_stage`` emits (as ``emit_event`` keyword arguments); none for a cached stage."""
    if outcome.status != "ran":
        return []
    stage = STAGE_BY_NAME[stage_name]
    upstream = [
        {"prefect.resource.id": asset_key(ws, *stage.inputs[name]), "prefect.resource.role": "asset"}
        for name in inputs
    ]
    events = [
        {
            "event": "prefect.asset.referenced",
            "resource": {"prefect.resource.id": r["prefect.resource.id"]},
            "related": [],
        }
        for r in upstream
    ]
    by = {"prefect.resource.id": "laminar", "prefect.resource.role": "asset-materialized-by"}
    for name, ref in outcome.result.artifacts.items():
        events.append(
            {
                "event": "prefect.asset.materialization.succeeded",
                "resource": {
                    "prefect.resource.id": asset_key(ws, stage_name, name),
                    "prefect.resource.name": f"{stage_name}/{name}",
                    "prefect.asset.description": f"laminar {ref.kind} made by stage {stage_name}",
                },
                "related": [*upstream, by],
                "payload": {
                    "kind": ref.kind,
                    "sha256": ref.sha256,
                    "path": ws.artifacts.stored(ref)["path"],
                    "cache_key": outcome.key.digest,
                    "inputs": {n: r.sha256 for n, r in inputs.items()},
                    "metrics": {
                        r["metric"]: r["value"]
                        for r in metric_rows(outcome.result.metrics)
                        if isinstance(r["value"], (int, float, str, bool)) or r["value"] is None
                    },
                },
            }
        )
    return events


def publish_stage(
    ws: Workspace, stage: Stage, outcome: StageOutcome, inputs: Mapping[str, ArtifactRef]
) -> None:
    """Prefect artifacts and asset events of one finished stage (call inside the flow run)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.events import emit_event

    rows = metric_rows(outcome.result.metrics) or [{"metric": "(none)", "value": None}]
    create_table_artifact(
        table=rows,
        key=artifact_key(stage.name),
        description=f"stage {stage.name} ({outcome.status}): metrics",
    )
    create_markdown_artifact(
        markdown=stage_markdown(ws, stage.name, outcome, inputs),
        key=artifact_key(stage.name, "lineage"),
        description=f"stage {stage.name} ({outcome.status}): cache key, inputs and outputs",
    )
    for ev in asset_events(ws, stage.name, outcome, inputs):
        emit_event(**ev)
