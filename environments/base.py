"""The environment interface: what an episode asks of its environment, turn by turn.

An episode starts from a prompt: ``reset(prompt) -> (tokens, state)`` gives the tokens the policy
conditions on first and the episode's initial state. After every policy turn
``step(state, turn) -> StepResult`` reads the episode's state and the turn (its text and token ids)
and answers with observation tokens (a tool's result, rendered once and appended as tokens) and the
episode's new state, or says the episode is done. The environment object is shared by every episode
of a rollout and ``step`` runs in a thread pool, several at once: everything an episode remembers is
in its state, which travels with the episode (repack, hand-over, checkpoints), never in the
environment. So the state is plain data (:func:`plain_state`): it crosses processes and goes into
checkpoints as JSON, never pickled. ``environments.episodes`` runs episodes on a generation engine;
docs/environments.md has the rules, an example and the migration from ``step(turn_text)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from generation.records import PromptItem

State = Any
"""An episode's state: plain data only (dicts with string keys, lists, str, int, finite float, bool,
None); tuples are kept as lists, as JSON would."""

MAX_STATE_DEPTH = 64


class StateError(ValueError):
    """An environment's state that is not plain data; one line naming the environment and where."""


class InterfaceError(ValueError):
    """An environment that breaks the interface (``reset`` or ``step`` returning the wrong thing); one
    line naming the environment."""


@dataclass(frozen=True)
class Turn:
    """A finished policy turn: its decoded ``text`` and the ``tokens`` the policy sampled (ending with
    the end-of-turn token when the turn ended on it), with their behaviour ``logprobs`` (empty when
    not known)."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one policy turn. ``done``: the episode ends here (``observation``
    is then empty); else ``observation`` holds the token ids appended after the turn, before the
    policy's next turn. ``state``: the episode's state after this turn (what the next ``step`` gets;
    plain data; None for an environment without state). ``tool_call``: the turn called a tool;
    ``tool_error``: the call failed (its error is in the observation). ``reason``: why a done
    episode ended (``answer`` when the policy answered). ``reward``: components the environment
    contributes (name -> score)."""

    observation: tuple[int, ...] = ()
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False
    reason: str = ""
    reward: dict[str, float] | None = None
    state: State = None


def plain_state(env_name: str, state: State) -> State:
    """A fresh copy of ``state`` as plain data (tuples become lists), or a :class:`StateError` naming
    the environment and the first value that is not plain data (a set, an object, a non-string key,
    a NaN). The copy is what the episode keeps: a ``step`` that mutates the state it was given never
    changes an episode's stored state."""
    return _plain(env_name, state, "state", 0)


def _plain(env_name: str, value: Any, where: str, depth: int) -> Any:
    if depth > MAX_STATE_DEPTH:
        raise StateError(
            f"environment {env_name!r}: its state nests deeper than {MAX_STATE_DEPTH} at {where}"
        )
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise StateError(
                f"environment {env_name!r}: {where} is {value}, not a finite number (JSON has none)"
            )
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(env_name, v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise StateError(
                    f"environment {env_name!r}: {where} has the key {k!r} ({type(k).__name__}); state "
                    "keys must be strings (JSON)"
                )
            out[k] = _plain(env_name, v, f"{where}[{k!r}]", depth + 1)
        return out
    raise StateError(
        f"environment {env_name!r}: {where} is a {type(value).__name__}; an episode's state must be plain "
        "data (dict, list, str, int, float, bool, None) so it can cross processes and go into checkpoints"
    )


def reset_result(env_name: str, result: Any) -> tuple[tuple[int, ...], State]:
    """``reset``'s ``(tokens, state)`` checked: the tokens as a tuple of ints, the state as plain data.
    An environment still written for ``reset(prompt) -> tokens`` gets an :class:`InterfaceError`."""
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    if not pair or isinstance(result[0], (int, str)) or not hasattr(result[0], "__iter__"):
        raise InterfaceError(
            f"environment {env_name!r}: reset(prompt) must return (tokens, state), got "
            f"{type(result).__name__} {str(result)[:60]!r}; one written for reset(prompt) -> tokens "
            "returns (tokens, None) now (docs/environments.md, 'Migrating')"
        )
    return tuple(int(t) for t in result[0]), plain_state(env_name, result[1])


def step_result(env_name: str, result: Any) -> StepResult:
    """``step``'s answer checked: a :class:`StepResult`, its state replaced by a plain-data copy."""
    if not isinstance(result, StepResult):
        raise InterfaceError(
            f"environment {env_name!r}: step(state, turn) must return a StepResult, "
            f"got {type(result).__name__}"
        )
    if result.state is None:
        return result
    return dataclasses.replace(result, state=plain_state(env_name, result.state))


@runtime_checkable
class Tool(Protocol):
    """A tool the policy may call: ``arguments`` is the call's argument text, the result is text
    (raise ``ToolError`` for a bad call: the policy sees the message)."""

    name: str
    description: str

    def __call__(self, arguments: str) -> str: ...


class ToolError(Exception):
    """A tool call the tool refuses (bad arguments); its message becomes the observation."""


@runtime_checkable
class Environment(Protocol):
    """One environment, shared by every episode of a rollout and stateless across them: an episode's
    state is the ``state`` ``reset`` starts and each ``step`` returns (plain data), carried by the
    episode; ``step`` runs in a thread pool, several at once."""

    name: str

    def reset(self, prompt: PromptItem) -> tuple[Sequence[int], State]:
        """The tokens the policy's first turn conditions on (usually ``prompt.prompt_tokens``) and the
        episode's initial state."""
        ...

    def step(self, state: State, turn: Turn) -> StepResult:
        """The environment's answer to a finished policy ``turn`` of an episode in ``state``; the
        result's ``state`` is the episode's next."""
        ...

    def close(self) -> None: ...


class SingleTurn:
    """Today's task as an environment: the policy's one turn is its answer. The episode runner is
    never put around the engine for it (``environments.registry.wrap_engine`` returns the engine),
    so the default run samples exactly as before; this class states the one-turn case."""

    name = "single_turn"

    def __init__(self, tokenizer=None, params=None, env=None):
        pass

    def reset(self, prompt: PromptItem) -> tuple[tuple[int, ...], State]:
        return prompt.prompt_tokens, None

    def step(self, state: State, turn: Turn) -> StepResult:
        return StepResult(done=True, reason="answer")

    def close(self) -> None:
        pass
