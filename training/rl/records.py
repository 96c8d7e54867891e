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
