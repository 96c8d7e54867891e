"""The rollout manager: the state and every decision of Laminar's control loop, once.

One object holds the manager's state (the prompt queue, the experience buffer, the batch gate of the
batched modes, what each rollout holds) and applies every event to it: a rollout's result, an
update, a repack tick, a dead or revived rollout. It has no Ray, no clock and no I/O. What it must
ask of the world around it goes through :class:`Outside` (refresh the prompt source's policy copy,
poke a rollout that has news, note a timeline event), which each driver implements: the local
driver (``training.rl.drivers.local``), the Ray driver (``training.rl.drivers.ray``) and the
discrete-event simulator (``training.rl.simulate``). The local driver runs the orders in process,
the Ray driver turns ``ray.wait`` results into manager calls, the simulator its event heap. A
behaviour added here is in all three, and in the unit tests that drive the manager directly.

The stateless rules it applies (mode decisions, admission room, repack planning) are in
``training.rl.control``. Three components it owns hold the state of one concern each, sharing its
queue, buffer and rollout records: ``BatchGate`` (``training.rl.batch_gate``: the batched modes'
batches), ``Admission`` (``training.rl.admission``: what a rollout may admit, the trainer's staleness
gate and the bounds it reckons with) and ``Repacker`` (``training.rl.repack``: repack planning and
the hand-over).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Callable, Iterable, Sequence

from generation.records import GenRequest, Partial, ScoredGroup, Trajectory
from training.rl import control
from training.rl.admission import Admission
from training.rl.batch_gate import EMPTY_BATCH_LIMIT, BatchGate
from training.rl.control import MODES, ExperienceBuffer, ModeSpec, PromptQueue
from training.rl.repack import Repacker
from training.rl.records import ExtractOrder, PullResult, RolloutStatus, StepMetrics, StepOrder
from training.rl.rollout_state import RolloutState, live_or_all, request_key, request_of

__all__ = ["EMPTY_BATCH_LIMIT", "ManagerSettings", "Outside", "RolloutManager", "RolloutState"]


class Outside(Protocol):
    """What the manager asks of the runtime or the simulator around it."""

    def refresh(self) -> None:
        """Bring the prompt source's copy of the policy to the latest version (before prompts are drawn)."""

    def poke(self, rollout: str) -> None:
        """``rollout`` has news (work handed to it, a new version, a repack to do): the simulator
        dispatches it if idle or cuts its call short; the runtime's loop dispatches idle rollouts anyway."""

    def note(self, rollout: str, kind: str, version: int) -> None:
        """A timeline event (pull, interrupt, repack_out, repack_in, restart)."""


@dataclass(frozen=True)
class ManagerSettings:
    """The few numbers the manager decides with, resolved in one place (``from_config`` for the
    pipeline, the simulator's own config for the simulator)."""

    mode: ModeSpec
    steps: int
    prompts_per_step: int
    group_size: int
    capacity: int
    max_staleness: int | None
    repack_b: int = 0
    """Repack's B (0 = ``capacity``)."""
    max_sampling_rounds: int = 1
    """Batched modes with dynamic sampling: sampling rounds a batch may take to fill (1 = one round)."""
    max_ahead_batches: int = 0
    """Back-pressure of the continuous modes: issued-but-untrained groups stay within this many batches
    (0: off)."""

    @classmethod
    def from_config(cls, rl, params) -> ManagerSettings:
        """From ``conf.schema.RLConfig`` and the resolved objective
        (``training.objectives.ObjectiveParams``)."""
        if rl.mode not in MODES:
            raise ValueError(f"rl.mode={rl.mode!r}: expected one of {sorted(MODES)}")
        return cls(
            mode=dataclasses.replace(MODES[rl.mode], admit_lag=rl.admit_lag),
            steps=rl.steps,
            prompts_per_step=rl.prompts_per_step,
            group_size=rl.group_size,
            capacity=rl.rollout_capacity,
            max_staleness=rl.max_staleness,
            repack_b=rl.repack_b,
            max_sampling_rounds=params.max_sampling_rounds if params.dynamic_sampling else 1,
        )


@dataclass
class Window:
    """Counters since the last update."""

    occupancy: list = field(default_factory=list)
    generated: int = 0
    generated_tokens: int = 0
    filtered_before: int = 0
    repacks: int = 0

    def metrics(
        self,
        version: int,
        kept: list[ScoredGroup],
        stats,
        filtered: int,
        rounds: int,
        wall: float,
        train_s: float,
    ) -> StepMetrics:
        """The history entry of the update to ``version`` on the groups ``kept`` (``stats``: its
        ``UpdateStats``), the buffer having filtered ``filtered`` groups in all, the batch having taken
        ``rounds`` sampling rounds, ``wall`` seconds since the last update, ``train_s`` of them training."""
        return StepMetrics.of(
            version,
            kept,
            stats,
            dropped_groups=filtered - self.filtered_before,
            sampling_rounds=rounds,
            generated=self.generated,
            generated_tokens=self.generated_tokens,
            staleness=[version - 1 - ExperienceBuffer.group_version(g) for g in kept],
            occupancy=sum(self.occupancy) / max(1, len(self.occupancy)),
            repacks=self.repacks,
            wall=wall,
            train_s=train_s,
        )


class RolloutManager:
    """See the module docstring. ``rollouts``: (name, node, relay) of each rollout."""

    def __init__(
        self,
        settings: ManagerSettings,
        source,
        score: Callable[[list[Trajectory]], ScoredGroup],
        outside: Outside,
        rollouts: Sequence[tuple[str, str, str]],
        keep: Callable[[ScoredGroup], bool] | None = None,
    ):
        self.s = settings
        self.mode = settings.mode
        self.source = source
        self.outside = outside
        self.queue = PromptQueue(source, settings.group_size)
        self.buffer = ExperienceBuffer(
            settings.group_size, score, keep=keep, max_staleness=settings.max_staleness
        )
        self.rollouts: dict[str, RolloutState] = {
            n: RolloutState(n, node, relay) for n, node, relay in rollouts
        }
        self.version = 0
        """The trainer's latest version."""
        self.counts: Counter = Counter()
        self.window = Window()
        self.training: list[tuple[int, ScoredGroup]] = []
        """The batch the trainer is updating on now."""
        self.training_responses = 0
        self.training_rounds = 1
        """Sampling rounds the batch in training took (batched modes with dynamic sampling)."""
        self.batches = BatchGate(
            settings, self.queue, self.buffer, source, outside, self.rollouts, self.counts
        )
        """The batched modes' open batch and the closed ones waiting for the trainer."""
        self.admission = Admission(settings, self.queue, self.buffer, self.rollouts, self.counts)
        """Admission of work and the trainer's staleness gate (continuous modes)."""
        self.repacks = Repacker(settings, self.rollouts, self.counts, outside, self.requeue)
        """Laminar's repack: planning and the hand-over."""
        # what was trained and rolled out
        self.trained_uids: list[int] = []
        self.trained_prompts: list[tuple[int, str]] = []
        self.response_lengths: list[int] = []
        self.consumed: Counter = Counter()
        self.rewards: list[tuple[int, str, float, int]] = []
        self.terms: list[tuple[int, str, int, str, float]] = []
        """(step, prompt_id, sample_idx, component, score) of every rolled-out response; component
        ``total`` is the weighted sum the advantages used."""
        """(step, prompt_id, mean correctness, responses) of every completed group: the reward history."""
        self.on_completed: Callable[[list[ScoredGroup]], None] | None = None
        """Called with every completed group, kept or filtered (ReLIFT: ``training.rl.relift``)."""

    def start_at(self, version: int) -> None:
        """The trainer starts (or resumes) at ``version``; batch ``version`` is the next to issue."""
        self.version = version
        self.batches.idx = version

    # ------------------------------------------------------------------------------------------ trainer
    def next_batch(self) -> list[tuple[int, ScoredGroup]]:
        """The groups of the next update (the trainer takes them now), or [] when none is due."""
        groups = self._trainable()
        if groups:
            self.training = groups
            self.training_responses = sum(len(g.trajectories) for _, g in groups)
        return groups

    def _trainable(self) -> list[tuple[int, ScoredGroup]]:
        if self.mode.batched:
            if not self.batches.closed:
                return []
            groups, self.training_rounds = self.batches.take(self.version)
            return groups
        if self.buffer.n_ready() < self.s.prompts_per_step:
            return []
        groups, stale = self.admission.trainable(self.version)
        for uid, g in stale:  # too stale: regenerate the prompt under newer weights
            self.buffer.forget(uid)
            self.queue.requeue(
                GenRequest(prompt=t.prompt, sample_idx=t.sample_idx, group_uid=uid) for t in g.trajectories
            )
        return groups

    def updated(
        self, version: int, stats=None, wall: float = 0.0, train_s: float = 0.0
    ) -> StepMetrics | None:
        """The trainer finished its update on ``self.training`` and is at ``version``: record what was
        trained, tell the rollouts per the mode (interrupt: all; drain: those with nothing active) and
        repack (laminar). With the update's ``stats`` (``UpdateStats``), returns its history entry
        (``wall`` seconds since the last update, ``train_s`` of them training) and resets the window."""
        groups, self.training, self.training_responses = self.training, [], 0
        rounds, self.training_rounds = self.training_rounds, 1
        self.version = version
        self.trained_uids += [u for u, _ in groups]
        self.trained_prompts += [(u, g.prompt_id) for u, g in groups]
        self.response_lengths += [len(t.response_tokens) for _, g in groups for t in g.trajectories]
        self.consumed.update(t.prompt.prompt_id for _, g in groups for t in g.trajectories)
        m = self._update_metrics(groups, rounds, stats, wall, train_s) if stats is not None else None
        self.window = Window(filtered_before=self.buffer.stats.filtered)
        for r in self.rollouts.values():
            if self.mode.interrupt or (self.mode.drain and (not r.busy or r.active == r.parked)):
                self.outside.poke(r.name)
        if self.mode.repack:
            self.repack()
        return m

    def _update_metrics(
        self, groups: Sequence[tuple[int, ScoredGroup]], rounds: int, stats, wall: float, train_s: float
    ) -> StepMetrics:
        kept = [g for _, g in groups]
        m = self.window.metrics(self.version, kept, stats, self.buffer.stats.filtered, rounds, wall, train_s)
        m.extra.update(self.source.step_counts())
        return m

    def retained_versions(self, keep_recent: int, latest: int | None = None) -> set[int]:
        """The weight versions the relays must keep: the newest ``keep_recent`` up to ``latest`` (the
        trainer's version by default) and every version a rollout still decodes with."""
        return control.retained_versions(
            self.version if latest is None else latest,
            [r.version for r in self.rollouts.values() if r.active and r.version >= 0],
            keep_recent,
        )

    # ------------------------------------------------------------------------------------------ batches
    def maybe_open_batch(self) -> str:
        """sync / one_step: batch b (the groups of update b+1) starts once batch b-1 is fully generated
        and the trainer has reached version b - max_ahead; rollouts pull that version first
        (``BatchGate.maybe_open``). Returns "closed" when the open batch closed, "issued" when work
        was handed out, else ""."""
        return self.batches.maybe_open(self.version)

    # ------------------------------------------------------------------------------------------ rollouts
    def dispatch(self, name: str) -> StepOrder | ExtractOrder | None:
        """What rollout ``name`` (idle, alive) does next: hand its work over (repack), or a step (pull
        first? admit queued requests? what it takes); None: nothing to do."""
        r = self.rollouts[name]
        if r.extract_to is not None:
            r.busy = True
            return ExtractOrder(dst=r.extract_to)
        # the mode's decision: pull first? interrupt? admit queued requests? laminar is version-atomic:
        # it pulls only when no response is in flight here (queued requests have not started, so they
        # run under the new version) and no repack is about to hand some over; episodes parked between
        # turns are not in flight (the turn rule, environments.episodes)
        plan = control.dispatch_plan(
            self.mode,
            version=r.version,
            latest=self.version,
            active=r.active,
            parked=r.parked,
            queued=r.queued,
            pending=bool(r.pending_inject),
            awaiting=r.awaiting,
            batch_min_version=self.batches.min_version,
        )
        if plan.interrupt:
            self.counts["interrupts"] += 1
            self.outside.note(name, "interrupt", self.version)
        inject = [p for p in r.pending_inject if isinstance(p, Partial)]
        submit = [q for q in r.pending_inject if not isinstance(q, Partial)]
        r.pending_inject = []
        if inject and self.mode.drain:
            inject = self.repacks.same_version(r, inject)
        if not self.mode.batched and plan.admitting:
            retries, groups = self.admission.room(
                r, len(inject) + len(submit), self.version, self.training_responses, len(self.trained_uids)
            )
            if retries or groups:
                self.outside.refresh()
                submit.extend(self.queue.take_retries(retries) + self.queue.take_groups(groups))
        for q in submit:
            r.assigned[request_key(q)] = q
        for p in inject:
            r.assigned[request_key(p.request)] = p.request
        self.admission.handed(r, submit, inject)
        r.last_sent = [request_key(q) for q in submit] + [request_key(p.request) for p in inject]
        if not plan.pull and not submit and not inject and r.active == 0 and r.queued == 0:
            return None
        r.busy, r.draining, r.pulling = True, not plan.admitting, plan.pull
        return StepOrder(
            submit=tuple(submit),
            inject=tuple(inject),
            pull=plan.pull,
            min_version=plan.min_version,
            admitting=plan.admitting,
        )

    def step_done(
        self, name: str, finished: Iterable[Trajectory], status: RolloutStatus, pulled: PullResult | None
    ) -> list[tuple[int, ScoredGroup]]:
        """A step call returned: its finished trajectories go to the buffer (whole groups complete),
        its status and pull are recorded. Returns the groups it completed."""
        r = self.rollouts[name]
        r.busy = r.pulling = False
        if pulled is not None:
            if not pulled.ok:
                self.counts["pull_failures"] += 1  # the relay health check finds a dead one
            elif pulled.version != r.version:
                self.outside.note(name, "pull", pulled.version)
                self.counts["pulls"] += 1
        completed = []
        if pulled is not None and pulled.ok:
            self.admission.first_weights(r, status.version)
        for t in finished:
            r.assigned.pop((t.group_uid, t.sample_idx), None)
            self.admission.forget((t.group_uid, t.sample_idx))
            group = self.buffer.add(t)
            if group is not None:
                completed.append((t.group_uid, group))
                self.batches.left.discard(t.group_uid)
            self.window.generated_tokens += len(t.response_tokens)
            self.window.generated += 1
        self._record_completed()
        self._status(r, status)
        return completed

    def extract_done(
        self, name: str, partials: Sequence[Partial], queued: Sequence[GenRequest], status: RolloutStatus
    ) -> str | None:
        """A repack source handed over its work: the partials go to the receiver (or back to their
        prompts if it died meanwhile), its queued requests back in line. Returns the receiver."""
        r = self.rollouts[name]
        r.busy = r.pulling = False
        dst = self.repacks.handed_over(r, partials, status.version)
        self.requeue(queued)
        for q in list(queued) + [p.request for p in partials]:
            r.assigned.pop(request_key(q), None)
        self._status(r, status)
        return dst.name if dst is not None else None

    def _status(self, r: RolloutState, status: RolloutStatus) -> None:
        r.prev_active = r.active
        r.version, r.active, r.queued, r.parked = status.version, status.active, status.queued, status.parked
        self.window.occupancy.append(status.active / max(1, status.capacity))

    def _record_completed(self) -> None:
        completed = self.buffer.pop_completed()
        if not completed:
            return
        self.source.observe([g for _, g in completed])
        if self.on_completed is not None:
            self.on_completed([g for _, g in completed])
        step = self.version + 1
        self.rewards.extend(
            (step, g.prompt_id, sum(g.correct) / len(g.correct), len(g.correct)) for _, g in completed
        )
        for _, g in completed:
            for j, t in enumerate(g.trajectories):
                self.terms.extend((step, g.prompt_id, t.sample_idx, k, v[j]) for k, v in g.terms.items())
                self.terms.append((step, g.prompt_id, t.sample_idx, "total", g.rewards[j]))

    def requeue(self, requests: Iterable[GenRequest]) -> None:
        """Lost or returned requests go back first in line. Batched modes hand them straight to a live
        rollout: their batch cannot close without them."""
        requests = list(requests)
        if not requests:
            return
        for q in requests:
            self.admission.forget(request_key(q))
        if not self.mode.batched:
            self.queue.requeue(requests)
            return
        alive = live_or_all(self.rollouts.values())
        for i, q in enumerate(sorted(requests, key=request_key)):
            alive[i % len(alive)].pending_inject.append(q)
        for r in alive[: len(requests)]:
            self.outside.poke(r.name)

    # ------------------------------------------------------------------------------------------ failures
    def restarted(self, name: str, after_step: bool) -> int:
        """The rollout's process was replaced between two calls (seen in its result): what it held is
        gone except what the call just sent (``after_step``). Returns the requests re-queued."""
        r = self.rollouts[name]
        fresh = set(r.last_sent) if after_step else set()
        lost = [q for k, q in r.assigned.items() if k not in fresh]
        for q in lost:
            r.assigned.pop(request_key(q))
        self.requeue(lost)
        self.counts["rollout_failures"] += 1
        self.counts["requeued_requests"] += len(lost)
        self.outside.note(name, "restart", -1)
        r.restarts += 1
        return len(lost)

    def died(self, name: str) -> int:
        """A dead rollout loses only its in-flight work: back to the prompt queue by prompt id.
        Returns the requests re-queued."""
        r = self.rollouts[name]
        lost = list(r.assigned.values()) + [request_of(p) for p in r.pending_inject]
        r.assigned.clear()
        r.pending_inject = []
        self.repacks.cancel(r)
        r.alive = r.busy = r.pulling = False
        self.requeue(lost)
        r.active = r.queued = r.prev_active = r.parked = 0
        r.version = -1
        self.counts["rollout_failures"] += 1
        self.counts["requeued_requests"] += len(lost)
        self.outside.note(name, "restart", -1)
        return len(lost)

    def revived(self, name: str) -> None:
        """A dead rollout is back (restarted, no weights): it pulls at its next dispatch."""
        r = self.rollouts[name]
        r.alive, r.version = True, -1
        r.restarts += 1

    # ------------------------------------------------------------------------------------------ repack
    def repack(self) -> None:
        """Laminar's repack: long-tail rollouts of one version hand their work to the best fit
        (``Repacker.plan``)."""
        self.repacks.plan(self.window)

    # ------------------------------------------------------------------------------------------ checkpoints
    def in_flight(self) -> list[GenRequest]:
        """Every request handed out and not finished (held by rollouts, about to be, or waiting for a
        retry), once each, in (group_uid, sample_idx) order."""
        reqs = [q for r in self.rollouts.values() for q in r.assigned.values()]
        reqs += [request_of(p) for r in self.rollouts.values() for p in r.pending_inject]
        reqs += list(self.queue.retry)
        seen, out = set(), []
        for q in sorted(reqs, key=request_key):
            if request_key(q) not in seen:
                seen.add(request_key(q))
                out.append(q)
        return out

    def state(self) -> dict:
        """The manager's part of a checkpoint (JSON)."""
        return {
            "queue": self.queue.state(),
            "in_flight": [control.request_to_json(q) for q in self.in_flight()],
            "buffer": self.buffer.state(),
            "consumed": dict(self.consumed),
            "rewards": [list(x) for x in self.rewards],
            "terms": [list(x) for x in self.terms],
            "trained_uids": list(self.trained_uids),
            "batch_idx": self.batches.idx,
        }

    def load_state(self, state: dict) -> None:
        self.queue.load_state(state["queue"])
        self.queue.requeue(control.request_from_json(q) for q in state["in_flight"])
        self.buffer.load_state(state["buffer"])
        self.consumed = Counter(state["consumed"])
        self.rewards = [tuple(x) for x in state["rewards"]]
        self.terms = [tuple(x) for x in state.get("terms", [])]  # absent from older checkpoints
        self.trained_uids = list(state["trained_uids"])
