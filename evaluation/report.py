"""Tables and plots over evaluation results and RL metrics: the ``laminar eval`` table and the run
report (``report.md`` with PNG plots). Plain records in, files out; the catalog queries that fill
the records live in ``tasks.report``. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from evaluation.metrics import summarize

__all__ = ["EvalGroup", "ReportData", "format_eval_table", "markdown_benchmark_table", "summarize_eval_rows",
           "write_report", "PLOTS"]

PLOTS = {"benchmarks": "benchmark_accuracy.png", "rl": "rl_reward_length.png", "levels": "accuracy_by_level.png",
         "timeline": "rl_timeline.png"}
ROLE_LABELS = {"base_model": "base", "warmup": "warm-up", "rft": "RFT", "rl": "RL", "external": "external"}
_COLORS = {"base": "#9e9e9e", "warm-up": "#4c72b0", "RFT": "#8172b3", "RL": "#dd8452", "external": "#55a868"}


@dataclass(frozen=True)
class EvalGroup:
    """One evaluation (artifact ``eval_sha``) of one checkpoint on one benchmark. ``summary`` is
    :func:`summarize_eval_rows`'s output; ``own`` marks the run's own eval stage (else ``laminar eval``)."""

    role: str
    checkpoint_sha: str
    eval_sha: str
    benchmark: str
    summary: dict
    own: bool
    certificate: str | None = None
    """Decontamination certificate status of the score (``clean``, ``contaminated-removed``,
    ``not-checked``, ``unknown-origin``); None when not recorded. Tables mark all but ``clean``."""


@dataclass
class ReportData:
    """Everything a run report shows. ``rl_metrics`` maps a metric name to (step, value) pairs by step."""

    run_id: str
    status: str
    command: str
    stages: list[dict] = field(default_factory=list)  # stage, status, seconds, headline, cache_key
    evals: list[EvalGroup] = field(default_factory=list)
    rl_metrics: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    runtime: dict | None = None
    """The Laminar runtime's ``runtime.json`` (asynchronous RL modes), with ``timeline`` its timeline."""


def summarize_eval_rows(rows: Sequence[Mapping[str, Any]]) -> dict:
    """Summary of one evaluation of one benchmark from its per-sample rows (as stored in
    ``eval_results``): :func:`evaluation.metrics.summarize` plus ``accuracy`` and ``verifier_errors``."""
    per_problem: dict[str, int] = defaultdict(int)
    for r in rows:
        per_problem[str(r["problem_id"])] += 1
    n = max(per_problem.values())
    out = summarize(rows, n)
    out["accuracy"] = out[f"avg@{n}"]
    out["verifier_errors"] = sum(1 for r in rows if r.get("error"))
    return out


# ---- tables -------------------------------------------------------------------------------------

def _metric_columns(summary: Mapping[str, Any]) -> list[str]:
    n = summary["n_samples"]
    return [f"avg@{n}", *sorted((k for k in summary if k.startswith("pass@")), key=lambda k: int(k[5:])),
            f"maj@{n}"]


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def format_eval_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """The per-benchmark text table ``laminar eval`` prints, with the level/subject breakdowns."""
    lines: list[str] = []
    for bench, s in summaries.items():
        cols = _metric_columns(s)
        head = f"{'benchmark':<14} {'problems':>8} " + " ".join(f"{c:>8}" for c in cols) + \
            f" {'mean len':>9} {'trunc':>6} {'verif err':>9}"
        if not lines or lines[0] != head:
            lines += [head, "-" * len(head)] if not lines else ["", head, "-" * len(head)]
        lines.append(f"{bench:<14} {s['n_problems']:>8} " + " ".join(f"{s[c]:>8.3f}" for c in cols) +
                     f" {s['mean_length']:>9.1f} {s['truncation_rate']:>6.3f} {s.get('verifier_errors', 0):>9}")
    for bench, s in summaries.items():
        for key in ("by_level", "by_subject"):
            if s.get(key):
                avg = f"avg@{s['n_samples']}"
                parts = "  ".join(f"{g} {v[avg]:.3f} (n={v['count']})" for g, v in s[key].items())
                lines.append(f"{bench} {key.replace('_', ' ')}: {parts}")
    return "\n".join(lines)


def _md(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def markdown_benchmark_table(evals: Sequence[EvalGroup]) -> str:
    """One row per (checkpoint, evaluation, benchmark); a score whose decontamination certificate is
    not ``clean`` has it next to the benchmark's name."""
    rows = []
    for e in evals:
        s = e.summary
        pass_k = ", ".join(f"{k} {s[k]:.3f}" for k in _metric_columns(s)[1:-1])
        bench = e.benchmark if e.certificate in (None, "clean") else f"{e.benchmark} ({e.certificate})"
        rows.append([ROLE_LABELS.get(e.role, e.role), e.checkpoint_sha[:12], bench,
                     e.eval_sha[:12] + ("" if e.own else " (laminar eval)"), s["n_problems"], s["n_samples"],
                     s["accuracy"], pass_k, s[f"maj@{s['n_samples']}"], f"{s['mean_length']:.1f}",
                     s["truncation_rate"], s["verifier_errors"]])
    return _md(["checkpoint", "sha", "benchmark", "eval", "problems", "n", "avg@n", "pass@k", "maj@n",
                "mean length", "truncation", "verifier errors"], rows)


def _headline_evals(evals: Sequence[EvalGroup]) -> dict[tuple[str, str], EvalGroup]:
    """(role, benchmark) -> the evaluation to plot: the run's own, else the last one listed."""
    chosen: dict[tuple[str, str], EvalGroup] = {}
    for e in evals:
        key = (e.role, e.benchmark)
        if key not in chosen or not chosen[key].own:
            chosen[key] = e
    return chosen


def _level_rows(evals: Sequence[EvalGroup], by: str = "by_level") -> tuple[list[str], list[str], list[list[Any]]]:
    """Rows (benchmark, level or subject, accuracy per checkpoint role) of the ``by`` breakdown."""
    chosen = _headline_evals(evals)
    roles = [r for r in ROLE_LABELS if any(k[0] == r and chosen[k].summary.get(by) for k in chosen)]
    rows = []
    for bench in sorted({b for _, b in chosen}):
        levels = sorted({lv for r in roles for lv in chosen.get((r, bench), _EMPTY).summary.get(by, {})},
                        key=_level_order)
        for lv in levels:
            row: list[Any] = [bench, lv]
            for r in roles:
                s = chosen.get((r, bench), _EMPTY).summary
                v = s.get(by, {}).get(lv)
                row.append(v[f"avg@{s['n_samples']}"] if v else "")
            rows.append(row)
    return roles, [ROLE_LABELS.get(r, r) for r in roles], rows


_EMPTY = EvalGroup("", "", "", "", {}, False)


def _level_order(level: str) -> tuple:
    digits = "".join(ch for ch in level if ch.isdigit())
    return (int(digits) if digits else 1 << 30, level)


# ---- plots --------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_benchmarks(evals: Sequence[EvalGroup], path: Path) -> None:
    plt = _pyplot()
    chosen = _headline_evals(evals)
    benches = sorted({b for _, b in chosen})
    roles = [r for r in ROLE_LABELS if any(k[0] == r for k in chosen)]
    width = 0.8 / max(1, len(roles))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(benches) + 2), 4))
    for i, role in enumerate(roles):
        xs = [j + (i - (len(roles) - 1) / 2) * width for j in range(len(benches))]
        ys = [chosen[(role, b)].summary["accuracy"] if (role, b) in chosen else 0.0 for b in benches]
        label = ROLE_LABELS.get(role, role)
        bars = ax.bar(xs, ys, width, label=label, color=_COLORS.get(label))
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(benches)), benches)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy (avg@n)")
    ax.set_title("Benchmark accuracy per checkpoint")
    if roles:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rl(rl_metrics: Mapping[str, Sequence[tuple[int, float]]], path: Path) -> None:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    in_run = sorted(n for n in rl_metrics if n.startswith("eval_") and n != "eval_seconds")
    for name, ax in (("reward", ax1), ("accuracy", ax1), *((n, ax1) for n in in_run), ("response_length", ax2)):
        points = rl_metrics.get(name, [])
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points],
                    marker="o" if name in in_run else ("." if len(points) < 40 else None),
                    label=name.replace("eval_", "held-out eval: ").replace("_", " ") if name in in_run
                    else name.replace("_", " "))
    ax1.set_title("RL reward over steps")
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean per trajectory")
    if ax1.lines:
        ax1.legend()
    ax2.set_title("RL response length over steps")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not rl_metrics:
        for ax in (ax1, ax2):
            ax.text(0.5, 0.5, "no RL metrics", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_levels(evals: Sequence[EvalGroup], path: Path) -> None:
    plt = _pyplot()
    roles, labels, rows = _level_rows(evals)
    benches = sorted({r[0] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(benches)), figsize=(max(5, 4.5 * len(benches)), 3.8), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        sub = [r for r in rows if r[0] == bench]
        width = 0.8 / max(1, len(roles))
        for i, label in enumerate(labels):
            xs = [j + (i - (len(roles) - 1) / 2) * width for j in range(len(sub))]
            ax.bar(xs, [r[2 + i] if r[2 + i] != "" else 0.0 for r in sub], width, label=label,
                   color=_COLORS.get(label))
        ax.set_xticks(range(len(sub)), [r[1] for r in sub])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("difficulty level")
        ax.set_ylabel("accuracy (avg@n)")
        ax.set_title(f"{bench}: accuracy per level")
        if labels:
            ax.legend()
    if not benches:
        axes[0][0].text(0.5, 0.5, "no per-level results", ha="center", va="center", transform=axes[0][0].transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the report -----------------------------------------------------------------------------------

def _rl_table(rl_metrics: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    rows = []
    in_run = sorted(n for n in rl_metrics if n.startswith("eval_") and n != "eval_seconds")
    for name in ("reward", "accuracy", "response_length", "truncated", "entropy", *in_run):
        pts = rl_metrics.get(name)
        if pts:
            tail = [v for _, v in pts[-5:]]
            rows.append([name, len(pts), pts[0][1], sum(tail) / len(tail)])
    return _md(["metric", "steps", "first step", "mean of last 5"], rows) if rows else "_no RL metrics recorded_"


def render_markdown(data: ReportData) -> str:
    stage_rows = [[s["stage"], s["status"], f"{float(s['seconds'] or 0):.1f}", s.get("headline", "")]
                  for s in data.stages]
    _, labels, level_rows = _level_rows(data.evals)
    _, subject_labels, subject_rows = _level_rows(data.evals, "by_subject")
    parts = [
        f"# Laminar run {data.run_id}", "",
        f"status: **{data.status}**  ", f"command: `{data.command}`", "",
        "## Stages", "", _md(["stage", "status", "seconds", "metrics"], stage_rows), "",
        "## Benchmark accuracy per checkpoint", "",
        markdown_benchmark_table(data.evals) if data.evals else "_no evaluation results in the catalog_", "",
        f"![benchmark accuracy]({PLOTS['benchmarks']})", "",
        "## RL reward and response length", "", _rl_table(data.rl_metrics), "",
        f"![RL reward and response length]({PLOTS['rl']})", "",
        "## Accuracy per difficulty level, before and after RL", "",
        _md(["benchmark", "level", *labels], level_rows) if level_rows else "_no per-level results_", "",
        f"![accuracy per level]({PLOTS['levels']})", "",
    ]
    if subject_rows:
        parts += ["## Accuracy per subject", "", _md(["benchmark", "subject", *subject_labels], subject_rows), ""]
    if data.runtime:
        rt = data.runtime
        occ = {name: r["mean_occupancy"] for name, r in rt.get("timeline_summary", {}).get("rollouts", {}).items()}
        parts += ["## RL runtime", "",
                  _md(["mode", "updates", "trained tokens/s", "staleness histogram", "repacks", "pulls",
                       "rollout failures", "relay failures", "mean occupancy"],
                      [[rt.get("mode"), rt.get("updates"), f"{rt.get('tokens_per_s', 0):.0f}",
                        rt.get("staleness_histogram"), rt.get("repacks", 0), rt.get("pulls", 0),
                        rt.get("rollout_failures", 0), rt.get("relay_failures", 0),
                        ", ".join(f"{k} {v:.2f}" for k, v in occ.items())]]), ""]
        if rt.get("cpu_seconds"):  # where the loop's CPU went: a CPU-bound loop shows a busy machine
            busy = f", machine {100 * rt['machine_busy']:.0f}% busy" if rt.get("machine_busy") is not None else ""
            parts += [f"CPU seconds per role over the loop ({rt['loop_seconds']:.1f} s on {rt['cores']} cores{busy}): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in rt["cpu_seconds"].items()), ""]
        parts += [f"![rollout timeline]({PLOTS['timeline']})", ""]
    return "\n".join(parts)


def write_report(data: ReportData, out_dir: Path) -> Path:
    """``report.md`` and the PNGs of :data:`PLOTS` into ``out_dir``; returns the markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_benchmarks(data.evals, out_dir / PLOTS["benchmarks"])
    plot_rl(data.rl_metrics, out_dir / PLOTS["rl"])
    plot_levels(data.evals, out_dir / PLOTS["levels"])
    if data.runtime and data.runtime.get("timeline"):
        from evaluation.timeline import plot_timeline

        plot_timeline(data.runtime["timeline"], out_dir / PLOTS["timeline"],
                      title=f"rl.mode={data.runtime.get('mode')}: one row per rollout")
    path = out_dir / "report.md"
    tmp = path.with_name(".report.md.tmp")
    tmp.write_text(render_markdown(data))
    tmp.replace(path)
    return path
