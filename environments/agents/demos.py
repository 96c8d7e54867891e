"""Demonstration episodes of an agent (warm-up SFT): the agent itself runs through its session, and the
policy's turns are scripted: first a turn that makes a tool call, then one that answers.

Each scripted turn is what the session's message format renders for that assistant message
(``ChatFormat.turn``: the chat template's tokens for an assistant message with ``tool_calls``, e.g. the
``<tool_call>`` block of a Qwen/Hermes template; ``LineFormat.turn``: ``NAME: ARGUMENT`` then EOS),
checked to parse back into the same call (``format.parse``, what the endpoint does with a sampled
turn). The agent receives the call as ``tool_calls``, runs its own tool and sends its next request;
the observation is the session's own rendering of those new messages. So a demonstration is token
for token the episode the endpoint records when the policy makes that call: the model learns the
exact format the agent's conversation is rendered in, whatever the agent's messages and tools.
"""

from __future__ import annotations

import json

from environments.agents.chat import first_argument
from environments.base import Turn
from generation.records import PromptItem


def _scripted_turn(env, session, reply: dict) -> Turn | None:
    tokens = env.format.turn(list(session.known), session.tools, reply)
    if tokens is None:
        return None
    return Turn(env.tokenizer.decode(list(tokens), skip_special_tokens=True), tokens)


def _call_turn(env, session, name: str, argument: str) -> Turn | None:
    """The turn calling the agent's tool ``name`` with ``argument`` in its one argument: the message
    with ``tool_calls`` as the format renders it, or, for a chat template that renders no
    ``tool_calls``, the Hermes ``<tool_call>`` text as its content; None when the agent offers no such
    tool or neither turn parses back into that call (what the endpoint would answer the agent)."""
    tools = session.serving.request["call_tools"] if session.serving is not None else []
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        return None
    args = {first_argument(tool): argument}
    call = {"id": "call_demo", "name": name, "arguments": json.dumps(args)}
    hermes = "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
    for reply in (
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "assistant", "content": hermes},  # a template that renders no tool_calls
    ):
        turn = _scripted_turn(env, session, reply)
        if turn is None:
            continue
        _, parsed = env.format.parse(turn.text, tools)
        if [(c["name"], json.loads(c["arguments"])) for c in parsed] == [(name, args)]:
            return turn
    return None


def demonstrate(env, prompt: PromptItem, call, answer: str):
    """``(prompt_tokens, tokens, loss_mask)`` of the episode in which the policy makes ``call`` (a
    ``ToolCall``: the tool's name and its argument) and then answers ``answer``, run through the agent
    of ``env`` (an ``AgentEnvironment``); the observations masked out. None when the agent does not
    offer that tool, does not ask again after the call, or does not end after the answer."""
    prompt_tokens, state = env.reset(prompt)
    done = bool(state.get("ended"))
    try:
        session = None if done else env.hub.get(state["session"])
        turn = None if session is None else _call_turn(env, session, call.name, call.arguments)
        if turn is None:
            return None
        first = env.step(state, turn)
        done = first.done
        if done or not first.tool_call:
            return None
        last = _scripted_turn(env, session, {"role": "assistant", "content": answer})
        if last is None:
            return None
        end = env.step(first.state, last)
        done = end.done
        if not done or end.reason != "answer":
            return None
    finally:
        if not done:
            env.episode_ended(state, "demonstration")
    tokens = turn.tokens + first.observation + last.tokens
    mask = (1,) * len(turn.tokens) + (0,) * len(first.observation) + (1,) * len(last.tokens)
    return tuple(prompt_tokens), tokens, mask
