"""The shape of the code at one or more git revisions: per top-level package, the largest class and
the largest function (lines, from ``def``/``class`` to the last line of the body); the lines of named
files; and the import graph inside ``tasks/`` (every import, including imports inside functions),
with its cycles. Reads the revisions through ``git show``, so no checkout is needed.

    python benchmarks/code_shape.py 47573d0 HEAD
    python benchmarks/code_shape.py 47573d0 HEAD --files training/rl/drivers/local.py generation/engine.py
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "conf", "generation", "evaluation", "data_curation", "training", "tasks", "flows")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def python_files(rev: str) -> dict[str, str]:
    """``{path: source}`` of every ``.py`` file under the packages at ``rev``."""
    names = _git("ls-tree", "-r", "--name-only", rev, "--", *PACKAGES).split()
    return {n: _git("show", f"{rev}:{n}") for n in names if n.endswith(".py")}


def largest(files: dict[str, str]) -> dict[str, dict[str, tuple[int, str]]]:
    """Per package: the largest class and function as ``(lines, "path:qualname")``."""
    out: dict[str, dict[str, tuple[int, str]]] = defaultdict(lambda: {"class": (0, ""), "function": (0, "")})
    for path, src in files.items():
        pkg = path.split("/", 1)[0]
        tree = ast.parse(src)

        def walk(node, prefix: str, path=path, pkg=pkg) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    size = child.end_lineno - child.lineno + 1
                    name = f"{prefix}{child.name}"
                    if size > out[pkg][kind][0]:
                        out[pkg][kind] = (size, f"{path}:{name}")
                    walk(child, f"{name}.")

        walk(tree, "")
    return dict(out)


def tasks_imports(files: dict[str, str]) -> dict[str, set[str]]:
    """The ``tasks`` modules each ``tasks`` module imports, anywhere in its body."""
    graph: dict[str, set[str]] = {}
    for path, src in files.items():
        if not path.startswith("tasks/"):
            continue
        mod = path[:-3].replace("/", ".").removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps |= {n for n in names if n.startswith("tasks.") and f"{n.replace('.', '/')}.py" in files}
        graph[mod] = deps - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="+")
    ap.add_argument("--files", nargs="*", default=[], help="files whose line counts to report")
    args = ap.parse_args(argv)
    for rev in args.revs:
        files = python_files(rev)
        sha = _git("rev-parse", "--short", rev).strip()
        print(f"## {rev} ({sha})\n")
        print("| package | largest class (lines) | largest function (lines) |\n|---|---|---|")
        for pkg, best in sorted(largest(files).items()):
            c, f = best["class"], best["function"]
            print(f"| {pkg} | {c[1]} ({c[0]}) | {f[1]} ({f[0]}) |")
        if args.files:
            print("\n| file | lines |\n|---|---|")
            for f in args.files:
                src = files.get(f)
                print(f"| {f} | {len(src.splitlines()) if src is not None else 'absent'} |")
        graph = tasks_imports(files)
        loops = cycles(graph)
        edges = sum(len(v) for v in graph.values())
        print(f"\ntasks/ import graph: {len(graph)} modules, {edges} edges, cycles: {loops or 'none'}\n")
        for mod in sorted(graph):
            print(f"- {mod} -> {', '.join(sorted(graph[mod])) or '(none)'}")
        print()


if __name__ == "__main__":
    sys.exit(main())
