"""The Laminar control plane: plain Python, no Ray and no torch inside.

The drivers (``training.rl.drivers``: local, Ray actors), the unit tests and the discrete-event
simulator all drive these same classes:

- ``PromptQueue``: issues groups of generation requests from the data source (cursor or HIVE),
  each group under a fresh ``group_uid``; lost requests come back first (``requeue``).
- ``ExperienceBuffer``: assembles finished trajectories into whole groups, admits a group to the
  trainer only within the staleness bound, and trains every group at most once.
- ``plan_repack``: Laminar's best-fit consolidation of long-tail rollouts within one weight version.
- ``RelayChain``: the relay order the master forwards along; a dead relay is cut out, a rebuilt
  one joins at the tail; each node's rollouts pull from their node's relay, or bypass to a live one.
- ``MODES``: what each of ``sync | one_step | partial | laminar`` does at an update;
  ``dispatch_plan`` / ``may_open_batch`` / ``round_robin_groups``: the per-rollout and per-batch
  scheduling decisions the runtime's driver takes from them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Sequence

from conf.schema import Mode
from core.codec import Codec
from generation.records import GenRequest, PromptItem, ScoredGroup, Trajectory


# ----------------------------------------------------------------------------------------------- modes
@dataclass(frozen=True)
class ModeSpec:
    """How a mode schedules generation around the trainer.

    ``batched``: generation proceeds batch by batch (a batch = the groups of one update); the next
    batch is issued only when the current one is complete. ``max_ahead``: how many updates the
    generating weights may lag behind (0 = sync: the next batch waits for the update of the last).
    ``interrupt``: at each update every rollout loads the new weights at once and continues its
    in-flight responses under them (mixed versions). ``drain``: a rollout that learns of a newer
    version stops admitting prompts and pulls when its last response finishes (version-atomic).
    ``repack``: the manager consolidates long-tail rollouts of one version (periodic and after updates).
    ``admit_lag``: a draining mode keeps admitting prompts under its weights until the trainer is this
    many versions ahead (1: stop at the first newer version)."""

    name: str
    batched: bool
    max_ahead: int
    interrupt: bool
    drain: bool
    repack: bool
    admit_lag: int = 1


MODES: dict[Mode, ModeSpec] = {
    "sync": ModeSpec("sync", batched=True, max_ahead=0, interrupt=False, drain=False, repack=False),
    "one_step": ModeSpec("one_step", batched=True, max_ahead=1, interrupt=False, drain=False, repack=False),
    "partial": ModeSpec("partial", batched=False, max_ahead=0, interrupt=True, drain=False, repack=False),
    "laminar": ModeSpec("laminar", batched=False, max_ahead=0, interrupt=False, drain=True, repack=True),
}


@dataclass(frozen=True)
class DispatchPlan:
    """What the manager tells a rollout at its next call: ``pull`` the latest weights first (at least
    ``min_version``; -1: whatever the relay has), whether that pull interrupts active responses
    (``partial`` mode), and whether the rollout may start queued requests (``admitting``; False while
    it drains towards a newer version)."""

    pull: bool
    min_version: int
    interrupt: bool
    admitting: bool


def dispatch_plan(
    mode: ModeSpec,
    *,
    version: int,
    latest: int,
    active: int,
    queued: int,
    pending: bool,
    awaiting: int,
    batch_min_version: int = 0,
    parked: int = 0,
) -> DispatchPlan:
    """The mode's decision for one rollout (the real runtime's ``_dispatch`` and the simulator both
    call this). ``version``: the rollout's weights (-1: none loaded yet); ``latest``: the trainer's;
    ``pending``: work handed to it that it has not started; ``awaiting``: repacks on their way to it;
    ``parked``: of ``active``, episodes between turns that pin no weights (the turn rule).

    - a rollout with no weights pulls;
    - batched modes pull the batch's version once the rollout is empty;
    - ``interrupt``: pull as soon as a newer version exists, active responses continue under it;
    - ``drain``: pull only when nothing is in flight here but parked episodes (version-atomic per
      response, per turn for episodes); until then stop admitting."""
    pull, min_version, interrupt = False, -1, False
    if version < 0:
        pull = True
    elif mode.batched:
        if version < batch_min_version and active == 0 and queued == 0:
            pull, min_version = True, batch_min_version
    elif mode.interrupt:
        if version < latest:
            pull, interrupt = True, active > 0
    elif mode.drain:
        if version < latest and active == parked and not pending and not awaiting:
            pull, min_version = True, latest
    draining = mode.drain and latest - version >= mode.admit_lag and not pull
    return DispatchPlan(pull=pull, min_version=min_version, interrupt=interrupt, admitting=not draining)


def outstanding_responses(
    rollouts: Iterable, buffer: ExperienceBuffer, *, training: int = 0, new: int = 0
) -> int:
    """Responses admitted and not yet trained: the batch the trainer is updating on (``training``),
    what the buffer holds, what each rollout was handed (``assigned`` and ``pending_inject``) and
    ``new`` requests about to be handed over. The runtime and the simulator count the same way."""
    return training + buffer.n_held() + new + sum(len(x.assigned) + len(x.pending_inject) for x in rollouts)


def admission_room(
    max_staleness: int | None,
    *,
    latest: int,
    version: int,
    batch_groups: int,
    group_size: int,
    outstanding: int,
    retry: int = 0,
) -> int | None:
    """Flow control of the unbatched modes: how many more responses a rollout at ``version`` may start
    so that all ``outstanding`` work (``outstanding_responses``) can still be trained within
    ``max_staleness``. A response of version v is trainable in the updates the trainer takes at
    versions v .. v + max_staleness, one batch (``batch_groups`` x ``group_size``) each; admitting more
    only makes groups that go stale in the buffer and are generated again. The ``retry`` requests
    handed back (lost, stale) always go: they complete groups the buffer already holds. None: no bound.
    The count alone does not order the work: the trainer's ``staleness_gate`` keeps a slow old response
    from finishing after newer ones have filled the updates its bound allows."""
    if max_staleness is None:
        return None
    updates_left = max_staleness + 1 - max(0, latest - version)
    return max(retry, updates_left * batch_groups * group_size - outstanding)


def staleness_gate(
    ready: Sequence[tuple[int, int]],
    unfinished: Sequence[int],
    *,
    latest: int,
    max_staleness: int,
    batch_groups: int,
) -> list[int] | None:
    """The trainer's side of bounded staleness (unbatched modes): which ready groups the update at
    ``latest`` trains, or None: wait. ``ready``: (group_uid, version) of each ready group; ``unfinished``:
    for each other admitted group not yet trained, the lowest version it can end with (its finished
    responses' versions and its unfinished ones' lower bounds).

    The batch is the ``batch_groups`` ready groups of the oldest versions. A group of version v is
    trainable by the updates at versions v .. v + max_staleness, one batch each, so the update may go
    ahead only if, for every version k, the groups left of version <= k fit in the ``k + max_staleness
    - latest`` updates after it: in particular every group due now (k = latest - max_staleness) is in
    this batch. Otherwise the trainer waits for the older work to finish, whatever the rollouts' and
    the trainer's speeds (admission keeps the total within the same bound, so it always fits once
    everything has finished). Where even that would not fit (work a failure handed back late), waiting
    cannot help: the batch goes ahead and what goes stale is regenerated, as without the gate."""
    order = sorted(ready, key=lambda x: (x[1], x[0]))
    if len(order) < batch_groups:
        return None
    batch = [uid for uid, _ in order[:batch_groups]]
    left = [v for _, v in order[batch_groups:]] + list(unfinished)
    if _fits(left, latest, max_staleness, batch_groups):
        return batch
    everything = sorted([v for _, v in order] + list(unfinished))
    if not _fits(everything[batch_groups:], latest, max_staleness, batch_groups):
        return batch
    return None


def _fits(versions: Iterable[int], latest: int, max_staleness: int, batch_groups: int) -> bool:
    """Whether groups of these versions, left after the update at ``latest``, can all be trained in time."""
    return all(i + 1 <= (v + max_staleness - latest) * batch_groups for i, v in enumerate(sorted(versions)))


def may_open_batch(mode: ModeSpec, *, version: int, batch_idx: int, steps: int, closed_waiting: int) -> bool:
    """Batched modes: batch ``batch_idx`` (the groups of update ``batch_idx + 1``) may be issued once at
    most ``max_ahead`` closed batches wait for the trainer and the trainer has reached version
    ``batch_idx - max_ahead``; never past ``steps``."""
    if closed_waiting > mode.max_ahead:
        return False
    return version >= batch_idx - mode.max_ahead and batch_idx < steps


def batch_min_version(mode: ModeSpec, batch_idx: int) -> int:
    """The weight version a batched mode generates batch ``batch_idx`` with (rollouts pull it first)."""
    return max(0, batch_idx - mode.max_ahead)


def round_robin_groups(requests: Sequence[GenRequest], n_rollouts: int) -> list[list[GenRequest]]:
    """Batched modes: whole groups dealt round-robin over ``n_rollouts`` rollouts in ``group_uid``
    order; returns one request list per rollout."""
    by_group: dict[int, list[GenRequest]] = {}
    for q in requests:
        by_group.setdefault(q.group_uid, []).append(q)
    out: list[list[GenRequest]] = [[] for _ in range(max(1, n_rollouts))]
    for i, uid in enumerate(sorted(by_group)):
        out[i % len(out)].extend(by_group[uid])
    return out


# ----------------------------------------------------------------------------------------------- prompts
class PromptQueue:
    """Turns a prompt source (anything with ``take(n)``, ``observe(groups)`` and ``position``) into
    generation requests, ``group_size`` per prompt, each group under a new ``group_uid`` (a counter:
    the order prompts were issued in). Requeued requests (lost with a dead rollout, too stale, cut
    at a checkpoint) are handed out again before new prompts, with their original ``group_uid``."""

    def __init__(self, source, group_size: int):
        self.source = source
        self.group_size = group_size
        self.next_uid = 0
        self.retry: deque[GenRequest] = deque()
        self.issued_groups = 0

    def take_groups(self, n_groups: int) -> list[GenRequest]:
        """Fresh requests for ``n_groups`` new prompts (retries not included)."""
        out: list[GenRequest] = []
        for prompt in self.source.take(n_groups) if n_groups > 0 else []:
            uid = self.next_uid
            self.next_uid += 1
            self.issued_groups += 1
            out.extend(GenRequest(prompt=prompt, sample_idx=i, group_uid=uid) for i in range(self.group_size))
        return out

    def take(self, n_requests: int) -> list[GenRequest]:
        """Up to about ``n_requests`` requests: retries first, then whole new groups (a group is never
        split across calls, so the last group may overshoot by up to ``group_size - 1``)."""
        out: list[GenRequest] = []
        while self.retry and len(out) < n_requests:
            out.append(self.retry.popleft())
        missing = n_requests - len(out)
        if missing > 0:
            out.extend(self.take_groups(-(-missing // self.group_size)))
        return out

    def take_retries(self, n_requests: int) -> list[GenRequest]:
        """Up to ``n_requests`` of the requests handed back, first in line first."""
        return [self.retry.popleft() for _ in range(min(n_requests, len(self.retry)))]

    def requeue(self, requests: Iterable[GenRequest]) -> None:
        for r in sorted(requests, key=lambda r: (r.group_uid, r.sample_idx), reverse=True):
            self.retry.appendleft(r)

    def state(self) -> dict:
        return {
            "next_uid": self.next_uid,
            "issued_groups": self.issued_groups,
            "retry": [request_to_json(r) for r in self.retry],
        }

    def load_state(self, state: dict) -> None:
        self.next_uid = state["next_uid"]
        self.issued_groups = state["issued_groups"]
        self.retry = deque(request_from_json(r) for r in state["retry"])


# ----------------------------------------------------------------------------------------------- buffer
@dataclass
class BufferStats:
    staleness: Counter = field(default_factory=Counter)
    """trainer version at admission - oldest generating version in the group -> groups."""
    duplicates: int = 0
    stale_dropped: int = 0
    filtered: int = 0


class ExperienceBuffer:
    """Finished trajectories -> whole scored groups -> trainer batches.

    A group (``group_uid``) is complete when all ``group_size`` sample indices have arrived; it is
    scored then (``score(trajectories) -> ScoredGroup``) and, unless ``keep(group)`` rejects it
    (DAPO's dynamic sampling), queued for training. ``take`` hands out the oldest ready groups whose
    staleness (trainer version - oldest generating version) is within ``max_staleness`` (None: no
    bound); older ones are returned for requeueing. A group is trained at most once: a second
    trajectory for an index already held, or anything for a trained group, is counted and ignored."""

    def __init__(
        self,
        group_size: int,
        score: Callable[[list[Trajectory]], ScoredGroup],
        keep: Callable[[ScoredGroup], bool] | None = None,
        max_staleness: int | None = None,
    ):
        self.group_size = group_size
        self.score = score
        self.keep = keep or (lambda g: True)
        self.max_staleness = max_staleness
        self.partial: dict[int, dict[int, Trajectory]] = {}
        self.ready: OrderedDict[int, ScoredGroup] = OrderedDict()
        self.done: set[int] = set()
        self.stats = BufferStats()
        self.completed: list[tuple[int, ScoredGroup]] = []
        """Every completed group, kept or filtered, since the last ``pop_completed`` (the reward history)."""

    def add(self, traj: Trajectory) -> ScoredGroup | None:
        """Add one trajectory; returns the group it completed, if any."""
        uid = traj.group_uid
        slot = self.partial.setdefault(uid, {}) if uid not in self.done and uid not in self.ready else None
        if slot is None or traj.sample_idx in slot:
            self.stats.duplicates += 1
            return None
        slot[traj.sample_idx] = traj
        if len(slot) < self.group_size:
            return None
        del self.partial[uid]
        group = self.score([slot[i] for i in sorted(slot)])
        self.completed.append((uid, group))
        if self.keep(group):
            self.ready[uid] = group
        else:
            self.stats.filtered += 1
            self.done.add(uid)
        return group

    def pop_completed(self) -> list[tuple[int, ScoredGroup]]:
        out, self.completed = self.completed, []
        return out

    def n_ready(self) -> int:
        return len(self.ready)

    def n_held(self) -> int:
        """Trajectories held and not yet trained: of incomplete groups and of ready groups."""
        return sum(len(slot) for slot in self.partial.values()) + sum(
            len(g.trajectories) for g in self.ready.values()
        )

    @staticmethod
    def group_version(group: ScoredGroup) -> int:
        return min(t.version for t in group.trajectories)

    def take(
        self, n: int, trainer_version: int, *, full: bool = False
    ) -> tuple[list[tuple[int, ScoredGroup]], list[tuple[int, ScoredGroup]]]:
        """Up to ``n`` ready groups (oldest issued first) within the staleness bound, marked trained
        (with ``full``, none unless ``n`` are ready); and the groups dropped as too stale (the caller
        requeues their prompts)."""
        stale = self.drop_stale(trainer_version)
        if full and len(self.ready) < n:
            return [], stale
        out = []
        for uid in list(self.ready)[:n]:
            group = self.ready.pop(uid)
            self.stats.staleness[trainer_version - self.group_version(group)] += 1
            self.done.add(uid)
            out.append((uid, group))
        return out, stale

    def drop_stale(self, trainer_version: int) -> list[tuple[int, ScoredGroup]]:
        """The ready groups too stale to train at ``trainer_version``, taken out (the caller requeues
        their prompts)."""
        stale = []
        if self.max_staleness is not None:
            for uid in [
                u
                for u, g in self.ready.items()
                if trainer_version - self.group_version(g) > self.max_staleness
            ]:
                stale.append((uid, self.ready.pop(uid)))
                self.stats.stale_dropped += 1
        return stale

    def take_uids(self, uids: Iterable[int], n: int, trainer_version: int) -> list[tuple[int, ScoredGroup]]:
        """Batched modes: the first ``n`` ready groups among ``uids`` (in uid order), marked trained;
        the batch's other ready groups are closed untrained (a batch trains once, on its own groups)."""
        out = []
        for uid in sorted(uids):
            group = self.ready.pop(uid, None)
            if group is None:
                continue
            self.done.add(uid)
            if len(out) < n:
                self.stats.staleness[trainer_version - self.group_version(group)] += 1
                out.append((uid, group))
        return out

    def forget(self, uid: int) -> None:
        """A stale group is regenerated: its uid may complete again."""
        self.done.discard(uid)

    def state(self) -> dict:
        """Buffered work for a checkpoint: finished trajectories of incomplete groups, ready groups."""
        return {
            "partial": [trajectory_to_json(t) for slot in self.partial.values() for t in slot.values()],
            "ready": [trajectory_to_json(t) for g in self.ready.values() for t in g.trajectories],
            "done": sorted(self.done),
            "staleness": {str(k): v for k, v in self.stats.staleness.items()},
        }

    def load_state(self, state: dict) -> None:
        self.done = set(state["done"])
        self.stats.staleness = Counter({int(k): v for k, v in state["staleness"].items()})
        for t in state["partial"] + state["ready"]:  # re-adding re-scores the ready groups
            self.add(trajectory_from_json(t))
        self.completed = []


# ----------------------------------------------------------------------------------------------- repack
@dataclass(frozen=True)
class RolloutView:
    """What the manager knows of one rollout. ``prev_active``: its active count at the last look;
    ``pulling``: a call that loads new weights is in flight, so ``version`` is about to change and the
    rollout can receive no handed-over work of ``version``."""

    name: str
    version: int
    queued: int
    active: int
    prev_active: int
    capacity: int
    alive: bool = True
    pulling: bool = False


@dataclass(frozen=True)
class Move:
    src: str
    dst: str
    n: int


def is_repack_source(r: RolloutView, b_threshold: int) -> bool:
    """Laminar's long-tail test: nothing queued, some sequences active but falling, fewer than B."""
    return r.alive and r.queued == 0 and 0 < r.active < r.prev_active and r.active < b_threshold


def plan_repack(rollouts: Sequence[RolloutView], b_threshold: int) -> list[Move]:
    """Best fit within each weight version: sources sorted by footprint (fewest active first) each
    move to the rollout of the same version that ends fullest while staying within its capacity and
    ``b_threshold`` (the batch below which decoding is memory-bound, so adding sequences is nearly
    free). A rollout that received work is no longer a source; an emptied one receives nothing."""
    moves: list[Move] = []
    load = {r.name: r.active + r.queued for r in rollouts}
    emptied: set[str] = set()
    receivers: set[str] = set()
    by_version: dict[int, list[RolloutView]] = {}
    for r in rollouts:
        if r.alive:
            by_version.setdefault(r.version, []).append(r)
    for version in sorted(by_version):
        group = by_version[version]
        sources = sorted(
            (r for r in group if is_repack_source(r, b_threshold)), key=lambda r: (r.active, r.name)
        )
        for src in sources:
            if src.name in receivers or src.name in emptied:
                continue
            best, best_load = None, -1
            for dst in group:
                if dst.name == src.name or dst.name in emptied or dst.pulling:
                    continue
                after = load[dst.name] + load[src.name]
                if after <= min(dst.capacity, b_threshold) and after > best_load:
                    best, best_load = dst, after
            if best is None:
                continue
            moves.append(Move(src.name, best.name, load[src.name]))
            load[best.name] += load[src.name]
            load[src.name] = 0
            emptied.add(src.name)
            receivers.add(best.name)
    return moves


# ----------------------------------------------------------------------------------------------- relays
class RelayChain:
    """The order weights travel: master first, each relay forwarding to the next. ``node_of`` maps a
    relay to its node. A dead relay is cut out (its predecessor forwards to its successor); a
    rebuilt relay joins at the tail. ``relay_for(node)`` is the node's own relay when it is in the
    chain, else the master (bypass)."""

    def __init__(self, relays: Sequence[tuple[str, str]]):
        self.order: list[str] = [name for name, _ in relays]
        self.node_of: dict[str, str] = dict(relays)

    @property
    def master(self) -> str:
        return self.order[0]

    def next_of(self, name: str) -> str | None:
        i = self.order.index(name)
        return self.order[i + 1] if i + 1 < len(self.order) else None

    def links(self) -> list[tuple[str, str | None]]:
        return [(name, self.next_of(name)) for name in self.order]

    def remove(self, name: str) -> tuple[str | None, str | None]:
        """Cut ``name`` out; returns (predecessor, successor): the link to rewire."""
        i = self.order.index(name)
        pred = self.order[i - 1] if i > 0 else None
        succ = self.order[i + 1] if i + 1 < len(self.order) else None
        self.order.pop(i)
        if not self.order:
            raise RuntimeError("every relay is dead")
        return pred, succ

    def add(self, name: str, node: str) -> str | None:
        """Append a (rebuilt) relay; returns its predecessor, which must now forward to it."""
        pred = self.order[-1] if self.order else None
        self.order.append(name)
        self.node_of[name] = node
        return pred

    def relay_for(self, node: str) -> str:
        for name in self.order:
            if self.node_of.get(name) == node:
                return name
        return self.master


def retained_versions(latest: int, in_flight: Iterable[int], keep_recent: int = 2) -> set[int]:
    """Versions a relay must hold: the newest ``keep_recent`` and every version in-flight responses use."""
    return {v for v in range(max(0, latest - keep_recent + 1), latest + 1)} | set(in_flight)


# ----------------------------------------------------------------------------------------------- JSON
# A checkpoint's prompts, requests and trajectories (``rl_state.json``): the records as JSON-ready data
# through the one codec (``core.codec``), validated when read back. ``GenRequest.episode`` never goes
# to disk (a checkpoint requeues in-flight requests; their episodes start again).
PROMPT_CODEC: Codec[PromptItem] = Codec(PromptItem, name="prompt")
REQUEST_CODEC: Codec[GenRequest] = Codec(GenRequest, name="request", exclude={"episode"})
TRAJECTORY_CODEC: Codec[Trajectory] = Codec(Trajectory, name="trajectory")

prompt_to_json = PROMPT_CODEC.to_plain
prompt_from_json = PROMPT_CODEC.from_plain
request_to_json = REQUEST_CODEC.to_plain
request_from_json = REQUEST_CODEC.from_plain
trajectory_to_json = TRAJECTORY_CODEC.to_plain
trajectory_from_json = TRAJECTORY_CODEC.from_plain
