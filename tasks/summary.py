"""The end-of-run table and ``summary.json``: per stage ran/cached, wall time, key metrics."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from conf.schema import Config
from core.workspace import Workspace
from tasks import rounds
from tasks.dag import STAGE_BY_NAME, STAGES, stage_headline, stage_inputs, stage_key, stages_of
from tasks.records import RunSummary, StageOutcome
from tasks.stages.common import EVAL, MODEL

HEADLINE_EVALS = tuple((f"heldout_accuracy_{s.evaluates}", s.name) for s in STAGES if s.evaluates)
"""summary.json's held-out accuracy labels -> the evaluation stage (``Stage.evaluates``) they come from."""
EVALUATED = tuple(s.evaluates for s in STAGES if s.evaluates)
"""The stages whose checkpoints the run evaluates: summary.json's ``checkpoints``."""
HELDOUT_KEY = "arith_heldout"
"""The benchmark whose accuracy the headline metrics are (``evaluation.stages.HELDOUT``)."""


def round_evals(names: Sequence[str]) -> list[tuple[str, str]]:
    """The headline labels of rounds 2.. (``heldout_accuracy_rl@2`` -> ``eval_rl@2``) among the stage
    ``names``, round by round: each round's RL model, as summary.json's metrics and checkpoints."""
    found = [(rounds.parse(n), n) for n in names]
    evals = sorted((p[1], n) for p, n in found if p is not None and p[1] > 1 and STAGE_BY_NAME[n].evaluates)
    return [(f"heldout_accuracy_{STAGE_BY_NAME[n].evaluates}", n) for _, n in evals]


def catalog_metrics(cfg: Config, ws: Workspace, outcomes: Sequence[StageOutcome]) -> dict[str, dict]:
    """Metrics of the headline eval stages a run did not select (``laminar rerun rl`` leaves out
    ``eval_warmup`` and ``eval_rft``) whose cache key under this run's config and artifacts matches a
    finished stage run in the catalog: the same evaluation, known without running it."""
    produced = {o.stage: o.result.artifacts for o in outcomes}
    out: dict[str, dict] = {}
    for _, name in [*HEADLINE_EVALS, *round_evals([s.name for s in stages_of(cfg)])]:
        stage = STAGE_BY_NAME[name]
        inputs = stage_inputs(stage, produced)
        if name in produced or inputs is None or MODEL not in inputs:
            continue
        key = stage_key(stage, cfg, inputs, ws)
        rows = ws.catalog.query(
            "SELECT metrics_json FROM stage_runs WHERE stage = ? AND cache_key = ? "
            "ORDER BY finished_at DESC LIMIT 1",
            [name, key.digest],
        )
        if rows and rows[0]["metrics_json"]:
            out[name] = json.loads(rows[0]["metrics_json"])
    return out


def build_summary(
    run_id: str, outcomes: Sequence[StageOutcome], seconds: float, from_catalog: dict[str, dict] | None = None
) -> RunSummary:
    """``from_catalog``: ``catalog_metrics`` of the headline evals this run did not select; their values
    fill ``metrics`` and their stages are listed in ``metrics_from_catalog``."""
    by = {o.stage: o for o in outcomes}
    from_catalog = from_catalog or {}
    metrics: dict[str, float | None] = {}
    for label, stage in HEADLINE_EVALS:
        m = by[stage].result.metrics if stage in by else from_catalog.get(stage, {})
        metrics[label] = m.get(HELDOUT_KEY, {}).get("accuracy")
    first, last = metrics[HEADLINE_EVALS[0][0]], metrics[HEADLINE_EVALS[-1][0]]
    if first is not None and last is not None:
        metrics["heldout_accuracy_gain"] = last - first
    for s in STAGES:
        if s.summary is not None and s.name in by:
            metrics.update(s.summary(by[s.name].result.metrics))
    later = round_evals([*by, *from_catalog])  # rounds 2..: each round's RL model
    for label, stage in later:
        m = by[stage].result.metrics if stage in by else from_catalog.get(stage, {})
        metrics[label] = m.get(HELDOUT_KEY, {}).get("accuracy")
    evaluated = [*EVALUATED, *(STAGE_BY_NAME[stage].evaluates for _, stage in later)]
    return RunSummary(
        run_id=run_id,
        seconds=seconds,
        warnings=run_warnings(by),
        stages={
            o.stage: {
                "status": o.status,
                "seconds": round(o.seconds, 3),
                "cache_key": o.key.digest,
                "artifacts": {k: v.sha256 for k, v in o.result.artifacts.items()},
                "metrics": o.result.metrics,
            }
            for o in outcomes
        },
        metrics=metrics,
        checkpoints={s: by[s].result.artifacts[MODEL].sha256 for s in evaluated if s in by},
        curation=reconciliation(by),
        certificates=certificates(outcomes),
        metrics_from_catalog=sorted(s for s in from_catalog if s not in by),
    )


def run_warnings(by: Mapping[str, StageOutcome]) -> list[str]:
    """What is clearly broken in a run's outputs, in words (each stage's ``Stage.warnings``: a warm-up
    that learned nothing, an RL reward that collapsed, an RL stage that made its model worse). Cached
    stages count like fresh ones."""
    metrics = {name: o.result.metrics for name, o in by.items()}
    return [w for s in STAGES if s.warnings is not None for w in s.warnings(metrics)]


def certificates(outcomes: Sequence[StageOutcome]) -> dict[str, dict[str, str]]:
    """eval stage -> benchmark -> decontamination certificate status (``tasks.certificate``)."""
    out = {}
    for o in outcomes:
        found = {
            b: v["certificate"]
            for b, v in o.result.metrics.items()
            if isinstance(v, dict) and "certificate" in v
        }
        if found:
            out[o.stage] = found
    return out


def reconciliation(by: Mapping[str, StageOutcome]) -> dict[str, int]:
    """Where the pool's rows went: rows in = ingested + quarantined + duplicates; ingested =
    clean + contaminated; selected is what RL draws from."""
    counting = [s for s in STAGES if s.curation is not None]
    if not counting or not (by[counting[0].name].result.metrics if counting[0].name in by else {}):
        return {}
    out: dict = {}
    for s in counting:  # each stage's counts (``Stage.curation``), in DAG order
        if s.name in by and by[s.name].result.metrics:
            out.update(s.curation(by[s.name].result.metrics))
    return {k: int(v) for k, v in out.items()}


def format_table(summary: RunSummary) -> str:
    lines = [f"{'stage':<12} {'status':<7} {'seconds':>8}  metrics", "-" * 72]
    for name, s in summary.stages.items():
        lines.append(
            f"{name:<12} {s['status']:<7} {s['seconds']:>8.1f}  {stage_headline(name, s['metrics'])}"
        )
    m = summary.metrics
    lines.append("-" * 72)
    if summary.curation:
        lines.append(
            "curation: " + "  ".join(f"{k.replace('_', ' ')} {v}" for k, v in summary.curation.items())
        )
    if summary.certificates:
        lines.append(
            "decontamination certificates: "
            + "  ".join(
                f"{stage} {bench} {status}"
                for stage, certs in summary.certificates.items()
                for bench, status in certs.items()
            )
        )
    known = set(summary.metrics_from_catalog)

    def fmt(label: str, stage: str) -> str:
        v = m.get(label)
        return "n/a" if v is None else f"{v:.3f}" + (" (cached, from the catalog)" if stage in known else "")

    steps = " -> ".join(
        f"{STAGE_BY_NAME[STAGE_BY_NAME[stage].evaluates].title} {fmt(label, stage)}"
        for label, stage in [*HEADLINE_EVALS, *round_evals([*summary.stages, *summary.metrics_from_catalog])]
    )
    lines.append(f"held-out accuracy: {steps}   total {summary.seconds:.1f}s   run {summary.run_id}")
    lines += [f"WARNING: {w}" for w in summary.warnings]
    return "\n".join(lines)


def publish_prefect_artifacts(outcomes: Sequence[StageOutcome]) -> None:
    """The stage table as a Prefect table artifact of the current flow run."""
    from prefect.artifacts import create_table_artifact

    rows = []
    for o in outcomes:
        headline = stage_headline(o.stage, o.result.metrics)
        rows.append(
            {
                "stage": o.stage,
                "status": o.status,
                "seconds": round(o.seconds, 2),
                "cache_key": o.key.digest[:16],
                "metrics": headline,
            }
        )
    create_table_artifact(table=rows, key="laminar-stages", description="Stages of this run: ran or cached")
    publish_eval_markdown(outcomes)


def publish_eval_markdown(outcomes: Sequence[StageOutcome]) -> None:
    """The benchmark table of the run's eval stages (as in ``laminar report``) as a Prefect markdown
    artifact."""
    from prefect.artifacts import create_markdown_artifact

    from evaluation.report import markdown_benchmark_table

    evals = run_evals(outcomes)
    if evals:
        create_markdown_artifact(
            markdown=markdown_benchmark_table(evals),
            key="laminar-benchmarks",
            description="Benchmark accuracy per checkpoint (laminar report has the plots)",
        )


def run_evals(outcomes: Sequence[StageOutcome]) -> list:
    """The run's own eval stages as ``evaluation.report.EvalGroup``s, from each evaluation's
    ``summary.json`` (with the reward model's metrics where it scored) and its certificate status."""
    from evaluation.report import EvalGroup

    evals = []
    for _, stage in HEADLINE_EVALS:
        role = STAGE_BY_NAME[stage].evaluates
        o = next((o for o in outcomes if o.stage == stage), None)
        if o is None or EVAL not in o.result.artifacts:
            continue
        with open(o.result.artifacts[EVAL].file("summary.json")) as f:
            for bench, s in json.load(f).items():
                evals.append(
                    EvalGroup(
                        role,
                        o.result.metrics.get("checkpoint", ""),
                        o.result.artifacts[EVAL].sha256,
                        bench,
                        s,
                        True,
                        origin=stage,
                        certificate=(o.result.metrics.get(bench) or {}).get("certificate"),
                    )
                )
    return evals
