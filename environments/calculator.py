"""The calculator tool: integer arithmetic (+ - * / and parentheses) through a small AST walker,
never ``eval``; anything else in the expression is refused with a ``ToolError``."""

from __future__ import annotations

import ast
import re
from fractions import Fraction

from environments.base import ToolError
from core import pyast

MAX_CHARS = 200
MAX_MAGNITUDE = 10**18
"""Results (and every intermediate value) beyond this are refused: no arithmetic blow-ups."""

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def evaluate(expression: str) -> Fraction:
    """The exact value of an integer expression of + - * / and parentheses (``ToolError`` otherwise:
    names, calls, powers, floats, division by zero, results beyond ``MAX_MAGNITUDE``)."""
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = pyast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError("not an expression") from None
    return _walk(tree.body)


def _walk(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _walk(node.operand)
        value = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        value = _OPS[type(node.op)](left, right)
    else:
        raise ToolError(f"unsupported {type(node).__name__}: only integers, + - * / and parentheses")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("number too large")
    return value


def render(value: Fraction) -> str:
    """An integer as itself, a non-integer as an exact fraction ``p/q``."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


ARITH_PROBLEM = re.compile(r"^What is (.+)\?$")
"""The synthetic arithmetic task's problem text (``data_curation.synthetic.problem_text``)."""


def arith_call(problem: str):
    """The calculator call that solves an arithmetic problem (``What is 3+4-2?``), or None."""
    from environments.tool_use import ToolCall

    m = ARITH_PROBLEM.match(problem.strip())
    return ToolCall(Calculator.name, m.group(1)) if m else None


class Calculator:
    """The calculator as a tool (``environments.base.Tool``)."""

    name = "calc"
    description = "Evaluate an integer arithmetic expression with + - * / and parentheses."

    def __call__(self, arguments: str) -> str:
        return render(evaluate(arguments))
