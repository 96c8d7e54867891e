"""Laminar's repack, the rollout manager's side: which long-tail rollouts hand their work to which,
and the hand-over when it comes back.

A repack moves the responses still decoding on a nearly idle rollout to another of the same version
with room (``control.plan_repack`` decides the moves), so a few long responses do not pin a whole
rollout. The source is told by an ``ExtractOrder`` (``RolloutState.extract_to``); its partials ride
the receiver's next call. ``Repacker`` is a component of ``training.rl.manager.RolloutManager``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from generation.records import Partial
from training.rl import control
from training.rl.control import RolloutView
from training.rl.rollout_state import RolloutState


class Repacker:
    """Shares the manager's settings, rollout records, counts and ``outside``; ``requeue`` puts lost
    requests back in line (``RolloutManager.requeue``)."""

    def __init__(
        self, settings, rollouts: dict[str, RolloutState], counts: Counter, outside, requeue: Callable
    ):
        self.s = settings
        self.rollouts, self.counts, self.outside, self.requeue = rollouts, counts, outside, requeue

    def plan(self, window) -> None:
        """Start the repacks ``control.plan_repack`` picks (each counted, in ``window.repacks`` too,
        and its source poked to hand its work over)."""
        views = [
            RolloutView(
                r.name,
                r.version,
                r.queued + len(r.pending_inject),
                r.active,
                r.prev_active,
                self.s.capacity,
                alive=r.alive and r.extract_to is None,
                pulling=r.pulling,
            )
            for r in self.rollouts.values()
        ]
        for m in control.plan_repack(views, self.s.repack_b or self.s.capacity):
            src, dst = self.rollouts[m.src], self.rollouts[m.dst]
            if src.extract_to is None and dst.extract_to is None:
                src.extract_to = m.dst
                dst.awaiting += 1
                self.counts["repacks"] += 1
                window.repacks += 1
                self.outside.poke(src.name)

    def handed_over(self, r: RolloutState, partials: list[Partial], version: int) -> RolloutState | None:
        """Source ``r`` handed over ``partials`` (of ``version``): they go to its receiver, returned,
        or back to their prompts if the receiver died meanwhile."""
        dst = self.rollouts.get(r.extract_to) if r.extract_to else None
        r.extract_to = None
        if dst is not None:
            dst.awaiting = max(0, dst.awaiting - 1)
        if partials and dst is not None and dst.alive:
            dst.pending_inject.extend(partials)
            self.outside.note(r.name, "repack_out", version)
            self.outside.note(dst.name, "repack_in", version)
        elif partials:  # the receiver died meanwhile: the responses restart from their prompts
            self.requeue([p.request for p in partials])
        return dst

    def same_version(self, r: RolloutState, inject: list[Partial]) -> list[Partial]:
        """Handed-over partials of the version the receiver runs, and parked episodes (version -1: any
        receiver continues them); the others (it moved on) restart from their prompts."""
        lost = [p for p in inject if p.version not in (-1, r.version)]
        if lost:
            self.counts["repack_lost"] += len(lost)
            self.counts["repack_lost_tokens"] += sum(len(p.tokens) for p in lost)
            self.requeue([p.request for p in lost])
        return [p for p in inject if p.version in (-1, r.version)]

    def cancel(self, r: RolloutState) -> None:
        """``r`` died: the repacks it was the source or the receiver of are off."""
        if r.extract_to in self.rollouts:
            dst = self.rollouts[r.extract_to]
            dst.awaiting = max(0, dst.awaiting - 1)
        r.extract_to = None
        r.awaiting = 0
        for other in self.rollouts.values():
            if other.extract_to == r.name:
                other.extract_to = None
