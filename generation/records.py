"""Typed records of generation: prompts, requests, sampled responses (whole, partial, scored) and
published weights. Curation, evaluation and RL all use them; the same records travel between Ray
actors and through the rollout protocol, so they hold plain Python values and numpy arrays, never
tensors tied to a device or a DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class PromptItem:
    """One training or evaluation prompt. ``prompt_tokens`` start with BOS when the tokenizer has one."""

    prompt_id: str
    text: str
    answer: str
    prompt_tokens: tuple[int, ...]
    level: int | None = None


@dataclass(frozen=True)
class GenRequest:
    """Generate one response to ``prompt`` (the ``sample_idx``-th of its group)."""

    prompt: PromptItem
    sample_idx: int
    group_uid: int = 0
    """Which issue of ``prompt`` this request belongs to (the prompt queue's position when it was
    drawn): the experience buffer assembles groups by it, so a prompt seen in two epochs forms two groups."""
    episode: object = field(default=None, compare=False)
    """A multi-turn episode so far (``environments.episodes.Episode``: its tokens, counts and the
    environment's state), carried when an in-flight episode moves between rollouts; None for a fresh
    request. Opaque to generation."""


@dataclass(frozen=True)
class Partial:
    """An in-flight response handed from one rollout to another (repack, interrupt, or a failure
    re-queue): the tokens sampled so far with their behaviour log-probs. The receiver continues it by
    re-prefilling prompt + tokens. ``version`` is the weight version that sampled the first token
    (and, outside ``partial`` mode, every token); ``entropy_sum`` sums the per-token entropies."""

    request: GenRequest
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    version: int
    entropy_sum: float = 0.0


@dataclass(frozen=True)
class Trajectory:
    """One sampled response. Invariant: ``len(response_tokens) == len(behaviour_logprobs)``; every
    token was sampled by weight ``version`` and its behaviour log-prob was recorded at sampling time
    (temperature-scaled distribution). ``finished`` is False when generation hit the length cap."""

    kind: Literal["trajectory"]
    prompt: PromptItem
    sample_idx: int
    response_tokens: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    version: int
    finished: bool
    text: str
    mean_entropy: float = float("nan")
    """Mean full-vocabulary entropy (nats) of the sampling distribution over the response's tokens."""
    group_uid: int = 0
    """The request's ``group_uid`` (see ``GenRequest``)."""
    last_version: int = -1
    """The version that sampled the last token; equals ``version`` except in ``partial`` mode, where a
    response interrupted by an update continues under newer weights (-1: same as ``version``)."""
    loss_mask: tuple[int, ...] = ()
    """Multi-turn episodes (``environments``): 1 on the policy's tokens, 0 on observation tokens (tool
    output and chat-template glue, appended as tokens, never sampled), ``len(response_tokens)`` long;
    an observation token's behaviour log-prob is a 0.0 placeholder. Empty: every token is the
    policy's (a single-turn response)."""
    turns: int = 1
    """Policy turns in the episode."""
    tool_calls: int = 0
    tool_errors: int = 0
    """Tool calls that returned an error observation (a bad expression, a timeout)."""
    end_reason: str = ""
    """Why a multi-turn episode ended: ``answer`` (a turn without a tool call), ``max_turns``,
    ``max_tokens``, ``length`` (a turn hit the length cap), ``tool_timeout``, ``env_error``; empty for
    a single-turn response."""
    env_state: object = field(default=None, hash=False)
    """A multi-turn episode's environment state at its end (``environments.base.State``: plain data,
    what its last ``step`` returned, or ``reset``'s); None for a single-turn response or an environment
    without state. It travels with the trajectory (Ray, checkpoints as JSON)."""

    def policy_mask(self) -> tuple[int, ...]:
        """``loss_mask``, or all ones for a single-turn response."""
        return self.loss_mask or (1,) * len(self.response_tokens)

    def longest_turn(self) -> int:
        """The tokens of the longest policy turn (the longest run of ones in ``loss_mask``; a single-turn
        response: all its tokens): the length the generation limit, one turn's cap, bounds, which the
        length reward terms (DAPO's overlong, cosine length) judge. An episode's whole token count
        counts observations and every turn, and passes the limit without any turn nearing it."""
        if not self.loss_mask:
            return len(self.response_tokens)
        longest = run = 0
        for m in self.loss_mask:
            run = run + 1 if m else 0
            longest = max(longest, run)
        return longest


@dataclass(frozen=True)
class ScoredGroup:
    """All responses to one prompt with their rewards. Invariant: ``len(rewards) == len(trajectories)``,
    and so has each ``terms`` entry (reward component name -> its unweighted score per response;
    ``rewards`` is their weighted total, ``correct`` the correctness verdict)."""

    kind: Literal["scored_group"]
    prompt_id: str
    trajectories: tuple[Trajectory, ...]
    rewards: tuple[float, ...]
    correct: tuple[bool, ...]
    terms: dict[str, tuple[float, ...]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    """Reward component name -> responses that got its fallback score."""


@dataclass(frozen=True)
class WeightsUpdate:
    """A published weight version: parameter name -> numpy array (object-store friendly)."""

    kind: Literal["weights_update"]
    version: int
    state: dict[str, np.ndarray]
