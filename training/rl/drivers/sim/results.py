"""What one simulated mode measured, and the table ``laminar simulate`` prints."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.rl.drivers.sim.simulator import Simulator


@dataclass
class ModeResult:
    """One mode on one config. Throughputs count trained response tokens; ``steady_tokens_per_s``
    leaves out the first ``warmup_updates`` updates (pipeline fill)."""

    mode: str
    updates: int
    wall_s: float
    trained_tokens: int
    tokens_per_s: float
    steady_tokens_per_s: float
    idle_share: float
    mean_occupancy: float
    staleness_histogram: dict
    repacks: int
    pulls: int
    interrupts: int
    update_times: list
    step_seconds: list
    generation_share: float
    rollouts: int
    trainer_gpus: int
    rollout_gpus: int
    capacity: int
    events: int
    trained_groups: int
    trained_uids: list
    timeline: dict
    stale_dropped: int = 0
    """Groups that outgrew ``max_staleness`` in the buffer and were generated again."""
    dropped_groups: int = 0
    """Groups dynamic sampling dropped (no reward variance)."""
    extra_rounds: int = 0
    """Further sampling rounds batched modes took to fill their batches (dynamic sampling)."""
    empty_batches: int = 0

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("timeline")
        d.pop("trained_uids")
        return d


def steady_tokens_per_s(
    per_update: list[tuple[float, int]], warmup: int, total_tokens: int, wall: float
) -> float:
    """Trained tokens/s after ``warmup`` updates (over the whole run when there are too few)."""
    w = min(warmup, len(per_update) - 1)
    if w > 0:
        times = [t for t, _ in per_update]
        return sum(x for _, x in per_update[w:]) / max(1e-9, times[-1] - times[w - 1])
    return total_tokens / max(wall, 1e-9)


def mode_result(sim: Simulator, gen_time: float) -> ModeResult:
    """What ``sim`` measured, at the end of its run (``gen_time``: seconds some rollout was busy)."""
    wall = sim.clock.now
    rlist = sim.engines.rlist
    for r in rlist:
        sim.engines.account(r)
    tr = sim.trainer
    times = [t for t, _ in tr.per_update]
    n = len(rlist)
    sim.timeline.data["t_end"] = wall
    stats, counts = sim.buffer.stats, sim.m.counts
    return ModeResult(
        mode=sim.mode.name,
        updates=sim.version,
        wall_s=wall,
        trained_tokens=tr.trained_tokens,
        tokens_per_s=tr.trained_tokens / max(wall, 1e-9),
        steady_tokens_per_s=steady_tokens_per_s(
            tr.per_update, sim.cfg.warmup_updates, tr.trained_tokens, wall
        ),
        idle_share=1.0 - sum(r.busy_active_s for r in rlist) / max(1e-9, n * wall),
        mean_occupancy=sum(r.occ_s for r in rlist) / max(1e-9, n * wall),
        staleness_histogram={str(k): v for k, v in sorted(stats.staleness.items())},
        stale_dropped=stats.stale_dropped,
        dropped_groups=stats.filtered,
        extra_rounds=counts["extra_rounds"],
        empty_batches=counts["empty_batches"],
        repacks=counts["repacks"],
        pulls=counts["pulls"],
        interrupts=counts["interrupts"],
        update_times=times,
        step_seconds=[b - a for a, b in zip([0.0] + times[:-1], times)],
        generation_share=gen_time / max(wall, 1e-9),
        rollouts=n,
        trainer_gpus=sim.layout.trainer_gpus,
        rollout_gpus=sim.layout.rollout_gpus,
        capacity=sim.capacity,
        events=sim.events,
        trained_groups=len(sim.m.trained_uids),
        trained_uids=list(sim.m.trained_uids),
        timeline=sim.timeline.data,
    )


def speedups(results: Mapping[str, ModeResult], of: str = "laminar", steady: bool = True) -> dict[str, float]:
    key = "steady_tokens_per_s" if steady else "tokens_per_s"
    base = getattr(results[of], key)
    return {m: base / max(1e-12, getattr(r, key)) for m, r in results.items() if m != of}


def format_table(results: Mapping[str, ModeResult], baseline: str = "sync") -> str:
    base = results.get(baseline) or next(iter(results.values()))
    lines = [
        "| mode | trained tok/s (steady) | vs " + base.mode + " | overall tok/s | step s | idle share | "
        "occupancy | staleness | repacks | gen share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        steps = r.step_seconds[1:] or r.step_seconds
        ratio = r.steady_tokens_per_s / base.steady_tokens_per_s
        lines.append(
            f"| {r.mode} | {r.steady_tokens_per_s:,.0f} | {ratio:.2f}x | "
            f"{r.tokens_per_s:,.0f} | {sum(steps) / max(1, len(steps)):.1f} | {r.idle_share:.2f} | "
            f"{r.mean_occupancy:.2f} | {r.staleness_histogram} | {r.repacks} | {r.generation_share:.2f} |"
        )
    return "\n".join(lines)
