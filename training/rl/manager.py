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
``training.rl.control``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Callable, Iterable, Sequence

from generation.records import GenRequest, Partial, ScoredGroup, Trajectory
from training.rl import control
from training.rl.control import MODES, ExperienceBuffer, ModeSpec, PromptQueue, RolloutView
from training.rl.records import ExtractOrder, PullResult, RolloutStatus, StepMetrics, StepOrder


EMPTY_BATCH_LIMIT = 10
"""Batches in a row that dynamic sampling may empty before the run stops with an error (else a
prompt pool without signal would sample forever)."""


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
class RolloutState:
    """The manager's record of one rollout."""

    name: str
    node: str
    relay: str
    assigned: dict = field(default_factory=dict)
    """(group_uid, sample_idx) -> GenRequest for the work this rollout holds (queued or active)."""
    version: int = -1
    active: int = 0
    queued: int = 0
    parked: int = 0
    """Of ``active``, episodes between turns that pin no weights (``RolloutStatus.parked``)."""
    prev_active: int = 0
    alive: bool = True
    busy: bool = False
    """A call is in flight."""
    draining: bool = False
    pulling: bool = False
    """The call in flight loads new weights: ``version`` is about to change."""
    pending_inject: list = field(default_factory=list)
    """Work handed to it that its next call carries: Partials (repack) and GenRequests (batches, requeues)."""
    extract_to: str | None = None
    awaiting: int = 0
    """Repacks on their way to this rollout (it must not pull a new version before they land)."""
    last_sent: list = field(default_factory=list)
    restarts: int = 0


@dataclass
class Window:
    """Counters since the last update."""

    occupancy: list = field(default_factory=list)
    generated: int = 0
    generated_tokens: int = 0
    filtered_before: int = 0
    repacks: int = 0


def _key(q: GenRequest) -> tuple[int, int]:
    return q.group_uid, q.sample_idx


def _request(item: Partial | GenRequest) -> GenRequest:
    return item.request if isinstance(item, Partial) else item


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
        self.empty_streak = 0
        """Batches in a row whose every group dynamic sampling dropped (``EMPTY_BATCH_LIMIT``)."""
        # batched modes: the open batch and the closed ones waiting for the trainer
        self.batch_idx = 0
        self.batch_open = False
        self.batch_uids: set[int] = set()
        self.batch_left: set[int] = set()
        """Groups of the open batch not yet complete."""
        self.batch_rounds = 0
        self.batch_min_version = 0
        self.closed_batches: list[set[int]] = []
        self.closed_rounds: list[int] = []
        """The sampling rounds of each closed batch."""
        self.batch_of: dict[int, int] = {}
        # what was trained and rolled out
        self.trained_uids: list[int] = []
        self.trained_prompts: list[tuple[int, str]] = []
        self.response_lengths: list[int] = []
        self.consumed: Counter = Counter()
        self.bound: dict[tuple[int, int], int] = {}
        """(group_uid, sample_idx) -> the lowest version the response handed out under that key can
        end with (its rollout's version when handed out; -1: unknown until that rollout's first
        weights): what the trainer's staleness gate (``control.staleness_gate``) reckons with."""
        self.rewards: list[tuple[int, str, float, int]] = []
        self.terms: list[tuple[int, str, int, str, float]] = []
        """(step, prompt_id, sample_idx, component, score) of every rolled-out response; component
        ``total`` is the weighted sum the advantages used."""
        """(step, prompt_id, mean correctness, responses) of every completed group: the reward history."""

    def start_at(self, version: int) -> None:
        """The trainer starts (or resumes) at ``version``; batch ``version`` is the next to issue."""
        self.version = version
        self.batch_idx = version

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
            if not self.closed_batches:
                return []
            uids = self.closed_batches.pop(0)
            self.training_rounds = self.closed_rounds.pop(0)
            groups = self.buffer.take_uids(uids, self.s.prompts_per_step, self.version)
            if not groups:  # every group filtered (dynamic sampling): no update; the batch index repeats
                self.counts["empty_batches"] += 1
                self.empty_streak += 1
                self.batch_idx -= 1
                if self.empty_streak >= EMPTY_BATCH_LIMIT:
                    raise RuntimeError(
                        f"dynamic sampling kept no group in {self.empty_streak} batches in a row (every "
                        "group's responses were all right or all wrong, in "
                        f"{self.s.max_sampling_rounds} rounds each): "
                        "the prompts carry no signal for this policy; select harder or easier prompts, raise "
                        "rl.max_sampling_rounds, or set rl.dynamic_sampling=false"
                    )
            else:
                self.empty_streak = 0
            return groups
        if self.buffer.n_ready() < self.s.prompts_per_step:
            return []
        if self.s.max_staleness is None:
            groups, stale = self.buffer.take(self.s.prompts_per_step, self.version, full=True)
        else:
            stale, groups, uids = self.buffer.drop_stale(self.version), [], None
            if self.buffer.n_ready() >= self.s.prompts_per_step:
                uids = control.staleness_gate(
                    [(u, ExperienceBuffer.group_version(g)) for u, g in self.buffer.ready.items()],
                    self._unfinished_versions(),
                    latest=self.version,
                    max_staleness=self.s.max_staleness,
                    batch_groups=self.s.prompts_per_step,
                )
                if uids is None:  # older work must finish first
                    self.counts["staleness_waits"] += 1
            if uids is not None:
                groups = self.buffer.take_uids(uids, self.s.prompts_per_step, self.version)
        for uid, g in stale:  # too stale: regenerate the prompt under newer weights
            self.buffer.forget(uid)
            self.queue.requeue(
                GenRequest(prompt=t.prompt, sample_idx=t.sample_idx, group_uid=uid) for t in g.trajectories
            )
        return groups

    def _unfinished_versions(self) -> list[int]:
        """For each admitted group neither ready nor trained, the lowest version it can end with: the
        oldest of its finished responses and of its unfinished ones' bounds (``self.bound``; a request
        handed back and waiting goes to a rollout at the latest version, ``_admission``)."""
        waiting = self.version  # a handed-back request goes to a rollout at the latest version
        low: dict[int, int] = {}

        def see(uid: int, version: int) -> None:
            low[uid] = min(version, low.get(uid, version))

        for uid, slot in self.buffer.partial.items():
            for t in slot.values():
                see(uid, t.version)
        for r in self.rollouts.values():
            for key in list(r.assigned) + [_key(_request(p)) for p in r.pending_inject]:
                see(key[0], max(0, self.bound.get(key, waiting)))
        for q in self.queue.retry:
            see(q.group_uid, waiting)
        return [v for uid, v in low.items() if uid not in self.buffer.ready]

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
        w = self.window
        m = StepMetrics.of(
            self.version,
            kept,
            stats,
            dropped_groups=self.buffer.stats.filtered - w.filtered_before,
            sampling_rounds=rounds,
            generated=w.generated,
            generated_tokens=w.generated_tokens,
            staleness=[self.version - 1 - ExperienceBuffer.group_version(g) for g in kept],
            occupancy=sum(w.occupancy) / max(1, len(w.occupancy)),
            repacks=w.repacks,
            wall=wall,
            train_s=train_s,
        )
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
        and the trainer has reached version b - max_ahead; rollouts pull that version first. With
        dynamic sampling a batch that kept too few groups samples further rounds before it closes.
        Returns "closed" when the open batch closed, "issued" when work was handed out, else ""."""
        if self.batch_open:
            if not self.batch_uids or self.batch_left:
                return ""
            kept = sum(1 for u in self.batch_uids if u in self.buffer.ready)
            if kept < self.s.prompts_per_step and self.batch_rounds < self.s.max_sampling_rounds:
                self.counts["extra_rounds"] += 1
                need = self.source.round_size(
                    self.s.prompts_per_step - kept,
                    self.buffer.stats.filtered / max(1, len(self.batch_uids)),
                    self.s.prompts_per_step,
                )
                self._issue_batch(need)
                return "issued"
            self.batch_open = False
            self.closed_batches.append(set(self.batch_uids))
            self.closed_rounds.append(self.batch_rounds)
            return "closed"
        if not control.may_open_batch(
            self.mode,
            version=self.version,
            batch_idx=self.batch_idx,
            steps=self.s.steps,
            closed_waiting=len(self.closed_batches),
        ):
            return ""  # the trainer has not caught up, or every batch is issued
        self.batch_open = True
        self.batch_rounds = 0
        self.batch_uids, self.batch_left = set(), set()
        self.batch_min_version = control.batch_min_version(self.mode, self.batch_idx)
        self.batch_idx += 1
        self._issue_batch(self.s.prompts_per_step)
        return "issued"

    def _issue_batch(self, n_groups: int) -> None:
        self.batch_rounds += 1
        self.outside.refresh()
        reqs = list(self.queue.retry) + self.queue.take_groups(n_groups)
        self.queue.retry.clear()
        uids = {q.group_uid for q in reqs}
        self.batch_uids |= uids
        self.batch_left |= uids
        for uid in uids:
            self.batch_of.setdefault(uid, self.batch_idx - 1)
        alive = self._alive()
        # whole groups round-robin over rollouts; fresh requests also ride in pending_inject (GenRequest)
        for r, share in zip(alive, control.round_robin_groups(reqs, len(alive))):
            r.pending_inject.extend(share)
            if share:
                self.outside.poke(r.name)

    def _alive(self) -> list[RolloutState]:
        return [r for r in self.rollouts.values() if r.alive] or list(self.rollouts.values())

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
            batch_min_version=self.batch_min_version,
        )
        if plan.interrupt:
            self.counts["interrupts"] += 1
            self.outside.note(name, "interrupt", self.version)
        inject = [p for p in r.pending_inject if isinstance(p, Partial)]
        submit = [q for q in r.pending_inject if not isinstance(q, Partial)]
        r.pending_inject = []
        if inject and self.mode.drain:
            inject = self._same_version(r, inject)
        if not self.mode.batched and plan.admitting:
            retries, groups = self._admission(r, len(inject) + len(submit))
            if retries or groups:
                self.outside.refresh()
                submit.extend(self.queue.take_retries(retries) + self.queue.take_groups(groups))
        for q in submit:
            r.assigned[_key(q)] = q
            self.bound[_key(q)] = r.version
        for p in inject:
            r.assigned[_key(p.request)] = p.request
            self.bound.setdefault(_key(p.request), p.version if p.version >= 0 else r.version)
        r.last_sent = [_key(q) for q in submit] + [_key(p.request) for p in inject]
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

    def _same_version(self, r: RolloutState, inject: list[Partial]) -> list[Partial]:
        """Handed-over partials of the version the receiver runs, and parked episodes (version -1: any
        receiver continues them); the others (it moved on) restart from their prompts."""
        lost = [p for p in inject if p.version not in (-1, r.version)]
        if lost:
            self.counts["repack_lost"] += len(lost)
            self.counts["repack_lost_tokens"] += sum(len(p.tokens) for p in lost)
            self.requeue([p.request for p in lost])
        return [p for p in inject if p.version in (-1, r.version)]

    def _admission(self, r: RolloutState, new: int) -> tuple[int, int]:
        """How many handed-back requests and new groups rollout ``r`` may take: its free slots (new
        prompts come in whole groups, the last may overshoot them), within the back-pressure and the
        staleness bound's flow control (``control.admission_room``)."""
        free = self.s.capacity - (r.active + r.queued + new)
        cap = self.s.max_ahead_batches
        if cap > 0 and not self.queue.retry:
            ahead = self.queue.issued_groups - len(self.trained_uids)
            free = min(free, (cap * self.s.prompts_per_step - ahead) * self.s.group_size)
        g = self.s.group_size
        if self.s.max_staleness is None or free <= 0:  # unbounded: no flow control, nothing to count
            retries = min(len(self.queue.retry), max(0, free))
            return retries, -(-(free - retries) // g) if free > retries else 0
        # the batch in the trainer's hands fills the update at the latest version (the first update
        # the room counts): without it, every other update's rollouts overshoot by a batch. The
        # requests handed back (retry) are counted and go to a rollout at the latest version only
        # (their groups are admitted already, and they must not end older than the gate reckons);
        # new prompts come in whole groups within the room (never a group's overshoot past it)
        retry = len(self.queue.retry)
        outstanding = control.outstanding_responses(
            self.rollouts.values(), self.buffer, training=self.training_responses, new=new
        )
        room = control.admission_room(
            self.s.max_staleness,
            latest=self.version,
            version=r.version,
            batch_groups=self.s.prompts_per_step,
            group_size=g,
            outstanding=outstanding + retry,
        )
        retries = min(retry, free) if r.version >= self.version else 0
        groups = min(-(-(free - retries) // g), max(0, room) // g) if free > retries else 0
        if retries + groups * g < free:
            self.counts["admission_limited"] += 1
        return retries, groups

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
        for key, v in self.bound.items() if pulled is not None and pulled.ok else ():
            if v < 0 and key in r.assigned:  # handed out before its first weights: it runs under these
                self.bound[key] = status.version
        for t in finished:
            r.assigned.pop((t.group_uid, t.sample_idx), None)
            self.bound.pop((t.group_uid, t.sample_idx), None)
            group = self.buffer.add(t)
            if group is not None:
                completed.append((t.group_uid, group))
                self.batch_left.discard(t.group_uid)
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
        dst = self.rollouts.get(r.extract_to) if r.extract_to else None
        r.extract_to = None
        if dst is not None:
            dst.awaiting = max(0, dst.awaiting - 1)
        if partials and dst is not None and dst.alive:
            dst.pending_inject.extend(partials)
            self.outside.note(name, "repack_out", status.version)
            self.outside.note(dst.name, "repack_in", status.version)
        elif partials:  # the receiver died meanwhile: the responses restart from their prompts
            self.requeue([p.request for p in partials])
        self.requeue(queued)
        for q in list(queued) + [p.request for p in partials]:
            r.assigned.pop(_key(q), None)
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
            self.bound.pop(_key(q), None)
        if not self.mode.batched:
            self.queue.requeue(requests)
            return
        alive = self._alive()
        for i, q in enumerate(sorted(requests, key=_key)):
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
            r.assigned.pop(_key(q))
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
        lost = list(r.assigned.values()) + [_request(p) for p in r.pending_inject]
        r.assigned.clear()
        r.pending_inject = []
        if r.extract_to in self.rollouts:
            dst = self.rollouts[r.extract_to]
            dst.awaiting = max(0, dst.awaiting - 1)
        r.extract_to = None
        r.awaiting = 0
        for other in self.rollouts.values():
            if other.extract_to == r.name:
                other.extract_to = None
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
        """Laminar's repack: long-tail rollouts of one version hand their work to the best fit."""
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
                self.window.repacks += 1
                self.outside.poke(src.name)

    # ------------------------------------------------------------------------------------------ checkpoints
    def in_flight(self) -> list[GenRequest]:
        """Every request handed out and not finished (held by rollouts, about to be, or waiting for a
        retry), once each, in (group_uid, sample_idx) order."""
        reqs = [q for r in self.rollouts.values() for q in r.assigned.values()]
        reqs += [_request(p) for r in self.rollouts.values() for p in r.pending_inject]
        reqs += list(self.queue.retry)
        seen, out = set(), []
        for q in sorted(reqs, key=_key):
            if _key(q) not in seen:
                seen.add(_key(q))
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
            "batch_idx": self.batch_idx,
        }

    def load_state(self, state: dict) -> None:
        self.queue.load_state(state["queue"])
        self.queue.requeue(control.request_from_json(q) for q in state["in_flight"])
        self.buffer.load_state(state["buffer"])
        self.consumed = Counter(state["consumed"])
        self.rewards = [tuple(x) for x in state["rewards"]]
        self.terms = [tuple(x) for x in state.get("terms", [])]  # absent from older checkpoints
        self.trained_uids = list(state["trained_uids"])
