"""The project's AST parses hold under threads: CPython 3.11's AST constructor keeps its recursion
depth in interpreter-wide state, and two threads converting at once fail with ``SystemError`` (it
failed ``make test`` once, in the code judge's thread pool)."""

from __future__ import annotations

import ast
import gc
from concurrent.futures import ThreadPoolExecutor

import pytest

from core import pyast
from environments.calculator import evaluate

RECORD = repr({"test": 1, "status": "pass", "why": [[(1, 2, 3)] * 5] * 20, "deep": [[[[[1]]]]]})
EXPRESSION = " + ".join(["((1 + 2) * (3 - 4))"] * 9)  # 190 characters, under the tool's cap


class _Churn:
    """A cycle whose finalizer runs Python code: a collection mid-conversion lets the GIL move."""

    def __del__(self):
        [object() for _ in range(5)]


def _hammer(parse, threads: int = 8, jobs: int = 16, each: int = 60) -> list[BaseException]:
    def one(_):
        errors = []
        for _ in range(each):
            churn = _Churn()
            churn.me = churn
            try:
                parse()
            except SystemError as e:
                errors.append(e)
        return errors

    old = gc.get_threshold()
    gc.set_threshold(50)
    try:
        with ThreadPoolExecutor(threads) as pool:
            return [e for errs in pool.map(one, range(jobs)) for e in errs]
    finally:
        gc.set_threshold(*old)


def test_the_harness_shows_the_race_on_raw_ast():
    """The control: the same load through ``ast`` directly fails (skipped where CPython has no race)."""
    errors = _hammer(lambda: ast.literal_eval(RECORD))
    if not errors:
        pytest.skip("this interpreter shows no AST recursion-depth race under the harness")
    assert "recursion depth mismatch" in str(errors[0])


@pytest.mark.parametrize(
    "parse",
    [
        lambda: pyast.literal_eval(RECORD),
        lambda: pyast.parse(f"def f():\n    return {RECORD}\n"),
        lambda: evaluate(EXPRESSION),
    ],
    ids=["literal_eval", "parse", "calculator"],
)
def test_parses_through_core_pyast_never_race(parse):
    assert _hammer(parse) == []
