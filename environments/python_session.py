"""``python_session``: a Python session that keeps its variables across turns, run in the sandbox.

The policy calls the ``python`` tool (the call formats of ``environments.tool_use``: the text line
``python: x = 21``, or the chat template's ``<tool_call>`` with multi-line code); the observation is
what the new cell printed (on failure, how it ended and the end of its error). A cell sees every
variable, function and import the episode's earlier cells made: the episode's state is the list of
cells that ran (``{"cells": [...]}``, plain data), and each call replays them, their output
discarded, and then the new cell in one fresh ``environments.sandbox.run``. No process outlives a
call, so nothing of an episode lives outside its state: it moves with the episode through repack,
hand-over and checkpoints, and a receiving rollout continues the session exactly. A cell that fails
(an exception, a limit) is not kept: the session stays as it was before it. The cost of a call grows
with the cells before it (``Params.max_cells`` bounds them); code that is not deterministic (time,
randomness) may replay to other values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from environments import sandbox
from environments.base import State, StepResult, Turn
from environments.tool_use import call_format
from environments.tools import code_of, observation
from generation.records import PromptItem

SESSION_MAIN = """import io, json, sys
cells = json.load(open("cells.json"))
g = {"__name__": "__main__", "__builtins__": __builtins__}
out, err = sys.stdout, sys.stderr
for i, cell in enumerate(cells):
    last = i == len(cells) - 1
    if not last:
        sys.stdout = sys.stderr = io.StringIO()
    try:
        exec(compile(cell, f"<cell {i + 1}>", "exec"), g)
    except BaseException as e:
        if last:
            sys.stdout, sys.stderr = out, err
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
    finally:
        sys.stdout, sys.stderr = out, err
"""
"""The sandbox's ``main.py``: the cells of ``cells.json`` in one namespace, every one but the last
silenced; the last one's exception is its error line (exit status 1)."""


@dataclass(frozen=True)
class Params:
    """``max_cells``: cells a session keeps (a call past them is refused); ``max_chars``: the longest
    observation (the middle of a longer one is cut); ``timeout_s``: the wall limit of one call (its
    replay and the new cell)."""

    max_cells: int = 8
    max_chars: int = 2000
    timeout_s: float = 10.0

    def __post_init__(self):
        if self.max_cells < 1 or self.max_chars < 40 or not self.timeout_s > 0:
            raise ValueError("max_cells must be >= 1, max_chars >= 40 and timeout_s > 0")


@dataclass(frozen=True)
class SessionTool:
    """The ``python`` tool as the call formats see it (its name and description)."""

    name: str = "python"
    description: str = (
        "Run Python 3 code in this episode's session: variables, functions and imports of earlier "
        'calls stay defined. Returns what the code prints. Arguments: the code, or {"code": "..."}.'
    )


class PythonSession:
    """See the module docstring."""

    name = "python_session"
    Params = Params

    def __init__(self, tokenizer, params: Params | None = None, env=None, sandbox=None):
        self.params = params if params is not None else Params()
        self.sandbox = sandbox
        self.tool = SessionTool()
        self.format = call_format(tokenizer, [self.tool], getattr(env, "tool_format", "auto"))

    def reset(self, prompt: PromptItem) -> tuple[tuple[int, ...], State]:
        return self.format.reset(prompt), {"cells": []}

    def run(self, cells: list[str]) -> sandbox.SandboxResult:
        """The session's ``cells`` replayed in one fresh sandbox run; the last one's output is the result."""
        files = {"cells.json": json.dumps(cells)}
        return sandbox.run(SESSION_MAIN, files=files, timeout_s=self.params.timeout_s, config=self.sandbox)

    def step(self, state: State, turn: Turn) -> StepResult:
        call = self.format.parse(turn.text)
        if call is None:
            return StepResult(done=True, reason="answer", state=state)
        cells = list(state["cells"])
        if call.name != self.tool.name:
            return self._error(f"no tool {call.name!r}", state)
        if len(cells) >= self.params.max_cells:
            return self._error(f"the session is full ({self.params.max_cells} cells)", state)
        result = self.run(cells + [code_of(call.arguments)])
        text = observation(result, self.params.max_chars).rstrip("\n")
        kept = {"cells": cells + [code_of(call.arguments)]} if result.ok else state
        obs = self.format.observation(text, not result.ok)
        return StepResult(obs, tool_call=True, tool_error=not result.ok, state=kept)

    def _error(self, why: str, state: State) -> StepResult:
        return StepResult(self.format.observation(why, True), tool_call=True, tool_error=True, state=state)

    def close(self) -> None:
        pass
