"""Messages <-> tokens for agent sessions: the model's chat template (with ``tools=``) or, for a
tokenizer without one, the line format of ``environments.tool_use``; tool calls parsed in the
model's own format.

A session renders its first request once; after that only the new messages are rendered, as the
tokens the template puts after the assistant turn's end token (the difference of two renderings,
cut at that token: ``ChatFormat.delta``), and appended to the tokens the policy produced. Messages
are compared in a canonical form (``canonical``): role, text, tool calls (id, name, arguments) and
the tool call id, so a client that sends back the assistant message it got (as a dict or as the
``openai`` object) matches, and one that edits or reorders an earlier message does not.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence


class RequestError(ValueError):
    """A request the endpoint refuses: ``status`` (a 4xx) and a one-line message for the client."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise RequestError(f"{where}: content part of type {kind!r} is not supported (text only)")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts")


def canonical(msg, where: str = "messages") -> dict:
    """A message as the session compares and renders it: ``role``, ``content`` (text; None is ""),
    an assistant's ``tool_calls`` as ``[{id, name, arguments}]`` (arguments: the JSON text), a tool
    message's ``tool_call_id``."""
    if not isinstance(msg, dict):
        raise RequestError(f"{where}: each message must be an object")
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"{where}: role {role!r} is not supported (system, user, assistant, tool)")
    out = {"role": "system" if role == "developer" else role, "content": _text(msg.get("content"), where)}
    if role == "assistant" and msg.get("tool_calls"):
        calls = []
        for c in msg["tool_calls"]:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{where}: a tool call needs function.name and function.arguments")
            args = fn.get("arguments", "")
            args = args if isinstance(args, str) else json.dumps(args)
            calls.append({"id": str(c.get("id", "")), "name": fn["name"], "arguments": args})
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(msg.get("tool_call_id", ""))
    return out


def canonical_tools(tools) -> list[dict]:
    """The request's ``tools`` as the template takes them (function tools only)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list")
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise RequestError("tools: only {'type': 'function', 'function': {...}} tools are supported")
        if not isinstance(t["function"].get("name"), str):
            raise RequestError("tools: each function needs a name")
        out.append({"type": "function", "function": t["function"]})
    return out


def first_argument(tool: dict) -> str:
    """The argument a line-format call fills: the tool's one required parameter, else ``input``."""
    params = tool["function"].get("parameters") or {}
    req = params.get("required") or list((params.get("properties") or {}).keys())
    return str(req[0]) if len(req) == 1 else "input"


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:16]


def _template_message(m: dict) -> dict:
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            try:
                args = json.loads(c["arguments"])
            except ValueError:
                args = c["arguments"]
            calls.append(
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": args}}
            )
        out["tool_calls"] = calls
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id", "")
    return out


class ChatFormat:
    """The tokenizer's chat template; tool calls as ``<tool_call>{"name": ..., "arguments": ...}
    </tool_call>`` (the Hermes/Qwen format the template's tool instructions name)."""

    name = "chat_template"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise ValueError("an agent session needs a tokenizer with an end-of-turn (EOS) token")
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[dict], tools: list[dict], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            [_template_message(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=True,
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def first(self, messages, tools, prompt=None) -> tuple[int, ...]:
        return tuple(self.render(messages, tools, True))

    def delta(self, before: list[dict], new: list[dict], tools: list[dict]) -> tuple[int, ...] | None:
        """The tokens the template puts after ``before``'s last assistant turn's end token when ``new``
        follows it (and the next assistant header); None when the template renders ``before``
        differently once ``new`` follows (the session then renders afresh)."""
        head = self.render(before, tools, False)
        tail = self.render(before + new, tools, True)
        eos = self.tokenizer.eos_token_id
        ends = [i for i, t in enumerate(head) if t == eos]
        if not ends:
            return None
        cut = ends[-1] + 1
        return tuple(tail[cut:]) if tail[:cut] == head[:cut] else None

    def turn(self, messages: list[dict], tools: list[dict], reply: dict) -> tuple[int, ...] | None:
        """The tokens the template renders for the assistant message ``reply`` after ``messages`` (the
        tokens after the generation prompt, through the turn's end token): the turn a model is shown to
        make (warm-up demonstrations). None when the template renders ``messages`` differently once
        ``reply`` follows."""
        head = self.render(messages, tools, True)
        full = self.render(messages + [reply], tools, False)
        eos = self.tokenizer.eos_token_id
        if full[: len(head)] != head or eos not in full[len(head) :]:
            return None
        rest = full[len(head) :]
        return tuple(rest[: rest.index(eos) + 1])

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[dict]]:
        """The turn's text without its tool calls, and the calls to declared tools (a malformed call
        or an undeclared name stays in the text)."""
        names = {t["function"]["name"] for t in tools}
        calls, keep = [], []
        last = 0
        for m in self._CALL.finditer(text):
            try:
                call = json.loads(m.group(1))
                name, args = call["name"], call.get("arguments", {})
            except (ValueError, KeyError, TypeError):
                continue
            if name not in names:
                continue
            keep.append(text[last : m.start()])
            last = m.end()
            args = args if isinstance(args, str) else json.dumps(args)
            calls.append({"id": _call_id(), "name": name, "arguments": args})
        keep.append(text[last:])
        return "".join(keep).strip(), calls


class LineFormat:
    """No chat template (the tiny character tokenizer): the conversation as plain text. A user or
    system message is its text (the first one's tokens are the prompt's own when it is the prompt's
    text), an assistant turn is its text and its calls as ``NAME: ARGUMENT`` lines then EOS, a tool
    message ``\\n= RESULT\\n`` (``environments.tool_use.TextFormat``), a later user message
    ``\\nTEXT\\n``."""

    name = "text"

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise ValueError("an agent session needs a tokenizer with an end-of-turn (EOS) token")
        self.tokenizer = tokenizer

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _piece(self, m: dict, tools: list[dict]) -> list[int]:
        if m["role"] == "assistant":
            by_name = {t["function"]["name"]: t for t in tools}
            lines = [m["content"]] if m["content"] else []
            for c in m.get("tool_calls", []):
                try:
                    args = json.loads(c["arguments"])
                    key = first_argument(by_name[c["name"]]) if c["name"] in by_name else "input"
                    arg = args.get(key, c["arguments"]) if isinstance(args, dict) else args
                except ValueError:
                    arg = c["arguments"]
                lines.append(f"{c['name']}: {arg}")
            return self._encode("\n".join(lines)) + [self.tokenizer.eos_token_id]
        if m["role"] == "tool":
            return self._encode(f"\n= {m['content']}\n")
        return self._encode(f"\n{m['content']}\n")

    def first(self, messages, tools, prompt=None) -> tuple[int, ...]:
        opening = []
        for m in messages:
            if m["role"] not in ("system", "user"):
                break
            opening.append(m)
        text = "\n".join(m["content"] for m in opening)
        if prompt is not None and text == prompt.text and prompt.prompt_tokens:
            ids = list(prompt.prompt_tokens)
        else:
            ids = list(self.tokenizer(text)["input_ids"])
        for m in messages[len(opening) :]:
            ids += self._piece(m, tools)
        return tuple(ids)

    def delta(self, before: list[dict], new: list[dict], tools: list[dict]) -> tuple[int, ...]:
        return tuple(i for m in new for i in self._piece(m, tools))

    def turn(self, messages: list[dict], tools: list[dict], reply: dict) -> tuple[int, ...]:
        """The assistant message ``reply`` as a turn: its text and call lines, then EOS."""
        return tuple(self._piece(reply, tools))

    def parse(self, text: str, tools: list[dict]) -> tuple[str, list[dict]]:
        if not tools:
            return text.strip(), []
        by_name = {t["function"]["name"]: t for t in tools}
        names = "|".join(re.escape(n) for n in by_name)
        m = re.search(rf"(?:^|\n)\s*({names}):[ \t]*([^\n]*)\s*$", text)
        if not m:
            return text.strip(), []
        name = m.group(1)
        args = json.dumps({first_argument(by_name[name]): m.group(2).strip()})
        return text[: m.start()].strip(), [{"id": _call_id(), "name": name, "arguments": args}]


def message_format(tokenizer, choice: str = "auto"):
    """``chat_template`` (the tokenizer's template), ``text`` (the line format) or ``auto``."""
    if choice == "auto":
        choice = "chat_template" if getattr(tokenizer, "chat_template", None) else "text"
    if choice == "chat_template" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "env.tool_format=chat_template needs a tokenizer with a chat template; set env.tool_format=text"
        )
    return ChatFormat(tokenizer) if choice == "chat_template" else LineFormat(tokenizer)
