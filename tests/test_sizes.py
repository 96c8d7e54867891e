"""Size limits in the library packages: no function over 60 lines, no class over 350 (issue 51).

Today's offenders are listed in ``ALLOWED`` with their current length, which may only shrink: an
allow-listed item that grows fails, and so does a new offender. An entry that shrank is lowered to
its new length, and one back within the limits (or gone) is removed, so that it cannot grow back.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "generation", "rewards", "environments", "evaluation", "data_curation", "training")
LIMITS = {"function": 60, "class": 350}

ALLOWED: dict[str, int] = {}
"""``path:qualified name`` -> its length in lines, for an offender that may stay while it shrinks. Empty
since stop 57: every function and class of the library packages is within the limits; keep it so."""


def definitions(source: str) -> list[tuple[str, str, int]]:
    """(kind, qualified name, lines) of every function and class in ``source``, nested ones named
    through their parents (``Engine.__init__``, ``outer.inner``)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                found.append((kind, name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def oversized(source: str, where: str) -> dict[str, tuple[str, int]]:
    """``where:qualified name`` -> (kind, lines) of each definition in ``source`` over its limit."""
    out: dict[str, tuple[str, int]] = {}
    for kind, name, lines in definitions(source):
        key = f"{where}:{name}"
        if lines > LIMITS[kind] and lines > out.get(key, (kind, 0))[1]:
            out[key] = (kind, lines)
    return out


def library_offenders() -> dict[str, tuple[str, int]]:
    found: dict[str, tuple[str, int]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found.update(oversized(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()))
    return found


def size_problems(found: dict[str, tuple[str, int]], allowed: dict[str, int]) -> list[str]:
    """What to fix for ``found`` (from :func:`library_offenders`) against the allow-list ``allowed``."""
    problems = []
    for key, (kind, lines) in sorted(found.items()):
        limit = LIMITS[kind]
        if key not in allowed:
            problems.append(
                f"{key}: new {kind} of {lines} lines (limit {limit}): split it into helpers that each do "
                "one thing (STYLE.md: split by phase); do not add it to ALLOWED"
            )
        elif lines > allowed[key]:
            problems.append(
                f"{key}: {kind} grew from {allowed[key]} to {lines} lines (limit {limit}): move the new "
                "code into a helper; allow-listed items may only shrink"
            )
        elif lines < allowed[key]:
            problems.append(
                f"{key}: shrank from {allowed[key]} to {lines} lines: lower its entry in ALLOWED "
                f"(tests/test_sizes.py) to {lines} so it cannot grow back"
            )
    for key in sorted(set(allowed) - set(found)):
        problems.append(
            f"{key}: within the limits now (or gone): remove its entry from ALLOWED (tests/test_sizes.py)"
        )
    return problems


def test_library_functions_and_classes_stay_within_the_size_limits():
    problems = size_problems(library_offenders(), ALLOWED)
    assert not problems, "size limits (functions <= 60 lines, classes <= 350):\n" + "\n".join(problems)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_the_check_measures_nested_definitions_and_reports_each_kind_of_problem():
    source = (
        "class Big:\n"
        + _function("small", 10, "    ")
        + _function("long_method", 60, "    ")
        + "".join(_function(f"m{i}", 9, "    ") for i in range(29))
        + _function("outer", 3)
        + _function("inner", 61, "    ")
        + _function("at_the_limit", 59)
    )
    kinds = {name: (kind, lines) for kind, name, lines in definitions(source)}
    assert kinds["Big"] == ("class", 1 + 11 + 61 + 29 * 10)
    assert kinds["Big.long_method"] == ("function", 61) and kinds["Big.small"] == ("function", 11)
    assert kinds["outer.inner"] == ("function", 62) and kinds["outer"] == ("function", 66)
    assert kinds["at_the_limit"] == ("function", 60)
    found = oversized(source, "pkg/mod.py")
    assert found == {
        "pkg/mod.py:Big": ("class", 363),
        "pkg/mod.py:Big.long_method": ("function", 61),
        "pkg/mod.py:outer": ("function", 66),
        "pkg/mod.py:outer.inner": ("function", 62),
    }
    allowed = {
        "pkg/mod.py:Big": 363,
        "pkg/mod.py:Big.long_method": 60,
        "pkg/mod.py:outer": 70,
        "pkg/gone.py:f": 80,
    }
    problems = size_problems(found, allowed)
    assert len(problems) == 4
    assert "Big.long_method: function grew from 60 to 61" in problems[0]
    assert "outer: shrank from 70 to 66" in problems[1] and "to 66 so it cannot grow back" in problems[1]
    assert "outer.inner: new function of 62 lines" in problems[2]
    assert problems[3].startswith("pkg/gone.py:f: within the limits now")
    assert size_problems(found, {key: lines for key, (_, lines) in found.items()}) == []
