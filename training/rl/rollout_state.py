"""The rollout manager's record of each rollout, and the request keys its components share."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Iterable

from generation.records import GenRequest, Partial


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


def request_key(q: GenRequest) -> tuple[int, int]:
    """A request's identity: (group_uid, sample_idx)."""
    return q.group_uid, q.sample_idx


def request_of(item: Partial | GenRequest) -> GenRequest:
    """The request of a handed-over partial, or the request itself."""
    return item.request if isinstance(item, Partial) else item


def live_or_all(rollouts: Iterable[RolloutState]) -> list[RolloutState]:
    """The live rollouts, or all of them when none is alive (work waits for the first back)."""
    rollouts = list(rollouts)
    return [r for r in rollouts if r.alive] or rollouts
