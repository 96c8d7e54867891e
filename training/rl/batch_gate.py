"""The batch gate of the batched modes (``sync``, ``one_step``): batches issued whole, closed when
every group is generated, handed to the trainer in order.

Batch b holds the groups of update b+1. It opens once batch b-1 is fully generated and the trainer
has reached the version the mode needs (``control.may_open_batch``); its requests go round robin to
the live rollouts, which pull that version first. With dynamic sampling a batch that kept too few
groups samples further rounds before it closes. The rollout manager (``training.rl.manager``) owns
one gate and asks it for the next closed batch when the trainer is free.
"""

from __future__ import annotations

from collections import Counter

from training.rl import control
from training.rl.control import ExperienceBuffer, PromptQueue
from training.rl.rollout_state import RolloutState, live_or_all

EMPTY_BATCH_LIMIT = 10
"""Batches in a row that dynamic sampling may empty before the run stops with an error (else a
prompt pool without signal would sample forever)."""


class BatchGate:
    """The open batch and the closed ones waiting for the trainer. It shares the manager's prompt
    queue, experience buffer, prompt source, ``outside``, rollout records and counts."""

    def __init__(
        self,
        settings,
        queue: PromptQueue,
        buffer: ExperienceBuffer,
        source,
        outside,
        rollouts: dict[str, RolloutState],
        counts: Counter,
    ):
        self.s, self.mode = settings, settings.mode
        self.queue, self.buffer, self.source, self.outside = queue, buffer, source, outside
        self.rollouts, self.counts = rollouts, counts
        self.idx = 0
        """The next batch to issue (batch b: the groups of update b+1)."""
        self.open = False
        self.uids: set[int] = set()
        self.left: set[int] = set()
        """Groups of the open batch not yet complete."""
        self.rounds = 0
        self.min_version = 0
        """The version the open batch's rollouts pull first."""
        self.closed: list[set[int]] = []
        self.closed_rounds: list[int] = []
        """The sampling rounds of each closed batch."""
        self.of: dict[int, int] = {}
        """group_uid -> the batch it was issued in."""
        self.empty_streak = 0
        """Batches in a row whose every group dynamic sampling dropped (``EMPTY_BATCH_LIMIT``)."""

    def maybe_open(self, version: int) -> str:
        """Close the open batch when it is complete (or sample a further round), else open the next
        one when the trainer at ``version`` is far enough. Returns "closed" when the open batch closed,
        "issued" when work was handed out, else ""."""
        if self.open:
            if not self.uids or self.left:
                return ""
            kept = sum(1 for u in self.uids if u in self.buffer.ready)
            if kept < self.s.prompts_per_step and self.rounds < self.s.max_sampling_rounds:
                self.counts["extra_rounds"] += 1
                need = self.source.round_size(
                    self.s.prompts_per_step - kept,
                    self.buffer.stats.filtered / max(1, len(self.uids)),
                    self.s.prompts_per_step,
                )
                self._issue(need)
                return "issued"
            self.open = False
            self.closed.append(set(self.uids))
            self.closed_rounds.append(self.rounds)
            return "closed"
        if not control.may_open_batch(
            self.mode,
            version=version,
            batch_idx=self.idx,
            steps=self.s.steps,
            closed_waiting=len(self.closed),
        ):
            return ""  # the trainer has not caught up, or every batch is issued
        self.open = True
        self.rounds = 0
        self.uids, self.left = set(), set()
        self.min_version = control.batch_min_version(self.mode, self.idx)
        self.idx += 1
        self._issue(self.s.prompts_per_step)
        return "issued"

    def _issue(self, n_groups: int) -> None:
        self.rounds += 1
        self.outside.refresh()
        reqs = list(self.queue.retry) + self.queue.take_groups(n_groups)
        self.queue.retry.clear()
        uids = {q.group_uid for q in reqs}
        self.uids |= uids
        self.left |= uids
        for uid in uids:
            self.of.setdefault(uid, self.idx - 1)
        alive = live_or_all(self.rollouts.values())
        # whole groups round-robin over rollouts; fresh requests also ride in pending_inject (GenRequest)
        for r, share in zip(alive, control.round_robin_groups(reqs, len(alive))):
            r.pending_inject.extend(share)
            if share:
                self.outside.poke(r.name)

    def take(self, version: int) -> tuple[list, int]:
        """The next closed batch's groups that the buffer kept (at least one batch is closed), and
        the sampling rounds it took. A batch dynamic sampling emptied gives no update: its index
        repeats, and ``EMPTY_BATCH_LIMIT`` of them in a row stop the run with an error."""
        uids = self.closed.pop(0)
        rounds = self.closed_rounds.pop(0)
        groups = self.buffer.take_uids(uids, self.s.prompts_per_step, version)
        if groups:
            self.empty_streak = 0
            return groups, rounds
        self.counts["empty_batches"] += 1
        self.empty_streak += 1
        self.idx -= 1
        if self.empty_streak >= EMPTY_BATCH_LIMIT:
            raise RuntimeError(
                f"dynamic sampling kept no group in {self.empty_streak} batches in a row (every "
                "group's responses were all right or all wrong, in "
                f"{self.s.max_sampling_rounds} rounds each): "
                "the prompts carry no signal for this policy; select harder or easier prompts, raise "
                "rl.max_sampling_rounds, or set rl.dynamic_sampling=false"
            )
        return groups, rounds
