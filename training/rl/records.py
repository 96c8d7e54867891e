"""Typed records of the RL system: what an optimizer step did and what every trainer, relay and
rollout actor replies to the driver. No string-keyed dict crosses a process boundary inside the
project; generation's own records (prompts, requests, trajectories) live in ``generation.records``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer step did; ``version`` is the trainer's weight version after the step."""

    kind: Literal["update_stats"]
    version: int
    loss: float
    grad_norm: float
    n_sequences: int
    n_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------------- actor replies
@dataclass(frozen=True)
class ActorInfo:
    """Any role's answer to ``ping``: who and where it is, and its process's CPU seconds so far.
    ``version``: the weights it holds (rollout, trainer; None before a trainer is built);
    ``versions``: what a relay holds; ``rank``: a trainer rank; ``idle_priority``: a rollout runs
    at SCHED_IDLE."""

    name: str
    pid: int
    node: str
    cpu_s: float
    version: int | None = None
    versions: tuple[int, ...] = ()
    rank: int | None = None
    idle_priority: bool = False


@dataclass(frozen=True)
class RolloutStatus:
    """A rollout engine's state after a call: its weights' version, sequences decoding (``active``)
    and waiting (``queued``) in at most ``capacity`` slots."""

    version: int
    active: int
    queued: int
    capacity: int
    admitting: bool = True

    @classmethod
    def of(cls, status: dict) -> RolloutStatus:
        """From an engine's protocol status (``generation.protocol``: a msgpack map on the worker's wire)."""
        return cls(
            version=int(status["version"]),
            active=int(status["active"]),
            queued=int(status["queued"]),
            capacity=int(status["capacity"]),
            admitting=bool(status.get("admitting", True)),
        )


@dataclass(frozen=True)
class PullResult:
    """A rollout's weight pull from its relay: ``ok`` with the ``version`` loaded, else ``error``."""

    ok: bool
    version: int = -1
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class StepReply:
    """A rollout's ``step``: the trajectories that finished, its status, the pull it made first (if
    asked), the seconds it decoded, and its process (a new pid: Ray restarted it between calls)."""

    finished: tuple
    status: RolloutStatus
    pulled: PullResult | None
    busy_s: float
    pid: int
    cpu_s: float


@dataclass(frozen=True)
class ExtractReply:
    """A repack source's ``extract``: its in-flight responses (``Partial``) and its queued requests."""

    partials: tuple
    queued: tuple
    status: RolloutStatus
    pid: int
    cpu_s: float


@dataclass(frozen=True)
class TrainReply:
    """The trainer's ``train``: the update's stats, its seconds, and the publish stall after it (wall
    and the trainer thread's CPU)."""

    stats: UpdateStats
    train_s: float
    publish_stall_s: float
    publish_cpu_s: float


@dataclass(frozen=True)
class Published:
    """A relay's answer to ``latest``/``get``: a weight version and the box (``[ObjectRef]``) holding it."""

    version: int
    box: list


# ------------------------------------------------------------------------------- manager orders
@dataclass(frozen=True)
class StepOrder:
    """The manager's order for a rollout's next ``step``: pull first (at least ``min_version``; -1:
    the relay's latest), whether it may start queued requests, the new requests and the handed-over
    partials it takes."""

    submit: tuple
    inject: tuple
    pull: bool
    min_version: int
    admitting: bool


@dataclass(frozen=True)
class ExtractOrder:
    """The manager's order to a repack source: hand every in-flight response to rollout ``dst``."""

    dst: str
