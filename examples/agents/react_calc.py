"""A ReAct agent written only against the ``openai`` client: it offers a ``calc`` tool, runs the
calls the model makes with its own tool loop, and returns the model's final answer.

Nothing here knows about Laminar: pointed at any OpenAI-compatible server it runs as it is. Trained
through the endpoint (docs/agents.md)::

    laminar run env.target=examples.agents.react_calc:solve env.max_turns=4

``task`` is ``{"prompt_id", "prompt", "answer", "level", "params"}``; the return value ``{"answer":
...}`` leaves the judging to the run's reward layer (which reads the episode's last turn).
"""

from __future__ import annotations

import ast
import json
import operator

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an integer arithmetic expression (+ - * / and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "the expression"}},
            "required": ["input"],
        },
    },
}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def calc(expression: str) -> str:
    """The tool: integer arithmetic through an AST walk (never ``eval``); errors are the tool's text."""

    def walk(node):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp):
            op = ast.FloorDiv if isinstance(node.op, ast.Div) else type(node.op)
            if op in OPS:
                left, right = walk(node.left), walk(node.right)
                if op is ast.FloorDiv and right == 0:
                    raise ValueError("division by zero")
                if abs(left) > 10**12 or abs(right) > 10**12:
                    raise ValueError("number too large")
                return OPS[op](left, right)
        raise ValueError("only integers, + - * / and parentheses")

    try:
        return str(walk(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as e:
        return f"error: {e}"


async def solve(client, task, max_steps: int = 4, model: str = "policy") -> dict:
    """Ask, run each tool call the model makes, ask again; the first answer without a call ends it."""
    messages = [{"role": "user", "content": task["prompt"]}]
    calls = 0
    for _ in range(max_steps):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=[CALC])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return {"answer": message.content or "", "tool_calls": calls}
        for call in message.tool_calls:
            calls += 1
            try:
                expression = json.loads(call.function.arguments)["input"]
            except (ValueError, KeyError, TypeError):
                expression = call.function.arguments
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(expression))})
    return {"answer": "", "tool_calls": calls}
