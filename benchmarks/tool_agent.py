"""Issue 43's tool workload as an agent written only against ``openai``: shared by
``benchmarks/tool_throughput.py`` (``--through endpoint``: the laminar/sync ratio through the endpoint)
and ``benchmarks/agent_endpoint.py`` (``--engines tiny``: requests per second and the added latency
per request on the tiny model).

The in-process workload is ``env=calculator_sandbox``: the policy ends a turn with ``calc: EXPR``, the
environment evaluates it in the sandbox and appends ``\\n= VALUE\\n``. ``solve`` does the same episode
from outside: it offers the ``calc`` tool, runs each call the model makes through the same sandboxed
calculator (``environments.tools.SandboxCalculator``: one real ``environments.sandbox.run`` per call,
at most ``TOOL_WORKERS`` at once in this process, as the in-process tool pool) and sends the result
back as a ``tool`` message, which the tiny model's line format renders as the same ``\\n= VALUE\\n``
tokens. The tool latency (``env.tool_latency``) is added by the episode runner in both workloads, to
a turn whose step answered with a tool result, under the same key (episode and turn), so both draw
the same latencies. A turn without a call is the answer (the agent returns None: the reward layer
judges the last turn, as in-process).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from environments.tool_use import tool_schema

TARGET = "benchmarks.tool_agent:solve"
TOOL_WORKERS = 8
"""Sandboxed calls at once (the in-process workload's ``env.tool_workers``)."""
_SLOTS = threading.BoundedSemaphore(TOOL_WORKERS)
_TOOL = None
LATENCY: list[float] = []
"""Each request's wall time as the agent sees it (seconds), in this process."""


def _calculator():
    global _TOOL
    if _TOOL is None:
        from environments.tools import SandboxCalculator

        _TOOL = SandboxCalculator()
    return _TOOL


def schema() -> dict:
    """The ``calc`` tool as the in-process environment declares it (one string argument, ``input``)."""
    return tool_schema(_calculator())


def run_call(arguments: str) -> str:
    """One sandboxed calculator call: its result, or ``error: WHY`` (the in-process observation's text)."""
    from environments.base import ToolError

    with _SLOTS:
        try:
            return _calculator()(arguments)
        except ToolError as e:
            return f"error: {e}"


async def solve(client, task, max_steps: int = 8) -> None:
    """Ask, run each call the model makes in the sandbox, send its result back, ask again; a reply
    without a call is the answer. The episode runner's ``env.max_turns`` ends longer episodes."""
    messages = [{"role": "user", "content": task["prompt"]}]
    tools = [schema()]
    for _ in range(max_steps):
        t0 = time.perf_counter()
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        LATENCY.append(time.perf_counter() - t0)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            try:
                arguments = str(json.loads(call.function.arguments)["input"])
            except (ValueError, KeyError, TypeError):
                arguments = call.function.arguments
            result = await asyncio.to_thread(run_call, arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


def endpoint_overrides() -> list[str]:
    """The config overrides that turn ``env=calculator_sandbox`` into this agent through the endpoint
    (after ``env=calculator_sandbox`` and its latency overrides)."""
    return [f"env.target={TARGET}"]
