"""What enters and leaves the rollout pipeline under the staleness bound: how much work a rollout
may admit, and which ready groups the trainer may take.

``Admission`` is the rollout manager's component (``training.rl.manager``) for both sides of
``rl.max_staleness`` in the continuous modes: a rollout admits work within its free slots, the
back-pressure (``max_ahead_batches``) and the bound's room (``control.admission_room``); the trainer
takes a batch only when no older unfinished work could end too stale for it
(``control.staleness_gate``). Both reckon with ``bound``: the lowest version each response handed
out can end with.
"""

from __future__ import annotations

from collections import Counter

from generation.records import GenRequest, ScoredGroup
from training.rl import control
from training.rl.control import ExperienceBuffer, PromptQueue
from training.rl.rollout_state import RolloutState, request_key, request_of


class Admission:
    """Shares the manager's settings, prompt queue, experience buffer, rollout records and counts."""

    def __init__(
        self,
        settings,
        queue: PromptQueue,
        buffer: ExperienceBuffer,
        rollouts: dict[str, RolloutState],
        counts: Counter,
    ):
        self.s = settings
        self.queue, self.buffer, self.rollouts, self.counts = queue, buffer, rollouts, counts
        self.bound: dict[tuple[int, int], int] = {}
        """(group_uid, sample_idx) -> the lowest version the response handed out under that key can
        end with (its rollout's version when handed out; -1: unknown until that rollout's first
        weights): what the trainer's staleness gate (``control.staleness_gate``) reckons with."""

    def handed(self, r: RolloutState, submit: list[GenRequest], inject: list) -> None:
        """``r`` takes new requests ``submit`` (they end no older than its version) and handed-over
        partials ``inject`` (no older than theirs, or its own for a parked episode's -1)."""
        for q in submit:
            self.bound[request_key(q)] = r.version
        for p in inject:
            self.bound.setdefault(request_key(p.request), p.version if p.version >= 0 else r.version)

    def first_weights(self, r: RolloutState, version: int) -> None:
        """``r`` loaded its weights at ``version``: what it was handed before its first weights runs
        under these."""
        for key, v in self.bound.items():
            if v < 0 and key in r.assigned:
                self.bound[key] = version

    def forget(self, key: tuple[int, int]) -> None:
        """The response under ``key`` finished, or its request went back in line."""
        self.bound.pop(key, None)

    def trainable(self, version: int) -> tuple[list[tuple[int, ScoredGroup]], list]:
        """The continuous modes' next batch at trainer ``version`` (``[]`` when none is due) and the
        groups too stale to train (to regenerate)."""
        n = self.s.prompts_per_step
        if self.s.max_staleness is None:
            return self.buffer.take(n, version, full=True)
        stale, groups, uids = self.buffer.drop_stale(version), [], None
        if self.buffer.n_ready() >= n:
            uids = control.staleness_gate(
                [(u, ExperienceBuffer.group_version(g)) for u, g in self.buffer.ready.items()],
                self.unfinished_versions(version),
                latest=version,
                max_staleness=self.s.max_staleness,
                batch_groups=n,
            )
            if uids is None:  # older work must finish first
                self.counts["staleness_waits"] += 1
        if uids is not None:
            groups = self.buffer.take_uids(uids, n, version)
        return groups, stale

    def unfinished_versions(self, version: int) -> list[int]:
        """For each admitted group neither ready nor trained, the lowest version it can end with: the
        oldest of its finished responses and of its unfinished ones' bounds (``self.bound``; a request
        handed back and waiting goes to a rollout at the latest version, ``room``)."""
        waiting = version  # a handed-back request goes to a rollout at the latest version
        low: dict[int, int] = {}

        def see(uid: int, v: int) -> None:
            low[uid] = min(v, low.get(uid, v))

        for uid, slot in self.buffer.partial.items():
            for t in slot.values():
                see(uid, t.version)
        for r in self.rollouts.values():
            for key in list(r.assigned) + [request_key(request_of(p)) for p in r.pending_inject]:
                see(key[0], max(0, self.bound.get(key, waiting)))
        for q in self.queue.retry:
            see(q.group_uid, waiting)
        return [v for uid, v in low.items() if uid not in self.buffer.ready]

    def room(self, r: RolloutState, new: int, version: int, training: int, trained: int) -> tuple[int, int]:
        """How many handed-back requests and new groups rollout ``r`` may take besides ``new`` requests
        it is handed anyway, at trainer ``version`` with ``training`` responses in the update under way
        and ``trained`` groups trained: its free slots (new prompts come in whole groups, the last may
        overshoot them), within the back-pressure and the staleness bound's flow control
        (``control.admission_room``)."""
        free = self.s.capacity - (r.active + r.queued + new)
        cap = self.s.max_ahead_batches
        if cap > 0 and not self.queue.retry:
            ahead = self.queue.issued_groups - trained
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
            self.rollouts.values(), self.buffer, training=training, new=new
        )
        room = control.admission_room(
            self.s.max_staleness,
            latest=version,
            version=r.version,
            batch_groups=self.s.prompts_per_step,
            group_size=g,
            outstanding=outstanding + retry,
        )
        retries = min(retry, free) if r.version >= version else 0
        groups = min(-(-(free - retries) // g), max(0, room) // g) if free > retries else 0
        if retries + groups * g < free:
            self.counts["admission_limited"] += 1
        return retries, groups
