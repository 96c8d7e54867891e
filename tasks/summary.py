"""The end-of-run table and ``summary.json``: per stage ran/cached, wall time, key metrics."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from conf.schema import Config
from core.workspace import Workspace
from tasks.dag import STAGE_BY_NAME, stage_headline, stage_inputs, stage_key
from tasks.records import RunSummary, StageOutcome


HEADLINE_EVALS = (
    ("heldout_accuracy_warmup", "eval_warmup"),
    ("heldout_accuracy_rft", "eval_rft"),
    ("heldout_accuracy_rl", "eval_rl"),
)


def catalog_metrics(cfg: Config, ws: Workspace, outcomes: Sequence[StageOutcome]) -> dict[str, dict]:
    """Metrics of the headline eval stages a run did not select (``laminar rerun rl`` leaves out
    ``eval_warmup`` and ``eval_rft``) whose cache key under this run's config and artifacts matches a
    finished stage run in the catalog: the same evaluation, known without running it."""
    produced = {o.stage: o.result.artifacts for o in outcomes}
    out: dict[str, dict] = {}
    for _, name in HEADLINE_EVALS:
        stage = STAGE_BY_NAME[name]
        inputs = stage_inputs(stage, produced)
        if name in produced or inputs is None:
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
        metrics[label] = m.get("arith_heldout", {}).get("accuracy")
    if metrics["heldout_accuracy_warmup"] is not None and metrics["heldout_accuracy_rl"] is not None:
        metrics["heldout_accuracy_gain"] = metrics["heldout_accuracy_rl"] - metrics["heldout_accuracy_warmup"]
    if "reward_model" in by:
        metrics.update(reward_model_metrics(by["reward_model"].result.metrics))
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
        checkpoints={s: by[s].result.artifacts["model"].sha256 for s in ("warmup", "rft", "rl") if s in by},
        curation=reconciliation(by),
        certificates=certificates(outcomes),
        metrics_from_catalog=sorted(s for s in from_catalog if s not in by),
    )


REWARD_MODEL_METRICS = (
    ("reward_model_heldout_accuracy", "rm_heldout_accuracy"),
    ("reward_model_baseline_random_accuracy", "baseline_random_accuracy"),
    ("reward_model_baseline_longer_wins_accuracy", "baseline_longer_wins_accuracy"),
    ("reward_model_baseline_shorter_wins_accuracy", "baseline_shorter_wins_accuracy"),
    ("reward_model_baseline_policy_logprob_accuracy", "baseline_policy_logprob_accuracy"),
    ("reward_model_agreement_ceiling", "agreement_ceiling"),
)
"""summary.json's reward-model keys -> the reward_model stage's metric of the same meaning."""


def reward_model_metrics(m: dict) -> dict[str, float | None]:
    """The reward model's held-out pairwise accuracy, its baselines and the annotators' ceiling."""
    return {label: m.get(key) for label, key in REWARD_MODEL_METRICS}


WARMUP_FLOOR = 0.05
"""A warm-up evaluation below this (avg@n) means the warm-up model solves almost nothing."""
COLLAPSE = 0.5
"""RL reward collapsed: the last 5 steps' mean reward below this share of its best 5-step mean."""
RL_DROP = 0.02
"""RL ended below where it started: held-out accuracy after RL more than this under RFT's (about
1.5 standard errors of avg@4 on the 300 synthetic held-out problems)."""


def run_warnings(by: Mapping[str, StageOutcome]) -> list[str]:
    """What is clearly broken in a run's outputs, in words: a warm-up that learned nothing, an RL
    reward that collapsed, an RL stage that made its model worse. Cached stages count like fresh ones."""
    out: list[str] = []
    m = lambda stage: by[stage].result.metrics if stage in by else {}  # noqa: E731
    for bench, s in sorted(m("eval_warmup").items()):
        if isinstance(s, dict) and s.get("accuracy") is not None and s["accuracy"] < WARMUP_FLOOR:
            out.append(
                f"warm-up accuracy {s['accuracy']:.3f} on {bench}: the warm-up model solves almost nothing, "
                "so DART, RFT and RL have little to start from (more sft.steps, or another sft.lr)"
            )
    rl = m("rl")
    peak, last = rl.get("reward_peak5"), rl.get("reward_last5")
    if peak is not None and last is not None and peak > 0.1 and last < COLLAPSE * peak:
        out.append(
            f"RL reward collapsed: last 5 steps {last:.3f} against a best of {peak:.3f} "
            "(lower rl.lr, or check the objective's clip and KL settings)"
        )
    before, after = m("eval_rft"), m("eval_rl")
    for bench in sorted(set(before) & set(after)):
        b, a = before[bench], after[bench]
        if (
            isinstance(b, dict)
            and isinstance(a, dict)
            and None not in (b.get("accuracy"), a.get("accuracy"))
            and a["accuracy"] < b["accuracy"] - RL_DROP
        ):
            out.append(
                f"RL ended below where it started on {bench}: {a['accuracy']:.3f} after RL against "
                f"{b['accuracy']:.3f} after RFT"
            )
    return out


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
    m = lambda stage: by[stage].result.metrics if stage in by else {}  # noqa: E731
    ing, dec, sel = m("ingest"), m("decontaminate"), m("select")
    if not ing:
        return {}
    out = {
        "rows_in": ing["rows_in"],
        "ingested": ing["ingested"],
        "quarantined": ing["quarantined"],
        "duplicates": ing["duplicates_exact"] + ing["duplicates_near"],
    }
    if ing.get("unverifiable"):  # of the quarantined; per kind in the ingest stage's metrics
        out["unverifiable"] = ing["unverifiable"]
    if dec:
        out["contaminated"] = dec["contaminated"]
    if sel:
        out["selected"] = sel["selected"]
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

    lines.append(
        f"held-out accuracy: warm-up {fmt('heldout_accuracy_warmup', 'eval_warmup')} -> "
        f"RFT {fmt('heldout_accuracy_rft', 'eval_rft')} -> RL {fmt('heldout_accuracy_rl', 'eval_rl')}   "
        f"total {summary.seconds:.1f}s   run {summary.run_id}"
    )
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
    for stage, role in (("eval_warmup", "warmup"), ("eval_rft", "rft"), ("eval_rl", "rl")):
        o = next((o for o in outcomes if o.stage == stage), None)
        if o is None or "eval" not in o.result.artifacts:
            continue
        with open(o.result.artifacts["eval"].file("summary.json")) as f:
            for bench, s in json.load(f).items():
                evals.append(
                    EvalGroup(
                        role,
                        o.result.metrics.get("checkpoint", ""),
                        o.result.artifacts["eval"].sha256,
                        bench,
                        s,
                        True,
                        origin=stage,
                        certificate=(o.result.metrics.get(bench) or {}).get("certificate"),
                    )
                )
    return evals
