"""The rollout timeline of an asynchronous RL run: one band per rollout showing its occupancy over
time, its weight pulls, repacks, interrupts and restarts, and the trainer's updates across all rows.

A timeline is plain JSON::

    {"rollouts": ["r0", "r1"],
     "samples": [{"t": 0.5, "rollout": "r0", "occupancy": 0.75, "active": 6}, ...],
     "events":  [{"t": 1.2, "rollout": "r0", "kind": "pull", "version": 3}, ...],
     "updates": [{"t": 1.0, "version": 3}, ...],
     "t_end": 12.0}                                    # optional; else the latest time in it

``kind`` is one of ``pull``, ``repack_out``, ``repack_in``, ``interrupt``, ``restart``. Occupancy is
a step function: each sample holds until the rollout's next sample, the last one until the
timeline's end. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Mapping

__all__ = ["EVENT_KINDS", "plot_timeline", "summarize_timeline"]

EVENT_KINDS = ("pull", "repack_out", "repack_in", "interrupt", "restart")
# kind -> (marker, colour, legend label)
_EVENT_STYLE = {
    "pull": ("^", "#2ca02c", "weight pull (version)"),
    "repack_out": ("<", "#ff7f0e", "repack out"),
    "repack_in": (">", "#1f77b4", "repack in"),
    "interrupt": ("D", "#9467bd", "interrupt"),
    "restart": ("x", "#d62728", "restart"),
}
_BAND = 0.66  # height of a rollout's band; rows are 1 apart (the gap holds pull markers and labels)
_MAX_VERSION_LABELS = 80


def _clip01(x: float) -> float:
    return min(1.0, max(0.0, float(x)))


def _normalize(
    timeline: Mapping[str, Any],
) -> tuple[list[str], dict[str, list[dict]], dict[str, list[dict]], list[dict], float, float]:
    """(rollouts in row order, samples by rollout sorted by t, events by rollout sorted by t, updates
    sorted by t, t_start, t_end). Rollouts only mentioned by samples or events are appended."""
    samples = sorted(timeline.get("samples", []), key=lambda s: float(s["t"]))
    events = sorted(timeline.get("events", []), key=lambda e: float(e["t"]))
    updates = sorted(timeline.get("updates", []), key=lambda u: float(u["t"]))
    for e in events:
        if e["kind"] not in EVENT_KINDS:
            raise ValueError(f"unknown timeline event kind {e['kind']!r}; expected one of {EVENT_KINDS}")
    rollouts = list(dict.fromkeys(str(r) for r in timeline.get("rollouts", [])))
    for rec in (*samples, *events):
        name = str(rec["rollout"])
        if name not in rollouts:
            rollouts.append(name)
    by_sample: dict[str, list[dict]] = {r: [] for r in rollouts}
    by_event: dict[str, list[dict]] = {r: [] for r in rollouts}
    for s in samples:
        by_sample[str(s["rollout"])].append(s)
    for e in events:
        by_event[str(e["rollout"])].append(e)
    times = [float(x["t"]) for x in (*samples, *events, *updates)]
    t_start = min(times) if times else 0.0
    t_end = float(timeline["t_end"]) if timeline.get("t_end") is not None else (max(times) if times else 0.0)
    return rollouts, by_sample, by_event, updates, t_start, max(t_end, t_start)


def _time_weighted(samples: list[dict], t_end: float, key: str, fn=float) -> tuple[float, float, float]:
    """(weighted mean of ``fn(sample[key])``, weighted share where it is 0, covered seconds) for a
    step function over ``samples`` (sorted by t) ending at ``t_end``."""
    total = weighted = zero = 0.0
    for i, s in enumerate(samples):
        t0 = float(s["t"])
        t1 = float(samples[i + 1]["t"]) if i + 1 < len(samples) else max(t_end, t0)
        dt = t1 - t0
        v = fn(s.get(key, 0))
        total += dt
        weighted += dt * v
        zero += dt if v <= 0 else 0.0
    if total > 0:
        return weighted / total, zero / total, total
    if samples:  # every sample at the same instant: plain mean
        vals = [fn(s.get(key, 0)) for s in samples]
        return sum(vals) / len(vals), sum(v <= 0 for v in vals) / len(vals), 0.0
    return 0.0, 0.0, 0.0


def summarize_timeline(timeline: Mapping[str, Any]) -> dict:
    """Per-rollout numbers of a timeline::

        {"t_start", "t_end", "duration", "updates": n trainer updates,
         "rollouts": {name: {"mean_occupancy", "idle_share", "mean_active", "observed_seconds",
                             "pulls", "repack_out", "repack_in", "repacks", "interrupts", "restarts"}}}

    ``mean_occupancy`` and ``mean_active`` are time-weighted over the rollout's step function (from
    its first sample to the timeline's end), ``idle_share`` is the share of that time with occupancy
    0, and ``repacks`` = ``repack_out`` + ``repack_in``.
    """
    rollouts, by_sample, by_event, updates, t_start, t_end = _normalize(timeline)
    out: dict[str, dict] = {}
    for r in rollouts:
        mean_occ, idle, covered = _time_weighted(by_sample[r], t_end, "occupancy", _clip01)
        mean_active, _, _ = _time_weighted(by_sample[r], t_end, "active")
        counts = {k: sum(1 for e in by_event[r] if e["kind"] == k) for k in EVENT_KINDS}
        out[r] = {
            "mean_occupancy": mean_occ,
            "idle_share": idle,
            "mean_active": mean_active,
            "observed_seconds": covered,
            "pulls": counts["pull"],
            "repack_out": counts["repack_out"],
            "repack_in": counts["repack_in"],
            "repacks": counts["repack_out"] + counts["repack_in"],
            "interrupts": counts["interrupt"],
            "restarts": counts["restart"],
        }
    return {
        "t_start": t_start,
        "t_end": t_end,
        "duration": t_end - t_start,
        "updates": len(updates),
        "rollouts": out,
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_occupancy(ax, y0: float, samples: list[dict], t_end: float) -> None:
    """A rollout's grey band at ``y0`` and its occupancy as a filled step plot scaled into it."""
    ax.axhspan(y0, y0 + _BAND, color="#f0f0f0", zorder=0, lw=0)
    if not samples:
        return
    ts = [float(s["t"]) for s in samples]
    occ = [_clip01(s.get("occupancy", 0.0)) for s in samples]
    if t_end > ts[-1]:  # the last sample holds until the end
        ts.append(t_end)
        occ.append(occ[-1])
    ys = [y0 + _BAND * o for o in occ]
    ax.fill_between(ts, y0, ys, step="post", color="#4c72b0", alpha=0.55, lw=0, zorder=1)
    ax.step(ts, ys, where="post", color="#2b4f80", lw=0.8, zorder=2)


def _label_versions(ax, pulls: list[dict], y: float, color: str) -> None:
    for e in pulls:
        if e.get("version") is not None:
            ax.annotate(
                f"v{e['version']}",
                (float(e["t"]), y),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=6.5,
                color=color,
                zorder=5,
            )


def _draw_events(ax, y0: float, events: list[dict], label_versions: bool) -> None:
    """A rollout's events as markers in its band at ``y0``, pulls above it (labelled with their
    version when ``label_versions``)."""
    for kind in EVENT_KINDS:
        evs = [e for e in events if e["kind"] == kind]
        if not evs:
            continue
        marker, color, _ = _EVENT_STYLE[kind]
        y = y0 + (_BAND + 0.07 if kind == "pull" else _BAND / 2)
        ax.scatter(
            [float(e["t"]) for e in evs],
            [y] * len(evs),
            marker=marker,
            color=color,
            zorder=4,
            s=46 if kind == "restart" else 30,
            linewidths=1.6 if kind == "restart" else 0.8,
            edgecolors=None if kind == "restart" else "black",
        )
        if kind == "pull" and label_versions:
            _label_versions(ax, evs, y, color)


def _legend(ax) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color="#4c72b0", alpha=0.55, label="occupancy")]
    handles += [
        Line2D(
            [], [], ls="", marker=m, color=c, markeredgecolor=("black" if k != "restart" else c), label=lab
        )
        for k, (m, c, lab) in _EVENT_STYLE.items()
    ]
    handles.append(Line2D([], [], color="#555555", lw=0.6, alpha=0.7, label="trainer update"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def plot_timeline(timeline: Mapping[str, Any], path: Path, title: str = "") -> Path:
    """Draw ``timeline`` to the PNG ``path`` and return it: one horizontal band per rollout (first
    rollout on top) with its occupancy as a filled step plot scaled into the band, weight pulls as
    ``^`` labelled with their version, repack out/in as ``<``/``>``, interrupts as diamonds,
    restarts as red ``x``, and trainer updates as thin vertical lines across all rows."""
    plt = _pyplot()
    rollouts, by_sample, by_event, updates, t_start, t_end = _normalize(timeline)
    n = max(1, len(rollouts))
    span = max(t_end - t_start, 1e-9)
    fig, ax = plt.subplots(figsize=(11, 1.3 + 0.8 * n))
    base = {r: float(n - 1 - i) for i, r in enumerate(rollouts)}
    for r in rollouts:
        _draw_occupancy(ax, base[r], by_sample[r], t_end)
    for u in updates:
        ax.axvline(float(u["t"]), color="#555555", lw=0.6, alpha=0.5, zorder=1.5)
    n_pulls = sum(1 for r in rollouts for e in by_event[r] if e["kind"] == "pull")
    for r in rollouts:
        _draw_events(ax, base[r], by_event[r], label_versions=n_pulls <= _MAX_VERSION_LABELS)
    ax.set_yticks([base[r] + _BAND / 2 for r in rollouts], rollouts)
    ax.set_ylim(-0.15, n - 1 + _BAND + 0.45)
    ax.set_xlim(t_start - 0.01 * span, t_end + 0.01 * span)
    ax.set_xlabel("seconds")
    ax.set_title(title or "Rollout timeline (band height = occupancy)")
    _legend(ax)
    if not rollouts:
        ax.text(0.5, 0.5, "empty timeline", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
