"""Tables and plots over evaluation results and RL metrics: the ``laminar eval`` table and the run
report (``report.md`` with PNG plots). Plain records in, files out; the catalog queries that fill
the records live in ``tasks.report``. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from evaluation.metrics import shaping_metrics, summarize
from rewards.compose import REWARD_MODEL

__all__ = [
    "EvalGroup",
    "ReportData",
    "format_eval_table",
    "markdown_benchmark_table",
    "summarize_eval_rows",
    "write_report",
    "PLOTS",
    "RM_SCORE",
    "plot_reward_model",
    "reward_model_keys",
]

PLOTS = {
    "benchmarks": "benchmark_accuracy.png",
    "rl": "rl_reward_length.png",
    "levels": "accuracy_by_level.png",
    "timeline": "rl_timeline.png",
    "reward_model": "reward_model.png",
}
ROLE_LABELS = {"base_model": "base", "warmup": "warm-up", "rft": "RFT", "rl": "RL", "external": "external"}
_COLORS = {"base": "#9e9e9e", "warm-up": "#4c72b0", "RFT": "#8172b3", "RL": "#dd8452", "external": "#55a868"}
RM_SCORE = f"reward/{REWARD_MODEL}"
"""An evaluation summary's mean learned-reward-model score (``evaluation.evaluate.summarize_rows``)."""
RM_ERRORS = f"reward_errors/{REWARD_MODEL}"
RM_METRICS = ("avg", "maj", "rm_best")
"""What the reward model's pick of the n samples is shown beside: ``<name>@n``."""


def reward_model_keys(summary: Mapping[str, Any]) -> tuple[str, ...]:
    """The learned reward model's metrics in an evaluation summary: its mean score, its fallback count
    and best-of-n reranked by it (``rm_best@n``); none for an evaluation scored without one."""
    if RM_SCORE not in summary:
        return ()
    return (RM_SCORE, RM_ERRORS, f"rm_best@{summary.get('n_samples')}")


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
    origin: str = "eval"
    """The stage that made the evaluation: ``eval`` for ``laminar eval``, else a pipeline eval stage."""
    certificate: str | None = None
    """Decontamination certificate status of the score (``clean``, ``contaminated-removed``,
    ``not-checked``, ``unknown-origin``); None when not recorded. Tables mark all but ``clean``."""

    def tag(self) -> str:
        """How the report marks an evaluation that is not this run's own."""
        if self.own:
            return ""
        return " (laminar eval)" if self.origin == "eval" else f" ({self.origin}, another run)"


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

    @property
    def caption(self) -> str:
        """What every plot carries: the run id and what was asked of it (the command without ``laminar``
        and its workspace)."""
        import shlex

        try:
            words = shlex.split(self.command)
        except ValueError:
            words = self.command.split()
        args, skip = [], False
        for w in words[1:]:
            if skip:
                skip = False
            elif w == "--workspace":
                skip = True
            elif not w.startswith("--workspace="):
                args.append(w)
        text = " ".join(args) or "(no command recorded)"
        if len(args) == 1 and args[0] in ("run", "eval"):
            text += " (default config)"
        return f"run {self.run_id}: laminar {text[:300]}"


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
    out.update(shaping_metrics(rows))
    return out


# ---- tables -------------------------------------------------------------------------------------


def _metric_columns(summary: Mapping[str, Any]) -> list[str]:
    n = summary["n_samples"]
    return [
        f"avg@{n}",
        *sorted((k for k in summary if k.startswith("pass@")), key=lambda k: int(k[5:])),
        f"maj@{n}",
    ]


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def problems_label(s: Mapping[str, Any]) -> str:
    """``1319``, or ``100/1319`` when ``eval.max_problems`` evaluated a seeded subset."""
    n = s.get("n_problems", "?")
    return f"{n}/{s['problems_total']}" if s.get("problems_total") else str(n)


def too_long_label(s: Mapping[str, Any]) -> str:
    """Problems whose prompt is longer than the model's context: ``1031 > 160``; ``-`` when unknown."""
    if s.get("too_long") is None or not s.get("context"):
        return "-"
    return f"{s['too_long']} > {s['context']}"


def coverage_note(s: Mapping[str, Any], short: bool = False) -> str:
    """What a score covers, for every line that prints one: a subset (``100 of 1319 problems``) and
    the problems whose prompt is longer than the model's context. Empty when neither applies."""
    parts = []
    if s.get("problems_total"):
        parts.append(f"{s.get('n_problems')} of {s['problems_total']} problems (eval.max_problems)")
    if s.get("too_long"):
        parts.append(
            f"{s['too_long']} prompt{'s' if s['too_long'] != 1 else ''} longer than the "
            f"{s.get('context')}-token context"
            if not short
            else f"{s['too_long']} too long"
        )
    return f" ({', '.join(parts)})" if parts else ""


def _length(s: Mapping[str, Any], key: str) -> str:
    """A mean length column: ``-`` where there are no such responses (or an older summary)."""
    value = s.get(key)
    return "-" if value is None else f"{value:.1f}"


def format_eval_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """The per-benchmark text table ``laminar eval`` prints, with the level/subject breakdowns. ``problems``
    reads ``100/1319`` for a seeded subset; ``too long`` counts problems whose prompt exceeds the
    model's context (``1031 > 160``)."""
    lines: list[str] = []
    for bench, s in summaries.items():
        cols = _metric_columns(s)
        head = (
            f"{'benchmark':<14} {'problems':>9} "
            + " ".join(f"{c:>8}" for c in cols)
            + f" {'mean len':>9} {'len right':>9} {'len wrong':>9} {'rep-3':>6} {'trunc':>6}"
            + f" {'verif err':>9} {'too long':>10}"
        )
        if not lines or lines[0] != head:
            lines += [head, "-" * len(head)] if not lines else ["", head, "-" * len(head)]
        lines.append(
            f"{bench:<14} {problems_label(s):>9} "
            + " ".join(f"{s[c]:>8.3f}" for c in cols)
            + f" {s['mean_length']:>9.1f} {_length(s, 'mean_length_correct'):>9}"
            + f" {_length(s, 'mean_length_wrong'):>9} {s.get('repeated_ngram_rate', 0.0):>6.3f}"
            + f" {s['truncation_rate']:>6.3f} {s.get('verifier_errors', 0):>9}"
            f" {too_long_label(s):>10}"
        )
    notes = [
        f"{bench}: {s['too_long']} of {s['n_problems']} prompts are longer than the model's "
        f"{s['context']}-token context (positions it was never built or trained for): "
        "its score there says little about the model"
        for bench, s in summaries.items()
        if s.get("too_long")
    ]
    lines += notes
    for bench, s in summaries.items():
        for key in ("by_level", "by_subject"):
            if s.get(key):
                avg = f"avg@{s['n_samples']}"
                parts = "  ".join(f"{g} {v[avg]:.3f} (n={v['count']})" for g, v in s[key].items())
                lines.append(f"{bench} {key.replace('_', ' ')}: {parts}")
        terms = {k.removeprefix("reward/"): v for k, v in s.items() if k.startswith("reward/")}
        if terms:  # the benchmark's score_with components beside the verdict
            parts = "  ".join(
                f"{name} {value:.3f}"
                + (f" ({s[f'reward_errors/{name}']} fallbacks)" if s.get(f"reward_errors/{name}") else "")
                for name, value in terms.items()
            )
            lines.append(f"{bench} reward terms (mean): {parts}")
        n = s.get("n_samples")
        if f"rm_best@{n}" in s:  # the learned reward model's pick of the n samples
            lines.append(
                f"{bench} best of {n} reranked by the reward model {s[f'rm_best@{n}']:.3f}  "
                f"(maj@{n} {s[f'maj@{n}']:.3f}, avg@{n} {s[f'avg@{n}']:.3f})"
            )
    return "\n".join(lines)


def _md(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def markdown_benchmark_table(evals: Sequence[EvalGroup]) -> str:
    """One row per (checkpoint, evaluation, benchmark); a score whose decontamination certificate is
    not ``clean`` has it next to the benchmark's name. When an evaluation scored with a learned reward
    model, two more columns: its mean score and best-of-n reranked by it (``-`` for the others)."""
    rows = []
    with_rm = any(RM_SCORE in e.summary for e in evals)
    for e in evals:
        s = e.summary
        pass_k = ", ".join(f"{k} {s[k]:.3f}" for k in _metric_columns(s)[1:-1])
        bench = e.benchmark if e.certificate in (None, "clean") else f"{e.benchmark} ({e.certificate})"
        rows.append(
            [
                ROLE_LABELS.get(e.role, e.role),
                e.checkpoint_sha[:12],
                bench,
                e.eval_sha[:12] + e.tag(),
                problems_label(s),
                s["n_samples"],
                s["accuracy"],
                pass_k,
                s[f"maj@{s['n_samples']}"],
                f"{s['mean_length']:.1f}",
                s["truncation_rate"],
                s["verifier_errors"],
                too_long_label(s),
                *(_rm_cells(s) if with_rm else ()),
            ]
        )
    return _md(
        [
            "checkpoint",
            "sha",
            "benchmark",
            "eval",
            "problems",
            "n",
            "avg@n",
            "pass@k",
            "maj@n",
            "mean length",
            "truncation",
            "verifier errors",
            "prompts > context",
            *(("RM score", "rm_best@n") if with_rm else ()),
        ],
        rows,
    )


def _rm_cells(s: Mapping[str, Any]) -> tuple[Any, Any]:
    """The mean reward-model score and ``rm_best@n`` of one summary; ``-`` for one scored without."""
    if RM_SCORE not in s:
        return "-", "-"
    return s[RM_SCORE], s.get(f"rm_best@{s['n_samples']}", "-")


def _headline_evals(evals: Sequence[EvalGroup]) -> dict[tuple[str, str], EvalGroup]:
    """(role, benchmark) -> the evaluation to plot: the run's own, else the last one listed."""
    chosen: dict[tuple[str, str], EvalGroup] = {}
    for e in evals:
        key = (e.role, e.benchmark)
        if key not in chosen or not chosen[key].own:
            chosen[key] = e
    return chosen


def _level_rows(
    evals: Sequence[EvalGroup], by: str = "by_level"
) -> tuple[list[str], list[str], list[list[Any]]]:
    """Rows (benchmark, level or subject, accuracy per checkpoint role) of the ``by`` breakdown."""
    chosen = _headline_evals(evals)
    roles = [r for r in ROLE_LABELS if any(k[0] == r and chosen[k].summary.get(by) for k in chosen)]
    rows = []
    for bench in sorted({b for _, b in chosen}):
        levels = sorted(
            {lv for r in roles for lv in chosen.get((r, bench), _EMPTY).summary.get(by, {})}, key=_level_order
        )
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


def _caption(fig, caption: str | None) -> int:
    """The run id and its overrides at the foot of every plot, wrapped to the figure's width; returns
    the number of lines (``_finish`` keeps room for them)."""
    if not caption:
        return 0
    import textwrap

    text = textwrap.fill(caption, width=max(40, int(fig.get_figwidth() * 15)))
    fig.text(0.01, 0.01, text, fontsize=7, color="#555555", ha="left", va="bottom")
    return text.count("\n") + 1


def _finish(fig, path: Path, caption: str | None) -> None:
    lines = _caption(fig, caption)
    fig.tight_layout(rect=(0, (0.035 * lines + 0.01) * 4.2 / fig.get_figheight() if lines else 0, 1, 1))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _grouped_bars(ax, groups: Sequence[str], labels: Sequence[str], value) -> dict[tuple[str, str], float]:
    """One bar per (group, label) whose ``value(group_index, label_index)`` is known (not None); a
    missing one is drawn as no bar with a small "not evaluated" mark, never as a zero bar. Returns
    the bars drawn, (group, label) -> height."""
    drawn: dict[tuple[str, str], float] = {}
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs_all = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(groups))]
        known = [(x, value(j, i)) for j, x in enumerate(xs_all) if value(j, i) is not None]
        bars = ax.bar(
            [x for x, _ in known], [v for _, v in known], width, label=label, color=_COLORS.get(label)
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        for j, x in enumerate(xs_all):
            if value(j, i) is None:
                ax.text(
                    x,
                    0.01,
                    "not evaluated",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#777777",
                )
            else:
                drawn[(groups[j], label)] = value(j, i)
    return drawn


def plot_benchmarks(
    evals: Sequence[EvalGroup], path: Path, caption: str | None = None
) -> dict[tuple[str, str], float]:
    """Accuracy per benchmark and checkpoint; a checkpoint never evaluated on a benchmark has no bar.
    Returns the bars drawn, (benchmark, checkpoint label) -> accuracy."""
    plt = _pyplot()
    chosen = _headline_evals(evals)
    benches = sorted({b for _, b in chosen})
    roles = [r for r in ROLE_LABELS if any(k[0] == r for k in chosen)]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(benches) + 2), 4.2))
    drawn = _grouped_bars(
        ax,
        benches,
        [ROLE_LABELS.get(r, r) for r in roles],
        lambda j, i: (
            chosen[(roles[i], benches[j])].summary["accuracy"] if (roles[i], benches[j]) in chosen else None
        ),
    )
    ax.set_xticks(
        range(len(benches)), [f"{b}\n{problems_label(_first(chosen, b).summary)} problems" for b in benches]
    )
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy (avg@n)")
    ax.set_title("Benchmark accuracy per checkpoint")
    if roles:
        ax.legend(fontsize=8)
    if not benches:
        ax.text(0.5, 0.5, "no evaluations", ha="center", va="center", transform=ax.transAxes)
    _finish(fig, path, caption)
    return drawn


def _first(chosen: Mapping[tuple[str, str], EvalGroup], bench: str) -> EvalGroup:
    return next(e for (_, b), e in chosen.items() if b == bench)


def _same_series(a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]]) -> bool:
    return len(a) == len(b) and all(sa == sb and abs(va - vb) < 1e-9 for (sa, va), (sb, vb) in zip(a, b))


def _rl_lines(rl_metrics: Mapping[str, Sequence[tuple[int, float]]]) -> list[tuple[str, str, dict]]:
    """(metric, label, line style) of each line ``plot_rl`` may draw on its left axes, in order."""
    in_run = sorted(n for n in rl_metrics if n.startswith("eval_") and n != "eval_seconds")
    reward, accuracy = rl_metrics.get("reward", []), rl_metrics.get("accuracy", [])
    lines = []
    if reward and _same_series(reward, accuracy):
        lines.append(("reward", "reward = training accuracy (no shaping)", {}))
    else:
        lines += [("reward", "reward", {}), ("accuracy", "training accuracy", {"linestyle": "--"})]
    return lines + [
        (n, n.replace("eval_", "held-out eval (in run): "), {"marker": "o", "linestyle": ":"}) for n in in_run
    ]


def _plot_final_eval(ax, step: int, final_eval: Mapping[str, float] | None) -> None:
    for bench, acc in (final_eval or {}).items():
        if acc is not None:
            ax.plot(
                [step],
                [acc],
                marker="*",
                markersize=13,
                linestyle="none",
                label=f"final held-out eval (eval_rl): {bench} {acc:.3f}",
            )


def _label_rl_axes(ax1, ax2, empty: bool) -> None:
    """Titles, axis labels, integer steps and legends under the axes (a note on both when ``empty``)."""
    from matplotlib.ticker import MaxNLocator

    ax1.set_title("RL reward and held-out accuracy over steps")
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean per trajectory / accuracy")
    ax2.set_title("RL response length over steps")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.lines:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7, ncol=2, frameon=False)
    if empty:
        for ax in (ax1, ax2):
            ax.text(0.5, 0.5, "no RL metrics", ha="center", va="center", transform=ax.transAxes)


def plot_rl(
    rl_metrics: Mapping[str, Sequence[tuple[int, float]]],
    path: Path,
    caption: str | None = None,
    final_eval: Mapping[str, float] | None = None,
) -> list[str]:
    """Reward, training accuracy and in-run held-out evaluations over RL steps (left), response length
    (right). A reward that is exactly the accuracy (no shaping) is one line named so, not two lines
    drawn on top of each other; ``final_eval`` (benchmark -> accuracy of the RL checkpoint's eval
    stage) is a star after the last step. Legends sit under the axes, off the data. Returns the labels
    of the lines drawn on the left axes."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    for name, label, style in _rl_lines(rl_metrics):
        points = rl_metrics.get(name, [])
        if points:
            style = {"marker": "." if len(points) < 40 else None, **style}
            ax1.plot([s for s, _ in points], [v for _, v in points], label=label, **style)
    _plot_final_eval(ax1, max((s for pts in rl_metrics.values() for s, _ in pts), default=0), final_eval)
    length = rl_metrics.get("response_length", [])
    if length:
        ax2.plot(
            [s for s, _ in length],
            [v for _, v in length],
            marker="." if len(length) < 40 else None,
            label="mean response length",
        )
    _label_rl_axes(ax1, ax2, empty=not rl_metrics)
    labels = [line.get_label() for line in ax1.lines]
    _finish(fig, path, caption)
    return labels


def plot_levels(
    evals: Sequence[EvalGroup], path: Path, caption: str | None = None
) -> dict[tuple[str, str], float]:
    """Accuracy per difficulty level and checkpoint; a level a checkpoint was not evaluated on has no bar.
    Returns the bars drawn, ("<benchmark> <level>", checkpoint label) -> accuracy."""
    plt = _pyplot()
    roles, labels, rows = _level_rows(evals)
    benches = sorted({r[0] for r in rows})
    fig, axes = plt.subplots(
        1, max(1, len(benches)), figsize=(max(5, 4.5 * len(benches)), 4.0), squeeze=False
    )
    drawn: dict[tuple[str, str], float] = {}
    for ax, bench in zip(axes[0], benches):
        sub = [r for r in rows if r[0] == bench]
        bars = _grouped_bars(
            ax,
            [r[1] for r in sub],
            labels,
            lambda j, i, sub=sub: sub[j][2 + i] if sub[j][2 + i] != "" else None,
        )
        drawn.update({(f"{bench} {lv}", label): v for (lv, label), v in bars.items()})
        ax.set_xticks(range(len(sub)), [r[1] for r in sub])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("difficulty level")
        ax.set_ylabel("accuracy (avg@n)")
        ax.set_title(f"{bench}: accuracy per level")
        if labels:
            ax.legend(fontsize=8)
    if not benches:
        axes[0][0].text(
            0.5, 0.5, "no per-level results", ha="center", va="center", transform=axes[0][0].transAxes
        )
    _finish(fig, path, caption)
    return drawn


def _rm_evals(evals: Sequence[EvalGroup]) -> dict[tuple[str, str], EvalGroup]:
    """The headline evaluations (``_headline_evals``) that scored with a learned reward model."""
    return {k: e for k, e in _headline_evals(evals).items() if RM_SCORE in e.summary}


def plot_reward_model(
    evals: Sequence[EvalGroup], path: Path, caption: str | None = None
) -> dict[str, dict[tuple[str, str], float]]:
    """The learned reward model as a metric, per checkpoint: its mean score per benchmark (left) and
    best-of-n reranked by it beside avg@n and maj@n (right); only evaluations scored with a reward
    model. Returns the bars drawn: ``score`` (benchmark, checkpoint label) -> mean score and ``best``
    ("<benchmark> <checkpoint label>", "<metric>@n") -> accuracy."""
    plt = _pyplot()
    chosen = _rm_evals(evals)
    benches = sorted({b for _, b in chosen})
    roles = [r for r in ROLE_LABELS if any(k[0] == r for k in chosen)]
    labels = [ROLE_LABELS.get(r, r) for r in roles]
    pairs = [(r, b) for b in benches for r in roles if (r, b) in chosen]
    fig, (ax1, ax2) = plt.subplots(
        1, 2, figsize=(max(11, 1.6 * len(benches) + 1.2 * len(pairs) + 4), 4.4), squeeze=True
    )
    score = _grouped_bars(
        ax1,
        benches,
        labels,
        lambda j, i: (
            chosen[(roles[i], benches[j])].summary[RM_SCORE] if (roles[i], benches[j]) in chosen else None
        ),
    )
    ax1.axhline(0.0, color="#777777", linewidth=0.6)
    ax1.set_xticks(range(len(benches)), benches)
    ax1.set_ylabel("mean reward-model score per sample")
    ax1.set_title("Reward-model score per checkpoint")
    names = [f"{m}@n" for m in RM_METRICS]
    best = _grouped_bars(
        ax2,
        [f"{b} {ROLE_LABELS.get(r, r)}" for r, b in pairs],
        names,
        lambda j, i: chosen[pairs[j]].summary.get(f"{RM_METRICS[i]}@{chosen[pairs[j]].summary['n_samples']}"),
    )
    ax2.set_xticks(range(len(pairs)), [f"{b}\n{ROLE_LABELS.get(r, r)}" for r, b in pairs])
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("accuracy")
    ax2.set_title("Best of n reranked by the reward model (rm_best@n)")
    for ax in (ax1, ax2):
        if ax.containers:
            ax.legend(fontsize=8)
    _finish(fig, path, caption)
    return {"score": score, "best": best}


# ---- the report -----------------------------------------------------------------------------------


def _rl_table(rl_metrics: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    rows = []
    in_run = sorted(n for n in rl_metrics if n.startswith("eval_") and n != "eval_seconds")
    for name in ("reward", "accuracy", "response_length", "truncated", "entropy", *in_run):
        pts = rl_metrics.get(name)
        if pts:
            tail = [v for _, v in pts[-5:]]
            rows.append([name, len(pts), pts[0][1], sum(tail) / len(tail)])
    return (
        _md(["metric", "steps", "first step", "mean of last 5"], rows) if rows else "_no RL metrics recorded_"
    )


def _rm_section(evals: Sequence[EvalGroup]) -> list[str]:
    """The report's reward-model section; none when no evaluation scored with a reward model."""
    chosen = _rm_evals(evals)
    if not chosen:
        return []
    rows = []
    for role, bench in sorted(chosen, key=lambda k: (list(ROLE_LABELS).index(k[0]), k[1])):
        e = chosen[(role, bench)]
        s, n = e.summary, e.summary["n_samples"]
        metrics = [s.get(f"{m}@{n}", "-") for m in RM_METRICS]
        rows.append([ROLE_LABELS[role], bench + e.tag(), n, s[RM_SCORE], *metrics, s.get(RM_ERRORS, 0)])
    headers = ["checkpoint", "benchmark", "n", "mean RM score", "avg@n", "maj@n", "rm_best@n", "RM fallbacks"]
    return [
        "## Learned reward model per checkpoint",
        "",
        _md(headers, rows),
        "",
        f"![reward model per checkpoint]({PLOTS['reward_model']})",
        "",
    ]


def _stages_table(stages: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        [s["stage"], s["status"], f"{float(s['seconds'] or 0):.1f}", s.get("headline", "")] for s in stages
    ]
    return _md(["stage", "status", "seconds", "metrics"], rows)


def _subject_section(evals: Sequence[EvalGroup]) -> list[str]:
    """The report's per-subject section; none when no evaluation has subjects."""
    _, labels, rows = _level_rows(evals, "by_subject")
    if not rows:
        return []
    return ["## Accuracy per subject", "", _md(["benchmark", "subject", *labels], rows), ""]


_RUNTIME_HEADERS = [
    "mode",
    "updates",
    "trained tokens/s",
    "staleness histogram",
    "repacks",
    "pulls",
    "rollout failures",
    "relay failures",
    "mean occupancy",
]


def _runtime_table(rt: Mapping[str, Any]) -> str:
    occ = {
        name: r["mean_occupancy"] for name, r in rt.get("timeline_summary", {}).get("rollouts", {}).items()
    }
    row = [
        rt.get("mode"),
        rt.get("updates"),
        f"{rt.get('tokens_per_s', 0):.0f}",
        rt.get("staleness_histogram"),
        rt.get("repacks", 0),
        rt.get("pulls", 0),
        rt.get("rollout_failures", 0),
        rt.get("relay_failures", 0),
        ", ".join(f"{k} {v:.2f}" for k, v in occ.items()),
    ]
    return _md(_RUNTIME_HEADERS, [row])


def _cpu_line(rt: Mapping[str, Any]) -> str:
    """Where the loop's CPU went, per role: a CPU-bound loop shows a busy machine."""
    busy = f", machine {100 * rt['machine_busy']:.0f}% busy" if rt.get("machine_busy") is not None else ""
    return (
        "CPU seconds per role over the loop "
        f"({rt['loop_seconds']:.1f} s on {rt['cores']} cores{busy}): "
        + ", ".join(f"{k} {v:.1f}" for k, v in rt["cpu_seconds"].items())
    )


def _runtime_section(rt: Mapping[str, Any]) -> list[str]:
    """The report's RL runtime section: the loop's counters, its CPU per role, the rollout timeline."""
    parts = ["## RL runtime", "", _runtime_table(rt), ""]
    if rt.get("cpu_seconds"):
        parts += [_cpu_line(rt), ""]
    return parts + [f"![rollout timeline]({PLOTS['timeline']})", ""]


def render_markdown(data: ReportData) -> str:
    """``report.md``: the run's stages, accuracy per checkpoint, reward model, RL metrics, accuracy
    per level and subject, and the RL runtime when the run recorded one."""
    _, labels, level_rows = _level_rows(data.evals)
    parts = [
        f"# Laminar run {data.run_id}",
        "",
        f"status: **{data.status}**  ",
        f"command: `{data.command}`",
        "",
        "## Stages",
        "",
        _stages_table(data.stages),
        "",
        "## Benchmark accuracy per checkpoint",
        "",
        markdown_benchmark_table(data.evals) if data.evals else "_no evaluation results in the catalog_",
        "",
        f"![benchmark accuracy]({PLOTS['benchmarks']})",
        "",
        *_rm_section(data.evals),
        "## RL reward and response length",
        "",
        _rl_table(data.rl_metrics),
        "",
        f"![RL reward and response length]({PLOTS['rl']})",
        "",
        "## Accuracy per difficulty level, before and after RL",
        "",
        _md(["benchmark", "level", *labels], level_rows) if level_rows else "_no per-level results_",
        "",
        f"![accuracy per level]({PLOTS['levels']})",
        "",
        *_subject_section(data.evals),
    ]
    if data.runtime:
        parts += _runtime_section(data.runtime)
    return "\n".join(parts)


def write_report(data: ReportData, out_dir: Path) -> Path:
    """``report.md`` and the PNGs of :data:`PLOTS` into ``out_dir``; returns the markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    caption = data.caption
    plot_benchmarks(data.evals, out_dir / PLOTS["benchmarks"], caption)
    final = {e.benchmark: e.summary["accuracy"] for e in data.evals if e.role == "rl" and e.own}
    plot_rl(data.rl_metrics, out_dir / PLOTS["rl"], caption, final)
    plot_levels(data.evals, out_dir / PLOTS["levels"], caption)
    rm_plot = out_dir / PLOTS["reward_model"]
    if _rm_evals(data.evals):
        plot_reward_model(data.evals, rm_plot, caption)
    else:  # no reward model, no panel (nor one left from an earlier report of the run)
        rm_plot.unlink(missing_ok=True)
    if data.runtime and data.runtime.get("timeline"):
        from evaluation.timeline import plot_timeline

        plot_timeline(
            data.runtime["timeline"],
            out_dir / PLOTS["timeline"],
            title=f"rl.mode={data.runtime.get('mode')}: one row per rollout ({caption})",
        )
    path = out_dir / "report.md"
    tmp = path.with_name(".report.md.tmp")
    tmp.write_text(render_markdown(data))
    tmp.replace(path)
    return path
