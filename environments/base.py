"""The environment interface: what an episode asks of its environment, turn by turn.

An episode starts from a prompt (``reset``: the tokens the policy conditions on first); after every
policy turn ``step`` reads the turn's text and answers with observation tokens (a tool's result,
rendered once and appended as tokens) or says the episode is done. ``environments.episodes`` runs
episodes on a generation engine; docs/environments.md has the rules and an example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from generation.records import PromptItem


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one policy turn. ``done``: the episode ends here (``observation``
    is then empty); else ``observation`` holds the token ids appended after the turn, before the
    policy's next turn. ``tool_call``: the turn called a tool; ``tool_error``: the call failed (its
    error is in the observation). ``reason``: why a done episode ended (``answer`` when the policy
    answered). ``reward``: components the environment contributes (name -> score)."""

    observation: tuple[int, ...] = ()
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False
    reason: str = ""
    reward: dict[str, float] | None = None


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
    """One environment, shared by every episode of a rollout (so ``step`` is a pure function of the
    turn: an episode's state travels with the episode, not in the environment, and ``step`` runs in
    a thread pool, several at once)."""

    name: str

    def reset(self, prompt: PromptItem) -> tuple[int, ...]:
        """The tokens the policy's first turn conditions on (usually ``prompt.prompt_tokens``)."""
        ...

    def step(self, turn_text: str) -> StepResult:
        """The environment's answer to a policy turn whose decoded text is ``turn_text``."""
        ...

    def close(self) -> None: ...


class SingleTurn:
    """Today's task as an environment: the policy's one turn is its answer. The episode runner is
    never put around the engine for it (``environments.registry.wrap_engine`` returns the engine),
    so the default run samples exactly as before; this class states the one-turn case."""

    name = "single_turn"

    def reset(self, prompt: PromptItem) -> tuple[int, ...]:
        return prompt.prompt_tokens

    def step(self, turn_text: str) -> StepResult:
        return StepResult(done=True, reason="answer")

    def close(self) -> None:
        pass
