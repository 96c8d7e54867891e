"""The simulated driver: the runtime's ``RolloutManager`` on a discrete-event clock, with cost models
for the engines, the trainer and the relays. The simulator is the manager's ``Outside``."""

from __future__ import annotations

import dataclasses

from conf.simulate import SIM_MODE_NAMES, SimulateConfig, apply_preset
from generation.records import ScoredGroup
from training.rl.control import MODES, ModeSpec
from training.rl.drivers.sim.clock import Clock
from training.rl.drivers.sim.costs import CostModel
from training.rl.drivers.sim.engines import EngineModel, SimRollout
from training.rl.drivers.sim.lengths import LengthSampler, PromptSource
from training.rl.drivers.sim.placement import layout
from training.rl.drivers.sim.relays import RelayModel
from training.rl.drivers.sim.results import ModeResult, mode_result
from training.rl.drivers.sim.timeline import Timeline
from training.rl.drivers.sim.trainer import TrainerModel
from training.rl.manager import ManagerSettings, RolloutManager
from training.rl.records import ExtractOrder

STREAM = ModeSpec("stream", batched=True, max_ahead=1, interrupt=False, drain=False, repack=False)
SIM_MODES: dict[str, ModeSpec] = {name: {**MODES, "stream": STREAM}[name] for name in SIM_MODE_NAMES}
"""The runtime's modes plus ``stream`` (simulator only: never in the real config's ``rl.mode``), in
the order and with the names of ``conf.simulate.SIM_MODE_NAMES``."""
STREAMED_TRAINING = {"stream"}


class Simulator:
    """One mode on one config. ``run()`` (once) returns a :class:`ModeResult`."""

    def __init__(self, cfg: SimulateConfig, mode: str):
        if mode not in SIM_MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {sorted(SIM_MODES)}")
        self.cfg = cfg = apply_preset(cfg)
        self.mode = dataclasses.replace(SIM_MODES[mode], admit_lag=cfg.sched.admit_lag)
        self.streamed = mode in STREAMED_TRAINING
        wl, sc = cfg.workload, cfg.sched
        self.layout = layout(cfg, mode)
        self.colocated = self.layout.colocated
        self.cost = CostModel(cfg, cfg.cluster.gpus_per_engine, self.layout.trainer_gpus)
        self.sampler = LengthSampler(wl.lengths, wl.max_output, wl.group_size, cfg.seed)
        self.mean_len = self.sampler.mean()
        self.capacity = sc.capacity or self.cost.auto_capacity(wl.prompt_len + self.mean_len, sc.max_capacity)
        self.steps = wl.steps
        self.source = PromptSource(self.sampler, wl.prompt_len, wl.pass_rates, cfg.seed)
        self.clock = Clock()
        names = [name for name, _, _ in self.layout.placed]
        self.engines = EngineModel(
            cfg,
            names,
            self.capacity,
            self.cost,
            self.source,
            self.clock,
            speed=self._speed,
            interrupt=self.mode.interrupt,
            on_return=self._return,
            on_extract=self._on_extract,
            on_idle=self._dispatch,
        )
        self.rollouts = self.engines.rollouts
        self.trainer = TrainerModel(cfg, self.cost, self.clock, self._speed)
        self.relays = RelayModel(self.layout.chain, self.cost, self.colocated)
        self.timeline = Timeline(names, cfg.timeline_rollouts)
        keep = (lambda g: len(set(g.correct)) > 1) if sc.dynamic_sampling else None
        self.m = RolloutManager(
            self._settings(mode), self.source, self.source.score, self, self.layout.placed, keep=keep
        )
        """The rollout manager the real runtime drives, driven here by the event clock."""
        self.idle: set[str] = set(self.rollouts)  # the first control pass dispatches every rollout
        self.dirty = True  # something changed: run a control pass
        self.wake = True  # idle rollouts may have work: dispatch them
        self.next_repack = sc.repack_interval_s
        self.gen_tokens = 0
        self.events = 0

    def _settings(self, mode: str) -> ManagerSettings:
        wl, sc = self.cfg.workload, self.cfg.sched
        return ManagerSettings(
            mode=self.mode,
            steps=wl.steps,
            prompts_per_step=wl.prompts_per_step,
            group_size=wl.group_size,
            capacity=self.capacity,
            max_staleness=None if mode == "sync" else sc.max_staleness,
            repack_b=sc.repack_b or self.capacity,
            max_sampling_rounds=sc.max_sampling_rounds if sc.dynamic_sampling else 1,
            max_ahead_batches=sc.max_ahead_batches,
        )

    @property
    def version(self) -> int:
        return self.m.version

    @property
    def queue(self):
        return self.m.queue

    @property
    def buffer(self):
        return self.m.buffer

    # ---------------------------------------------------------------------------- Outside
    def refresh(self) -> None:
        """The simulated prompt source holds no policy."""

    def poke(self, rollout: str) -> None:
        r = self.rollouts[rollout]
        if r.busy:
            self.engines.cut(r)
        else:
            self._dispatch(r)

    def note(self, rollout: str, kind: str, version: int) -> None:
        self.timeline.event(self.clock.now, rollout, kind, version)

    # ---------------------------------------------------------------------------- shared cores
    def _speed(self) -> float:
        """With ``cost.shared_cores``: every busy rollout and a busy trainer run at this speed."""
        cores = self.cfg.cost.shared_cores
        if cores <= 0:
            return 1.0
        busy = self.engines.n_busy + (1 if self.trainer.busy else 0)
        return min(1.0, cores / max(1, busy))

    def _busy_changed(self) -> None:
        """Shared cores: every running segment continues at the new speed (re-timed from now)."""
        if self.cfg.cost.shared_cores <= 0:
            return
        sp = self._speed()
        self.engines.retime(sp)
        self.trainer.retime(sp)

    # ---------------------------------------------------------------------------- rollouts
    def _dispatch(self, r: SimRollout) -> None:
        """An idle engine asks the manager what to do next (``RolloutManager.dispatch``, as the
        runtime does) and starts it: a hand-over (repack), or a call that pulls, admits and decodes."""
        if r.busy:
            return
        order = self.m.dispatch(r.name)
        if order is None:
            self.idle.add(r.name)
            return
        self.idle.discard(r.name)
        self.engines.set_busy(r, True)
        self.engines.account(r)
        if isinstance(order, ExtractOrder):
            self.engines.start_extract(r)
            self._busy_changed()
            return
        r.admitting = order.admitting
        r.partials.extend(order.inject)
        r.queue.extend(order.submit)
        if order.pull:
            want = max(order.min_version, 0) if order.min_version >= 0 else -1
            version, at = self.relays.version_time(self.m.rollouts[r.name].relay, want, self.clock.now)
            cost = self.cfg.cost.reshard_s if self.colocated else self.cost.pull_s()
            self.engines.start_pull(r, version, max(0.0, at - self.clock.now), cost)
        else:
            self.engines.start_step(r)
        self._busy_changed()

    def _return(self, r: SimRollout) -> None:
        """A rollout call returns: its result goes to the manager (``step_done``), as in the runtime."""
        finished, pulled = self.engines.collect(r)
        for traj, length in finished:
            self.trainer.lengths[(traj.group_uid, traj.sample_idx)] = length
            self.gen_tokens += length
        completed = self.m.step_done(r.name, [t for t, _ in finished], r.status(), pulled)
        if self.streamed:
            for uid, group in completed:
                self._stream_arrival(uid, group)
        self._rollout_free(r)

    def _on_extract(self, r: SimRollout) -> None:
        """A repack source's hand-over: its partials and queued requests go to the manager
        (``extract_done``), which passes them on; then the receiver is poked."""
        partials, queued = self.engines.hand_over(r)
        dst = self.m.extract_done(r.name, partials, queued, r.status())
        self._rollout_free(r)
        if dst is not None:
            self.poke(dst)

    def _rollout_free(self, r: SimRollout) -> None:
        self.timeline.sample(self.clock.now, r.name, len(r.rows), r.capacity)
        self._busy_changed()
        self.dirty = True
        self._dispatch(r)

    # ---------------------------------------------------------------------------- trainer
    def _maybe_train(self) -> None:
        if self.trainer.busy or self.streamed or self.version >= self.steps:
            return
        groups = self.m.next_batch()
        if not groups:
            return
        stall = 0.0 if self.colocated else self.cost.publish_stall_s()
        self.trainer.begin(self.trainer.train_work(groups) + stall)
        self._busy_changed()
        self.trainer.schedule()

    def _stream_arrival(self, uid: int, group: ScoredGroup) -> None:
        b = self.m.batches.of.get(uid)
        if b is not None:
            self.trainer.stream_arrival(b, uid, group)

    def _stream_schedule(self) -> None:
        b = self.version  # the batch of the next update: the first closed one
        if self.trainer.busy or not self.m.batches.closed or self.version >= self.steps:
            return
        finish_at = self.trainer.stream_finish_at(b)
        if not self.m.next_batch():
            return
        self.trainer.begin_streamed(finish_at)

    def _after_update(self) -> None:
        self.trainer.finish(self.m.training)
        version = self.version + 1
        self.timeline.update(self.clock.now, version)
        self.relays.publish(version, self.clock.now)
        self._retain_relay_versions(version)
        if self.streamed:
            self.trainer.stream_free = self.clock.now
        self._busy_changed()
        self.dirty = True
        self.wake = True
        self.m.updated(version)  # the rollouts hear of it (interrupt, drain) and laminar repacks
        if self.mode.repack:
            self.next_repack = self.clock.now + self.cfg.sched.repack_interval_s

    def _retain_relay_versions(self, version: int) -> None:
        """Relays keep the newest ``sched.keep_versions`` and every version in-flight responses use."""
        keep = self.m.retained_versions(self.cfg.sched.keep_versions, latest=version)
        self.relays.keep_only(keep)

    # ---------------------------------------------------------------------------- loop
    def run(self, max_events: int = 50_000_000) -> ModeResult:
        if self.events:
            raise RuntimeError("a Simulator runs once: make a new one")
        if self.mode.repack:
            self.clock.push(self.next_repack, "repack")
        gen_busy_since: float | None = None
        gen_time = 0.0
        self._control_pass()
        while self.version < self.steps:
            if not self.clock.heap:
                raise RuntimeError(
                    f"simulation of {self.mode.name} stalled at t={self.clock.now:.1f}s "
                    f"(version {self.version})"
                )
            kind, obj, epoch = self.clock.pop()
            self.events += 1
            if self.events > max_events:
                raise RuntimeError(f"simulation of {self.mode.name} exceeded {max_events} events")
            self._event(kind, obj, epoch)
            busy = self.engines.n_busy > 0
            if busy and gen_busy_since is None:
                gen_busy_since = self.clock.now
            elif not busy and gen_busy_since is not None:
                gen_time += self.clock.now - gen_busy_since
                gen_busy_since = None
        if gen_busy_since is not None:
            gen_time += self.clock.now - gen_busy_since
        return mode_result(self, gen_time)

    def _event(self, kind: str, obj, epoch: int) -> None:
        """Apply one event (a void one, re-timed or cut since it was pushed, does nothing)."""
        if kind == "seg_end":
            if epoch != obj.epoch:
                return
            self.engines.segment_end(obj)
        elif kind == "ready":  # turn rule: a parked episode's tool call is answered
            rollout, key = obj
            self.engines.ready(rollout, key, epoch)
        elif kind == "train_done":
            if epoch != self.trainer.epoch or not self.trainer.busy:
                return
            self._after_update()
        elif kind == "repack":
            if self.clock.now + 1e-9 >= self.next_repack:
                self.m.repack()
                self.next_repack = self.clock.now + self.cfg.sched.repack_interval_s
            self.clock.push(self.next_repack, "repack")
        if self.dirty:
            self._control_pass()

    def _control_pass(self) -> None:
        """One turn of the runtime's loop: trainer, batches, idle rollouts."""
        self.dirty = False
        for _ in range(4):
            self._maybe_train()
            if self.mode.batched:
                done = self.m.maybe_open_batch()
                if done:
                    self.dirty = True
                    self.wake = self.wake or done == "issued"
            if self.streamed:
                self._stream_schedule()
            if self.wake:
                self.wake = False
                for name in sorted(self.idle, key=lambda n: self.rollouts[n].index):
                    self._dispatch(self.rollouts[name])
            if not self.dirty:
                break
            self.dirty = False
