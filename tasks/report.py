"""``laminar report``: gather a pipeline run's records from the catalog and write its report
(``<workspace>/runs/<run-id>/report/``) through ``evaluation.report``; its plots also go to the run's
experiment trackers (``tasks.tracking.log_report``). Read-only on the catalog."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from core.workspace import Workspace
from tasks import rounds
from tasks.dag import EVAL_STAGE, STAGE_BY_NAME, STAGES, stage_headline
from tasks.stages.common import EVAL, MODEL

CHECKPOINT_STAGES = tuple(s.name for s in STAGES if s.policy)
"""The stages whose model is a policy checkpoint (``Stage.policy``): each gives it its role."""
ROLE_ORDER = (*CHECKPOINT_STAGES, "external")
OWN_EVALS = {s.name: s.evaluates for s in STAGES if s.evaluates}
"""Evaluation stage -> the stage whose model it scores (``Stage.evaluates``)."""
STEP_STAGES = tuple(s.name for s in STAGES if s.step_metrics)
"""The stages with per-step metrics (``Stage.step_metrics``): their curves are the report's."""
ROUNDS_PLOT = "rounds.png"
"""Held-out accuracy per round (runs with ``rounds`` >= 2: docs/rounds.md)."""


def _is_policy(stage: str) -> bool:
    """A policy checkpoint's stage: the chain's (``CHECKPOINT_STAGES``) or a round's copy (``rl@2``)."""
    parsed = rounds.parse(stage)
    return parsed is not None and parsed[0] in CHECKPOINT_STAGES


def _role_rank(role: str) -> tuple[int, int]:
    """Roles in order: the chain's, then round 2's, round 3's..., then external checkpoints."""
    base, k = rounds.parse(role) or (role, 1)
    return (k, ROLE_ORDER.index(base)) if role != "external" else (1 << 20, 0)


def _own_eval(stage: str) -> str | None:
    """The stage whose model an evaluation stage of the run scores (round copies included)."""
    if stage in OWN_EVALS:
        return OWN_EVALS[stage]
    parsed = rounds.parse(stage)
    return STAGE_BY_NAME[stage].evaluates if parsed is not None and parsed[1] > 1 else None


class ReportError(ValueError):
    pass


def default_run(ws: Workspace) -> str:
    """The latest completed pipeline run (one that has a stage with per-step metrics, RL; ``laminar
    eval`` runs have not)."""
    marks = ", ".join("?" * len(STEP_STAGES))
    rows = ws.catalog.query(
        "SELECT r.run_id FROM runs r WHERE r.status = 'completed' AND EXISTS "
        f"(SELECT 1 FROM stage_runs s WHERE s.run_id = r.run_id AND s.stage IN ({marks})) "
        "ORDER BY r.finished_at DESC LIMIT 1",
        list(STEP_STAGES),
    )
    if not rows:
        raise ReportError(f"no completed `laminar run` in {ws.root}; run the pipeline first or name a run id")
    return rows[0]["run_id"]


def gather(ws: Workspace, run_id: str):
    from evaluation.report import ReportData

    cat = ws.catalog
    run = cat.query("SELECT run_id, status, command FROM runs WHERE run_id = ?", [run_id])
    if not run:
        known = [r["run_id"] for r in cat.query("SELECT run_id FROM runs ORDER BY started_at DESC LIMIT 5")]
        raise ReportError(
            f"no run {run_id!r} in {ws.root}" + (f"; recent runs: {', '.join(known)}" if known else "")
        )
    stages = cat.query(
        "SELECT stage, status, seconds, cache_key, outputs_json, metrics_json FROM stage_runs "
        "WHERE run_id = ? ORDER BY started_at",
        [run_id],
    )
    data = ReportData(run_id=run_id, status=run[0]["status"], command=run[0]["command"] or "")
    roles, own = _roles(cat, stages, data)
    data.evals = _eval_groups(ws, roles, own)
    rl = next((s for s in stages if s["stage"] in STEP_STAGES), None)
    if rl is not None:
        _rl_series(ws, rl, data)
    return data


def _roles(cat: Any, stages: list[dict], data: Any) -> tuple[dict[str, str], set[tuple[str, str]]]:
    """The run's stage rows into ``data.stages``; checkpoint sha -> role, and the (checkpoint, eval
    artifact) pairs this run's eval stages made."""
    roles: dict[str, str] = {}  # checkpoint sha -> role
    own: set[tuple[str, str]] = set()  # (checkpoint, eval artifact) made by this run's eval stages
    outputs = {s["stage"]: json.loads(s["outputs_json"] or "{}") for s in stages}
    for s in stages:
        data.stages.append(
            {
                "stage": s["stage"],
                "status": s["status"],
                "seconds": s["seconds"],
                "cache_key": s["cache_key"],
                "headline": stage_headline(s["stage"], json.loads(s["metrics_json"] or "{}")),
            }
        )
        if _is_policy(s["stage"]) and MODEL in outputs[s["stage"]]:
            # the first stage keeps a checkpoint's role: RFT with nothing to learn passes warm-up's weights on
            roles.setdefault(outputs[s["stage"]][MODEL]["sha256"], s["stage"])
        elif s["stage"] == EVAL_STAGE.name:  # a `laminar eval` run: its checkpoint, under its catalog role
            sha = json.loads(s["metrics_json"] or "{}").get("checkpoint")
            found = cat.query("SELECT stage FROM checkpoints WHERE checkpoint_sha = ?", [sha]) if sha else []
            if found:
                roles[sha] = found[0]["stage"] if _is_policy(found[0]["stage"]) else "external"
                own.add((sha, outputs[EVAL_STAGE.name][EVAL]["sha256"]))
    for stage in outputs:
        role = _own_eval(stage)
        if role is not None and EVAL in outputs[stage] and MODEL in outputs.get(role, {}):
            own.add((outputs[role][MODEL]["sha256"], outputs[stage][EVAL]["sha256"]))
    return roles, own


def _eval_groups(ws: Workspace, roles: dict[str, str], own: set[tuple[str, str]]) -> list:
    """One ``EvalGroup`` per (checkpoint, eval artifact, benchmark) of the run's checkpoints, by role."""
    from evaluation.report import EvalGroup, summarize_eval_rows

    cat = ws.catalog
    if not roles:
        return []
    marks = ", ".join("?" * len(roles))
    has_cert = bool(
        cat.query(
            "SELECT 1 FROM information_schema.columns WHERE table_name = 'eval_results' "
            "AND column_name = 'certificate'"
        )
    )
    rows = cat.query(
        "SELECT e.checkpoint_sha, e.eval_sha, e.benchmark, e.problem_id, e.sample_idx, e.pred, "
        "e.correct, e.error, e.length, e.truncated, e.level, e.subject, "
        f"{'e.certificate' if has_cert else 'NULL'} AS certificate FROM eval_results e "
        f"WHERE e.checkpoint_sha IN ({marks})",
        list(roles),
    )
    arts = {
        r["sha256"]: r
        for r in cat.query("SELECT sha256, created_at, stage, path FROM artifacts WHERE kind = ?", [EVAL])
    }
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["checkpoint_sha"], r["eval_sha"], r["benchmark"])].append(r)
    order = sorted(
        groups,
        key=lambda g: (
            _role_rank(roles[g[0]]),
            g[2],
            str(arts.get(g[1], {}).get("created_at", "")),
        ),
    )
    return [
        EvalGroup(
            roles[c],
            c,
            e,
            b,
            {**summarize_eval_rows(groups[(c, e, b)]), **_from_summary(ws, arts.get(e), b)},
            (c, e) in own,
            (arts.get(e) or {}).get("stage") or EVAL_STAGE.name,
            groups[(c, e, b)][0]["certificate"],
        )
        for c, e, b in order
    ]


def _rl_series(ws: Workspace, rl: dict, data: Any) -> None:
    """The RL stage's per-step metrics and its runtime files into ``data``."""
    cat = ws.catalog
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for m in cat.query(
        "SELECT step, name, value FROM metrics WHERE cache_key = ? AND stage = ? ORDER BY step",
        [rl["cache_key"], rl["stage"]],
    ):
        series[m["name"]].append((int(m["step"]), float(m["value"])))
    data.rl_metrics = dict(series)
    art = json.loads(rl["outputs_json"] or "{}").get(MODEL)
    runtime = Path(ws.artifacts.locate(art).path) / "runtime.json" if art else None
    if runtime is not None and runtime.exists():
        data.runtime = json.loads(runtime.read_text())
        data.runtime["timeline_summary"] = data.runtime.pop("timeline", {})
        data.runtime["timeline"] = json.loads((runtime.parent / "timeline.json").read_text())


def _from_summary(ws: Workspace, art: dict | None, benchmark: str) -> dict:
    """What the catalog's rows do not hold, from the evaluation's own ``summary.json``: the subset
    (``problems_total``), the prompts longer than the model's context (``too_long``, ``context``) and,
    for an evaluation that scored with a learned reward model, its metrics (``reward/reward_model``,
    ``reward_errors/reward_model``, ``rm_best@n``: ``evaluation.report.reward_model_keys``)."""
    from evaluation.report import reward_model_keys

    if not art:
        return {}
    path = Path(ws.artifacts.locate_path(EVAL, art["sha256"], art["path"])) / "summary.json"
    try:
        summary = json.loads(path.read_text()).get(benchmark, {})
    except (OSError, ValueError):
        return {}
    keys = ("problems_total", "too_long", "context", *reward_model_keys(summary))
    return {k: summary[k] for k in keys if k in summary}


def write(ws: Workspace, run_id: str | None = None) -> Path:
    """Write the report of ``run_id`` (default: the latest completed pipeline run; a ``laminar eval``
    run id reports that evaluation); returns report.md."""
    from evaluation.report import write_report

    run_id = run_id or default_run(ws)
    path = write_report(gather(ws, run_id), ws.run_dir(run_id) / "report")
    write_rounds(ws, run_id, path)
    from evaluation.report import PLOTS
    from tasks.tracking import log_report

    log_report(ws, run_id, {name: path.parent / file for name, file in PLOTS.items()})
    return path


# ---- rounds (``rounds`` >= 2) ---------------------------------------------------------------------------


def round_accuracy(ws: Workspace, run_id: str) -> list[tuple[str, int, float]]:
    """(benchmark, round, held-out accuracy) of each round's RL model that the run evaluated (round 0:
    the first policy checkpoint, the warm-up model), from the run's evaluation stages."""
    rows = ws.catalog.query(
        "SELECT stage, metrics_json FROM stage_runs WHERE run_id = ? AND metrics_json IS NOT NULL",
        [run_id],
    )
    first = next(iter(OWN_EVALS))  # the first evaluation in DAG order: the warm-up model's
    last = next(e for e, m in OWN_EVALS.items() if m == rounds.ROUND_MODEL)  # each round's RL model's
    out = []
    for r in rows:
        parsed = rounds.parse(r["stage"])
        if r["stage"] == first:
            k = 0
        elif parsed is not None and parsed[0] == last:
            k = parsed[1]
        else:
            continue
        for bench, v in json.loads(r["metrics_json"]).items():
            if isinstance(v, dict) and v.get("accuracy") is not None:
                out.append((bench, k, float(v["accuracy"])))
    return sorted(out)


def write_rounds(ws: Workspace, run_id: str, report: Path) -> Path | None:
    """For a run of several rounds: ``rounds.png`` (held-out accuracy per round, one line per
    benchmark) beside ``report``, and a table of it at the end of ``report`` (report.md)."""
    points = round_accuracy(ws, run_id)
    if not any(k > 1 for _, k, _ in points):
        (report.parent / ROUNDS_PLOT).unlink(missing_ok=True)
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    benches = sorted({b for b, _, _ in points})
    for bench in benches:
        xs = [(k, a) for b, k, a in points if b == bench]
        ax.plot([k for k, _ in xs], [a for _, a in xs], marker="o", label=bench)
    ks = sorted({k for _, k, _ in points})
    ax.set_xticks(ks, ["warm-up" if k == 0 else f"round {k}" for k in ks])
    ax.set_ylabel("accuracy (RL model of the round)")
    ax.set_title(f"held-out accuracy per round (run {run_id})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = report.parent / ROUNDS_PLOT
    fig.savefig(path, dpi=110)
    plt.close(fig)
    head = ["benchmark", *("warm-up" if k == 0 else f"round {k}" for k in ks)]
    acc = {(b, k): a for b, k, a in points}
    lines = ["", "## Rounds", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bench in benches:
        cells = [f"{acc[(bench, k)]:.3f}" if (bench, k) in acc else "-" for k in ks]
        lines.append("| " + " | ".join([bench, *cells]) + " |")
    lines += ["", f"![held-out accuracy per round]({ROUNDS_PLOT})", ""]
    with open(report, "a") as f:
        f.write("\n".join(lines))
    return path
