"""A simulated rollout call's work on the clock: segments that run at the shared cores' speed.

A call is a chain of segments (a prefill, decode steps, a weight copy, a hand-over), each ending in a
``seg_end`` event for its rollout. The cores are shared, so the speed changes as calls start and end:
``retime`` continues every running segment at the new speed from now, and the event of the old
timing is void (its ``epoch`` is stale). ``training.rl.drivers.sim.engines.EngineModel`` drives them.
"""

from __future__ import annotations

from collections.abc import Callable

from training.rl.drivers.sim.clock import Clock


class Segments:
    """Segments on ``clock`` at ``speed()`` (the shared cores' speed now), for ``SimRollout``s."""

    def __init__(self, clock: Clock, speed: Callable[[], float]):
        self.clock = clock
        self.speed = speed

    def account(self, r) -> None:
        """Count ``r``'s busy and occupied seconds up to now."""
        dt = self.clock.now - r.last_t
        if dt > 0:
            if r.rows:
                r.busy_active_s += dt
                r.occ_s += dt * len(r.rows) / r.capacity
            r.last_t = self.clock.now

    def start(self, r, work: float, steps: float) -> None:
        """A segment of ``work`` seconds at full speed (``steps`` decode steps of it) from now."""
        sp = self.speed()
        r.seg_start, r.seg_work, r.seg_speed, r.seg_steps = self.clock.now, work, sp, steps
        r.epoch += 1
        self.clock.push(self.clock.now + work / sp, "seg_end", r, r.epoch)

    def start_after_wait(self, r, wait: float, cost: float) -> None:
        """A segment that idles ``wait`` seconds (it does not slow shared cores) then works ``cost``."""
        sp = self.speed()
        r.seg_start, r.seg_work, r.seg_speed, r.seg_steps = self.clock.now, cost + wait * sp, sp, 0
        r.epoch += 1
        self.clock.push(self.clock.now + wait + cost / sp, "seg_end", r, r.epoch)

    def retime(self, rollouts, sp: float) -> None:
        """Shared cores: every running segment of ``rollouts`` continues at speed ``sp`` from now."""
        for r in rollouts:
            if r.busy and r.op != "wait" and r.seg_speed != sp:
                self._retime(r, sp)

    def _retime(self, r, sp: float) -> None:
        now = self.clock.now
        done = (now - r.seg_start) * r.seg_speed
        frac = min(1.0, done / r.seg_work) if r.seg_work > 0 else 1.0
        if r.seg_steps:
            r.S += r.seg_steps * frac
            r.chunk_left -= r.seg_steps * frac
            r.seg_steps *= 1 - frac
        r.seg_work = max(0.0, r.seg_work - done)
        r.seg_start, r.seg_speed = now, sp
        r.epoch += 1
        self.clock.push(now + r.seg_work / sp, "seg_end", r, r.epoch)

    def stop(self, r) -> None:
        """End ``r``'s decode segment now: the steps done so far count and its pending end is void."""
        self.account(r)
        done = (self.clock.now - r.seg_start) * r.seg_speed
        frac = min(1.0, done / r.seg_work) if r.seg_work > 0 else 1.0
        r.S += r.seg_steps * frac
        r.seg_steps = 0
        r.epoch += 1  # the pending seg_end is void
