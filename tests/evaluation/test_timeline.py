"""evaluation.timeline: the rollout timeline plot renders, and its summary numbers are time-weighted."""

from __future__ import annotations

import json
import math

import pytest

from evaluation.timeline import plot_timeline, summarize_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _hand_made(t_end: float | None = 10.0) -> dict:
    tl = {
        "rollouts": ["r0", "r1"],
        "samples": [
            # r0: 1.0 for 4 s, 0.5 for 2 s, idle for 2 s, 0.25 for 2 s (until t_end=10)
            {"t": 0.0, "rollout": "r0", "occupancy": 1.0, "active": 4},
            {"t": 4.0, "rollout": "r0", "occupancy": 0.5, "active": 2},
            {"t": 6.0, "rollout": "r0", "occupancy": 0.0, "active": 0},
            {"t": 8.0, "rollout": "r0", "occupancy": 0.25, "active": 1},
            # r1 (listed out of order on purpose): idle from 2 to 5, full from 5 to the end
            {"t": 5.0, "rollout": "r1", "occupancy": 1.0, "active": 8},
            {"t": 2.0, "rollout": "r1", "occupancy": 0.0, "active": 0},
        ],
        "events": [
            {"t": 1.0, "rollout": "r0", "kind": "pull", "version": 1},
            {"t": 5.5, "rollout": "r0", "kind": "repack_out", "version": 1},
            {"t": 7.0, "rollout": "r0", "kind": "pull", "version": 2},
            {"t": 3.0, "rollout": "r1", "kind": "restart", "version": 1},
            {"t": 3.2, "rollout": "r1", "kind": "interrupt", "version": 1},
            {"t": 5.0, "rollout": "r1", "kind": "pull", "version": 2},
            {"t": 5.5, "rollout": "r1", "kind": "repack_in", "version": 1},
        ],
        "updates": [{"t": 0.5, "version": 1}, {"t": 6.5, "version": 2}],
    }
    if t_end is not None:
        tl["t_end"] = t_end
    return tl


def test_summary_hand_computed():
    s = summarize_timeline(_hand_made())
    assert s["t_start"] == 0.0 and s["t_end"] == 10.0 and s["duration"] == 10.0 and s["updates"] == 2
    r0, r1 = s["rollouts"]["r0"], s["rollouts"]["r1"]
    assert math.isclose(r0["mean_occupancy"], (4 * 1.0 + 2 * 0.5 + 2 * 0.0 + 2 * 0.25) / 10)  # 0.55
    assert math.isclose(r0["idle_share"], 0.2)
    assert math.isclose(r0["mean_active"], (4 * 4 + 2 * 2 + 0 + 2 * 1) / 10)
    assert r0["observed_seconds"] == 10.0
    assert (r0["pulls"], r0["repack_out"], r0["repack_in"], r0["repacks"], r0["restarts"]) == (2, 1, 0, 1, 0)
    # r1 is observed from its first sample (t=2) to the end: 3 s idle, 5 s full
    assert math.isclose(r1["mean_occupancy"], 5 / 8) and math.isclose(r1["idle_share"], 3 / 8)
    assert (r1["pulls"], r1["repacks"], r1["restarts"], r1["interrupts"]) == (1, 1, 1, 1)


def test_summary_end_defaults_to_latest_time():
    s = summarize_timeline(_hand_made(t_end=None))  # latest time anywhere: r0's sample at t=8
    assert s["t_end"] == 8.0
    r0 = s["rollouts"]["r0"]
    assert math.isclose(r0["mean_occupancy"], (4 + 1) / 8) and math.isclose(r0["idle_share"], 2 / 8)
    assert math.isclose(s["rollouts"]["r1"]["mean_occupancy"], 3 / 6)


def test_summary_edge_cases():
    tl = {
        "rollouts": ["a"],
        "samples": [{"t": 1.0, "rollout": "b", "occupancy": 0.4, "active": 1}],
        "events": [{"t": 1.0, "rollout": "c", "kind": "pull", "version": 0}],
        "updates": [],
    }
    s = summarize_timeline(tl)
    assert list(s["rollouts"]) == ["a", "b", "c"]  # unlisted rollouts appended in order of appearance
    assert s["rollouts"]["a"]["mean_occupancy"] == 0.0 and s["rollouts"]["a"]["pulls"] == 0
    assert s["rollouts"]["b"]["mean_occupancy"] == pytest.approx(0.4)  # a single instant: its value
    assert s["rollouts"]["c"]["pulls"] == 1
    with pytest.raises(ValueError, match="unknown timeline event kind"):
        summarize_timeline({"events": [{"t": 0, "rollout": "a", "kind": "explode", "version": 0}]})


def test_plot_renders_png(tmp_path):
    tl = json.loads(json.dumps(_hand_made()))  # JSON-able as documented
    out = plot_timeline(tl, tmp_path / "plots" / "timeline.png", title="hand-made")
    assert out == tmp_path / "plots" / "timeline.png"
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def test_plot_larger_and_empty_timelines(tmp_path):
    rollouts = [f"rollout-{i}" for i in range(4)]
    samples, events = [], []
    for i, r in enumerate(rollouts):
        for k in range(120):
            t = k * 0.25 + 0.05 * i
            samples.append({"t": t, "rollout": r, "occupancy": ((k + 7 * i) % 17) / 16, "active": k % 9})
        events += [{"t": 3.0 * v + i * 0.1, "rollout": r, "kind": "pull", "version": v} for v in range(10)]
        events.append(
            {"t": 12.0 + i, "rollout": r, "kind": "repack_out" if i % 2 else "repack_in", "version": 4}
        )
    events.append({"t": 20.0, "rollout": "rollout-2", "kind": "restart", "version": 6})
    tl = {
        "rollouts": rollouts,
        "samples": samples,
        "events": events,
        "updates": [{"t": 3.0 * v - 0.2, "version": v} for v in range(1, 10)],
    }
    big = plot_timeline(tl, tmp_path / "big.png")
    assert big.read_bytes()[:8] == PNG_MAGIC
    empty = plot_timeline(
        {"rollouts": [], "samples": [], "events": [], "updates": []}, tmp_path / "empty.png"
    )
    assert empty.read_bytes()[:8] == PNG_MAGIC
