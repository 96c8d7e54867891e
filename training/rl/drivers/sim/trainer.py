"""The trainer as a cost model: one update's seconds from its tokens, and the streamed variant
(``stream``: forward/backward per group as it completes, the optimizer step once the batch is in)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from conf.simulate import SimulateConfig
from generation.records import ScoredGroup
from training.rl.drivers.sim.clock import Clock
from training.rl.drivers.sim.costs import CostModel


class TrainerModel:
    """The trainer's state on the clock. ``lengths``: each finished response's tokens, by
    ``(group_uid, sample_idx)``, which is what an update costs."""

    def __init__(self, cfg: SimulateConfig, cost: CostModel, clock: Clock, speed_of: Callable[[], float]):
        self.prompt_len = cfg.workload.prompt_len
        self.step_overhead_s = cfg.cost.train_step_overhead_s
        self.cost = cost
        self.clock = clock
        self.speed_of = speed_of
        self.busy = False
        self.left = 0.0  # seconds of work at full speed left in the running update
        self.start = 0.0
        self.speed = 1.0
        self.epoch = 0
        self.lengths: dict[tuple[int, int], int] = {}
        self.trained_tokens = 0
        self.per_update: list[tuple[float, int]] = []  # (time, tokens) of each update
        self.stream_work: dict[int, list[tuple[float, float]]] = {}  # batch -> (arrival, seconds)
        self.stream_free = 0.0

    def group_tokens(self, uid: int, g: ScoredGroup) -> tuple[int, float]:
        lens = [self.lengths[(uid, t.sample_idx)] for t in g.trajectories]
        tokens = sum(lens)
        ctx = self.prompt_len + (sum(x * x for x in lens) / max(1, tokens)) / 2
        return tokens, ctx

    def train_work(self, groups: Sequence[tuple[int, ScoredGroup]]) -> float:
        tokens, wctx = 0, 0.0
        for uid, g in groups:
            t, c = self.group_tokens(uid, g)
            tokens += t
            wctx += t * c
        return self.cost.train_s(tokens, wctx / max(1, tokens))

    def begin(self, work: float) -> None:
        """An update of ``work`` seconds (at full speed) starts now, at the speed shared cores allow
        with the trainer busy; ``schedule`` then times its end."""
        self.busy = True
        self.left = work
        self.start, self.speed = self.clock.now, self.speed_of()
        self.epoch += 1

    def schedule(self) -> None:
        self.clock.push(self.clock.now + self.left / self.speed_of(), "train_done", None, self.epoch)

    def retime(self, sp: float) -> None:
        """Shared cores: the running update continues at speed ``sp`` from now."""
        if not self.busy or self.speed == sp:
            return
        now = self.clock.now
        self.left -= (now - self.start) * self.speed
        self.start, self.speed = now, sp
        self.epoch += 1
        self.clock.push(now + max(0.0, self.left) / sp, "train_done", None, self.epoch)

    def stream_arrival(self, batch: int, uid: int, group: ScoredGroup) -> None:
        """A group of ``batch`` is complete: its forward/backward can run from now."""
        tokens, ctx = self.group_tokens(uid, group)
        work = self.cost.train_s(tokens, ctx) - self.step_overhead_s
        self.stream_work.setdefault(batch, []).append((self.clock.now, work))

    def stream_finish_at(self, batch: int) -> float:
        """When the streamed update of ``batch`` ends: its groups' work in arrival order, then the step."""
        t = self.stream_free
        for arrival, work in sorted(self.stream_work.get(batch, [])):
            t = max(t, arrival) + work
        return t + self.step_overhead_s + self.cost.publish_stall_s()

    def begin_streamed(self, finish_at: float) -> None:
        self.busy = True
        self.epoch += 1
        self.clock.push(max(finish_at, self.clock.now + self.step_overhead_s), "train_done", None, self.epoch)

    def finish(self, groups: Sequence[tuple[int, ScoredGroup]]) -> None:
        """The update on ``groups`` is done (now)."""
        self.busy = False
        tokens = sum(self.lengths[(uid, t.sample_idx)] for uid, g in groups for t in g.trajectories)
        self.trained_tokens += tokens
        self.per_update.append((self.clock.now, tokens))
