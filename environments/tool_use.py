"""Tool-use environments: a turn that ends with a tool call gets the tool's result as observation
tokens; a turn without one is the answer. Two call formats (docs/environments.md):

- ``text`` (every tokenizer; the only one of the tiny character tokenizer): the turn's last line is
  ``NAME: ARGUMENTS`` (``calc: 3+4-2``); the observation is ``\\n= RESULT\\n`` (``\\n= error: WHY\\n``).
- ``chat_template`` (a tokenizer whose template takes ``tools=``): the prompt is rendered with the
  tools' schemas, a call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` and the
  observation is the template's tool message plus the next assistant header, taken as the tokens
  the template adds after the assistant turn's end token: rendered once, never re-rendered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from environments.base import StepResult, Tool, ToolError, Turn
from generation.records import PromptItem


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str


class TextFormat:
    """The line format: ``NAME: ARGUMENTS`` as the turn's last line; observation ``\\n= RESULT\\n``."""

    name = "text"

    def __init__(self, tokenizer, tools: Sequence[Tool]):
        self.tokenizer = tokenizer
        names = "|".join(re.escape(t.name) for t in tools)
        self._call = re.compile(rf"(?:^|\n)\s*({names}):[ \t]*([^\n]*)\s*$")

    def reset(self, prompt: PromptItem) -> tuple[int, ...]:
        return prompt.prompt_tokens

    def parse(self, turn_text: str) -> ToolCall | None:
        m = self._call.search(turn_text)
        return ToolCall(m.group(1), m.group(2).strip()) if m else None

    def call_text(self, call: ToolCall) -> str:
        return f"{call.name}: {call.arguments}"

    def observation(self, result: str, error: bool) -> tuple[int, ...]:
        text = f"\n= error: {result}\n" if error else f"\n= {result}\n"
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def tool_schema(tool: Tool) -> dict:
    """A tool's JSON schema for a chat template's ``tools=``: one string argument, ``input``."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": {
                "type": "object",
                "properties": {"input": {"type": "string", "description": "the tool's input"}},
                "required": ["input"],
            },
        },
    }


class ChatTemplateFormat:
    """The tokenizer's chat template with ``tools=`` (see the module docstring)."""

    name = "chat_template"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def __init__(self, tokenizer, tools: Sequence[Tool]):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "env.tool_format=chat_template needs a tokenizer with a chat template; this one has "
                "none: set env.tool_format=text (or auto)"
            )
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the chat-template tool format needs a tokenizer with an end-of-turn (EOS) token"
            )
        self.tokenizer = tokenizer
        self.schemas = [tool_schema(t) for t in tools]

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, tools=self.schemas, add_generation_prompt=generation_prompt, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def reset(self, prompt: PromptItem) -> tuple[int, ...]:
        return tuple(self._render([{"role": "user", "content": prompt.text}], True))

    def parse(self, turn_text: str) -> ToolCall | None:
        m = self._CALL.search(turn_text)
        if not m:
            return None
        try:
            call = json.loads(m.group(1))
            name, args = str(call["name"]), call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return ToolCall("", m.group(1))  # a malformed call: the tool lookup answers with an error
        if isinstance(args, dict):
            args = str(args["input"]) if "input" in args else json.dumps(args)
        return ToolCall(name, str(args))

    def call_text(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": {"input": call.arguments}})
        return f"<tool_call>{body}</tool_call>"

    def observation(self, result: str, error: bool) -> tuple[int, ...]:
        """The tokens the template puts after an assistant turn's end token: the tool message and
        the next assistant header (the difference of two renderings, cut at the end token)."""
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        before = self._render(turn, False)
        content = f"error: {result}" if error else result
        after = self._render(turn + [{"role": "tool", "content": content}], True)
        eos = self.tokenizer.eos_token_id
        cut = max(i for i, t in enumerate(before) if t == eos) + 1
        if after[:cut] != before[:cut]:
            raise ValueError(
                "the chat template renders an earlier turn differently once a tool message follows"
            )
        return tuple(after[cut:])


FORMATS = {"text": TextFormat, "chat_template": ChatTemplateFormat}


def call_format(tokenizer, tools: Sequence[Tool], choice: str):
    """The call format ``choice`` (``auto``: the chat template where the tokenizer has one)."""
    if choice == "auto":
        choice = "chat_template" if getattr(tokenizer, "chat_template", None) else "text"
    return FORMATS[choice](tokenizer, tools)


class ToolEnvironment:
    """An environment whose policy may call ``tools`` (``environments.base.Environment``). Stateless:
    a call's answer depends on its turn alone, so every episode's state is None."""

    def __init__(self, name: str, tools: Sequence[Tool], tokenizer, tool_format: str = "auto"):
        self.name = name
        self.tools = {t.name: t for t in tools}
        self.format = call_format(tokenizer, tools, tool_format)

    def reset(self, prompt: PromptItem) -> tuple[tuple[int, ...], None]:
        return self.format.reset(prompt), None  # a tool call depends on its turn alone: no state

    def step(self, state: None, turn: Turn) -> StepResult:
        call = self.format.parse(turn.text)
        if call is None:
            return StepResult(done=True, reason="answer")
        tool = self.tools.get(call.name)
        try:
            if tool is None:
                raise ToolError(f"no tool {call.name!r}")
            result, error = tool(call.arguments), False
        except ToolError as e:
            result, error = str(e), True
        return StepResult(self.format.observation(result, error), tool_call=True, tool_error=error)

    def demonstration(self, call: ToolCall, answer: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A two-turn episode to imitate (warm-up SFT): the turn that makes ``call``, the tool's real
        result as the observation, then the turn ``answer``; (tokens, loss mask), the observation
        masked out, every turn ending with EOS."""
        tok = self.format.tokenizer
        eos = [tok.eos_token_id]

        def encode(text: str) -> list[int]:
            return tok(text, add_special_tokens=False)["input_ids"]

        first = encode(self.format.call_text(call)) + eos
        obs = list(self.format.observation(self.tools[call.name](call.arguments), False))
        last = encode(answer) + eos
        return tuple(first + obs + last), tuple([1] * len(first) + [0] * len(obs) + [1] * len(last))

    def close(self) -> None:
        pass
