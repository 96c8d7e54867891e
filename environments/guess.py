"""``guess``: a multi-turn guessing game, the built-in that shows an episode's state.

The secret is the prompt's answer (an integer: the arithmetic task's answers work as they are). Each
policy turn guesses with its last number (``#### 41`` or just ``41``). A right guess ends the episode
(reason ``answer``: the reward layer then judges the episode's last answer, which is the secret); a
wrong one is answered with what every guess so far has shown, not only this one:
``\\n= higher, above 41, below 60\\n`` (the secret is above the highest guess below it and below the
lowest guess above it, when the game started with ``Params.low`` / ``Params.high`` those bound it), a
guess outside that window is also told ``already out``, and a repeated guess gets
``\\n= again 41, higher, above 41, below 60\\n`` as a tool error. A turn without a number ends the
episode (it gave up).

The state is ``{"secret": S, "guesses": [...]}``: plain data the episode carries through repack,
hand-over and checkpoints; the environment object holds nothing of an episode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from environments.base import State, StepResult, Turn
from generation.records import PromptItem

NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Params:
    """``low`` / ``high``: bounds of the secret the feedback may name before any guess passes them
    (None: unbounded)."""

    low: int | None = None
    high: int | None = None

    def __post_init__(self):
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low={self.low} is above high={self.high}")


def secret_of(prompt: PromptItem) -> int | None:
    """The prompt's answer as the secret (its last integer: ``#### 42`` and ``42`` give 42); None when
    the answer has no integer (the episode then ends at its first turn, judged as a single turn)."""
    found = NUMBER.findall(str(prompt.answer))
    return int(found[-1]) if found else None


def guess_of(text: str) -> int | None:
    """A turn's guess: its last integer (None: the turn names no number)."""
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


def window(
    secret: int, guesses: list[int], low: int | None, high: int | None
) -> tuple[int | None, int | None]:
    """What the guesses so far have shown: the secret is above the first value and below the second
    (None: no bound yet). ``low``/``high`` bound it inclusively, so they start the window one out."""
    below = [g for g in guesses if g < secret] + ([low - 1] if low is not None else [])
    above = [g for g in guesses if g > secret] + ([high + 1] if high is not None else [])
    return (max(below) if below else None), (min(above) if above else None)


def feedback(secret: int, guesses: list[int], low: int | None = None, high: int | None = None) -> str:
    """The answer to the last of ``guesses`` (all wrong ones so far, the last included), from all of
    them: the direction, the window they leave, ``already out`` for a guess an earlier one excluded."""
    last, earlier = guesses[-1], guesses[:-1]
    before = window(secret, earlier, low, high)
    out = (before[0] is not None and last <= before[0]) or (before[1] is not None and last >= before[1])
    lo, hi = window(secret, guesses, low, high)
    parts = ["higher" if last < secret else "lower"]
    parts += [f"above {lo}"] if lo is not None else []
    parts += [f"below {hi}"] if hi is not None else []
    text = ", ".join(parts)
    if last in earlier:
        return f"again {last}, {text}"
    return f"already out, {text}" if out else text


class Guess:
    """The guessing game (see the module docstring): stateless itself, its episodes' guesses in their
    state."""

    name = "guess"
    Params = Params

    def __init__(self, tokenizer, params: Params | None = None, env=None):
        self.tokenizer = tokenizer
        self.params = params if params is not None else Params()

    def reset(self, prompt: PromptItem) -> tuple[tuple[int, ...], State]:
        return prompt.prompt_tokens, {"secret": secret_of(prompt), "guesses": []}

    def step(self, state: State, turn: Turn) -> StepResult:
        guess = guess_of(turn.text)
        if guess is None or state["secret"] is None:
            return StepResult(done=True, reason="answer", state=state)  # no number: it stopped guessing
        guesses = state["guesses"] + [guess]
        new = {"secret": state["secret"], "guesses": guesses}
        if guess == state["secret"]:
            return StepResult(done=True, reason="answer", state=new)
        text = feedback(state["secret"], guesses, self.params.low, self.params.high)
        ids = self.tokenizer(f"\n= {text}\n", add_special_tokens=False)["input_ids"]
        return StepResult(tuple(ids), tool_call=True, tool_error=guess in state["guesses"], state=new)

    def close(self) -> None:
        pass
