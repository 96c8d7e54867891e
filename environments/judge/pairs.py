"""Tests read as input/output pairs: a test made only of asserts on one call of the program with
literal arguments (``assert add(1, 2) == 3``, HumanEval's ``def check(candidate): assert
candidate([1, 2]) == [2, 1]`` then ``check(entry)``) becomes its calls and the expectations the
trusted checker tests on the program's plain results, without running the test's code at all. A
test of any other shape is ``None`` here (it runs through ``run_checks``)."""

from __future__ import annotations

import ast
import builtins
import math
import operator
from dataclasses import dataclass
from core import pyast

OPS = {ast.Eq: "eq", ast.NotEq: "ne", ast.Is: "is", ast.IsNot: "is_not", ast.Lt: "lt", ast.LtE: "le"}
MIRROR = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}
FILLER = (ast.Import, ast.ImportFrom, ast.Pass)
FOLD = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
"""Arithmetic folded in a test's literals (``3 * 19``, ``'ab' + 'c'``, ``2.0 / 3.0``)."""
MAX_FOLD = 10_000
"""Largest sequence (items) or int (bits, /0.4) a fold may build: a test's constant, not a bomb."""
WRAPS = {"tuple": tuple, "list": list, "set": set, "frozenset": frozenset, "sorted": sorted, "len": len}
"""Builtins a test may wrap the program's result in (``tuple(candidate(x)) == (1, 2)``), applied
here to the plain result."""


@dataclass(frozen=True)
class Expect:
    """One assert: the result of call ``call`` (an index into the test's calls) against ``value``.
    ``op``: eq, ne, is, is_not, truthy, falsy, close_lt / close_le (``abs(result - value[0]) <
    value[1]``), or fail (``assert False``); ``wrap``: a ``WRAPS`` builtin applied to the result
    first."""

    call: int
    op: str
    value: object = None
    wrap: str | None = None


@dataclass(frozen=True)
class PairTest:
    """A test as pairs. Invariant: every ``Expect.call`` indexes ``calls``; each call is (function
    name, positional arguments, keyword arguments), all plain data."""

    calls: tuple[tuple[str, list, dict], ...]
    expects: tuple[Expect, ...]

    def holds(self, results: list) -> bool:
        """Whether every expectation holds on ``results`` (per call: its plain value, or an
        ``Exception`` when the call gave none)."""
        return all(e.op != "fail" and _holds(e, results[e.call]) for e in self.expects)


def _holds(e: Expect, v) -> bool:
    if isinstance(v, BaseException):
        return False
    try:
        if e.wrap is not None:
            v = WRAPS[e.wrap](v)
        if e.op in ("close_lt", "close_le"):
            if type(v) not in (int, float, complex, bool):
                return False
            gap, eps = abs(v - e.value[0]), e.value[1]
            return bool(gap < eps if e.op == "close_lt" else gap <= eps)
        return bool(
            {
                "eq": lambda: v == e.value,
                "ne": lambda: v != e.value,
                "is": lambda: v is e.value,
                "is_not": lambda: v is not e.value,
                "truthy": lambda: bool(v),
                "falsy": lambda: not v,
            }[e.op]()
        )
    except (TypeError, ValueError, OverflowError, RecursionError):
        return False


def defined_names(prefix: str) -> set[str]:
    """Top-level names the (trusted) prefix defines: a test's call to one of these, other than the
    entry point, is the prefix's helper, not the program."""
    try:
        tree = pyast.parse(prefix)
    except SyntaxError:
        return set()
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def pair_test(src: str, entry: str | None, prefix_names: set[str]) -> PairTest | None:
    """``src`` as pairs, or None when it is of another shape (module docstring)."""
    try:
        tree = pyast.parse(src)
    except SyntaxError:
        return None
    body, alias = _unwrap_check(tree.body)
    if body is None:
        return None
    program = {n for n in alias.values()} | ({entry} if entry else set())
    calls: list = []
    expects: list[Expect] = []
    for node in body:
        if isinstance(node, FILLER) or _is_docstring(node):
            continue
        if not isinstance(node, ast.Assert):
            return None
        got = _expect(node.test, alias, program, prefix_names, calls)
        if got is None:
            return None
        expects.extend(got)
    return PairTest(tuple(calls), tuple(expects))


def _unwrap_check(body: list[ast.stmt]) -> tuple[list | None, dict[str, str]]:
    """The statements the test runs and the check parameter's alias: HumanEval's ``def check(p):
    ...`` with one ``check(name)`` call (and filler: imports, ``METADATA = {...}``) is its body with
    ``p`` standing for ``name``; a flat test is itself."""
    defs = [s for s in body if isinstance(s, ast.FunctionDef)]
    if not defs:
        return body, {}
    rest = [s for s in body if s not in defs and not isinstance(s, FILLER) and not _is_docstring(s)]
    rest = [s for s in rest if not (isinstance(s, ast.Assign) and _literal(s.value) is not _NO)]
    if len(defs) != 1 or len(rest) != 1:
        return None, {}
    fn, call = defs[0], rest[0]
    ok = (
        isinstance(call, ast.Expr)
        and isinstance(call.value, ast.Call)
        and isinstance(call.value.func, ast.Name)
        and call.value.func.id == fn.name
        and len(call.value.args) == 1
        and not call.value.keywords
        and isinstance(call.value.args[0], ast.Name)
        and len(fn.args.args) == 1
        and not (fn.args.vararg or fn.args.kwarg or fn.args.kwonlyargs or fn.args.defaults)
        and not fn.decorator_list
    )
    return (fn.body, {fn.args.args[0].arg: call.value.args[0].id}) if ok else (None, {})


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


_NO = object()


def _literal(node: ast.expr):
    try:
        return _fold(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, ArithmeticError):
        return _NO


def _fold(node: ast.expr):
    """A literal, with arithmetic on literals folded (``FOLD``; results bounded by ``MAX_FOLD``) and
    ``WRAPS`` builtins applied to literals."""
    if isinstance(node, ast.BinOp) and type(node.op) in FOLD:
        a, b = _fold(node.left), _fold(node.right)
        if isinstance(node.op, ast.Pow) and not (type(b) is int and abs(b) <= 64):
            raise ValueError("a big power")
        if isinstance(node.op, ast.Mult) and isinstance(a, (str, bytes, list, tuple)) != isinstance(
            b, (str, bytes, list, tuple)
        ):
            seq, n = (a, b) if isinstance(a, (str, bytes, list, tuple)) else (b, a)
            if type(n) is int and len(seq) * abs(n) > MAX_FOLD:
                raise ValueError("a big repeat")
        return _small(FOLD[type(node.op)](a, b))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _fold(node.operand)
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_fold(e) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in WRAPS:
        if len(node.args) == 1 and not node.keywords:  # tuple([1, 2]) on the expected side
            return WRAPS[node.func.id](_fold(node.args[0]))
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_fold(k): _fold(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _small(v):
    if (isinstance(v, (str, bytes, list, tuple)) and len(v) > MAX_FOLD) or (
        type(v) is int and v.bit_length() > 4 * MAX_FOLD
    ):
        raise ValueError("a big constant")
    return v


def _expect(test: ast.expr, alias, program, prefix_names, calls) -> list[Expect] | None:
    """The expectations of one ``assert`` (appending its call to ``calls``), or None."""
    if isinstance(test, ast.Constant):
        return [] if test.value else [Expect(0, "fail")]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _one(test.operand, "falsy", None, alias, program, prefix_names, calls)
    if isinstance(test, ast.Call):
        return _one(test, "truthy", None, alias, program, prefix_names, calls)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, op, right = test.left, type(test.ops[0]), test.comparators[0]
    if _literal(left) is not _NO and _literal(right) is _NO:
        left, right, op = right, left, MIRROR.get(op, op)
    name = OPS.get(op)
    value = _literal(right)
    if name is None or value is _NO:
        return None
    if name in ("lt", "le"):
        return _close(left, name, value, alias, program, prefix_names, calls)
    if name in ("is", "is_not") and not any(value is c for c in (True, False, None)):
        return None
    return _one(left, name, value, alias, program, prefix_names, calls)


def _close(left, name, eps, alias, program, prefix_names, calls) -> list[Expect] | None:
    """``abs(call - value) < eps`` (or ``<=``; also ``abs(value - call)``)."""
    ok = (
        isinstance(left, ast.Call)
        and isinstance(left.func, ast.Name)
        and left.func.id == "abs"
        and len(left.args) == 1
        and not left.keywords
        and isinstance(left.args[0], ast.BinOp)
        and isinstance(left.args[0].op, ast.Sub)
        and type(eps) in (int, float)
        and math.isfinite(eps)
    )
    if not ok:
        return None
    a, b = left.args[0].left, left.args[0].right
    call, lit = (a, b) if isinstance(a, ast.Call) else (b, a)
    value = _literal(lit)
    if type(value) not in (int, float):
        return None
    return _one(call, f"close_{name}", (value, eps), alias, program, prefix_names, calls)


def _one(node, op, value, alias, program, prefix_names, calls) -> list[Expect] | None:
    """One call of the program with literal arguments (maybe in a ``WRAPS`` builtin), as an
    expectation (None: not such a call)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    wrap = node.func.id
    if wrap in WRAPS and wrap not in prefix_names and wrap not in program and len(node.args) == 1:
        if not node.keywords and isinstance(node.args[0], ast.Call):
            got = _one(node.args[0], op, value, alias, program, prefix_names, calls)
            if got and all(e.wrap is None for e in got):
                return [Expect(e.call, e.op, e.value, wrap) for e in got]
            return None
    name = alias.get(node.func.id, node.func.id)
    if name not in program and (name in prefix_names or hasattr(builtins, name)):
        return None
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    args = [_literal(a) for a in node.args]
    kwargs = {k.arg: _literal(k.value) for k in node.keywords}
    if any(v is _NO for v in (*args, *kwargs.values())):
        return None
    calls.append((name, args, kwargs))
    return [Expect(len(calls) - 1, op, value)]
