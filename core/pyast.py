"""``ast.parse`` and ``ast.literal_eval`` behind one process-wide lock.

CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state. When two threads
build AST objects at once (a garbage collection mid-conversion runs a finalizer's Python code, and
the GIL moves to the other thread), the check at the end fails with ``SystemError: AST constructor
recursion depth mismatch`` (python/cpython#106905 and the reports linked from it). The code judge
parses sandbox output from a thread pool and the calculator tool parses from rollout threads, so
every parse of the project's own code goes through here. Parsing is microseconds; the lock costs
nothing measurable.
"""

from __future__ import annotations

import ast
import threading
from typing import Any

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    """``ast.parse(source, filename, mode)``, one thread at a time."""
    with _LOCK:
        return ast.parse(source, filename=filename, mode=mode)


def literal_eval(text: str) -> Any:
    """``ast.literal_eval(text)`` on a string, one thread at a time (never code)."""
    with _LOCK:
        return ast.literal_eval(text)
