"""The layering rules of DESIGN.md: stage libraries never import Prefect; flows hold no logic."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = [
    "generation",
    "rewards",
    "environments",
    "data_curation",
    "training",
    "evaluation",
    "core",
    "conf",
]


def _modules(pkg):
    for path in sorted((ROOT / pkg).rglob("*.py")):
        yield ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@pytest.mark.parametrize("pkg", LIBRARIES)
def test_library_does_not_import_prefect(pkg):
    mods = list(_modules(pkg))
    code = (
        "import sys, importlib\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        "assert not bad, bad[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_flows_import_only_tasks_and_config():
    for path in (ROOT / "flows").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top = node.module.split(".")[0]
                if top in ("generation", "data_curation", "training", "evaluation"):
                    raise AssertionError(
                        f"{path.name} imports {node.module}: flows may import tasks and config only"
                    )


# DESIGN.md's layer order, lowest first: a package may import itself and the packages before it,
# never one after it (so no two stage libraries import each other both ways). ``core`` and ``conf``
# share the bottom layer.
LAYERS = [
    ("core", "conf"),
    ("generation",),
    ("rewards",),
    ("environments",),
    ("evaluation",),
    ("data_curation",),
    ("training",),
    ("tasks",),
    ("flows",),
]


def _layer_of(top: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) if top in names), None)


def _project_imports(path: Path):
    """(line, module) of every absolute import in ``path``, top-level or inside a function."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def layer_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for names in LAYERS:
        for pkg in names:
            here = _layer_of(pkg)
            for path in sorted((root / pkg).rglob("*.py")):
                for line, module in _project_imports(path):
                    there = _layer_of(module.split(".")[0])
                    if there is not None and there > here:
                        bad.append(
                            f"{path.relative_to(root)}:{line} imports {module} (layer {there} > {here})"
                        )
    return bad


def test_imports_follow_the_layer_order():
    assert layer_violations() == []


def test_layer_check_catches_an_import_against_the_order(tmp_path):
    (tmp_path / "generation").mkdir()
    (tmp_path / "generation" / "engine.py").write_text(
        "def f():\n    from training.rl.loop import run_sync\n"
    )
    (tmp_path / "evaluation").mkdir()
    (tmp_path / "evaluation" / "ok.py").write_text("from generation.records import PromptItem\n")
    assert layer_violations(tmp_path) == ["generation/engine.py:2 imports training.rl.loop (layer 6 > 1)"]


def package_import_graph(root: Path = ROOT, package: str = "tasks") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` (dotted: ``tasks.stages``) it imports, top-level or inside
    a function (``import tasks.x``, ``from tasks.x import y``, ``from tasks import x``)."""
    folder = root.joinpath(*package.split("."))
    mods = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    prefix = package + "."
    graph: dict[str, set[str]] = {}
    for name in sorted(mods):
        found: set[str] = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == package:
                found.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith(prefix):
                    found.add(node.module[len(prefix) :].split(".")[0])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(prefix):
                        found.add(alias.name[len(prefix) :].split(".")[0])
        graph[name] = found - {name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_tasks_imports_have_no_cycle_even_through_imports_inside_functions():
    assert import_cycle(package_import_graph()) == []


def test_the_cycle_check_sees_an_import_inside_a_function(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "runner.py").write_text("from tasks.summary import build_summary\n")
    (tmp_path / "tasks" / "summary.py").write_text("def f():\n    from tasks import lineage\n")
    (tmp_path / "tasks" / "lineage.py").write_text("def g():\n    import tasks.runner\n")
    graph = package_import_graph(tmp_path)
    assert graph == {"lineage": {"runner"}, "runner": {"summary"}, "summary": {"lineage"}}
    assert import_cycle(graph) == ["lineage", "runner", "summary", "lineage"]
    (tmp_path / "tasks" / "lineage.py").write_text("import json\n")
    assert import_cycle(package_import_graph(tmp_path)) == []


def test_only_the_runner_writes_the_catalog():
    """Every catalog transaction of a run is in ``tasks.recording``, which only the runner calls
    (each stage's module in ``tasks.stages`` declares its ``Stage.record`` hook; the runner gives it
    its transaction). ``laminar fsck`` keeps its own quarantine table."""
    graph = package_import_graph()
    assert {m for m, deps in graph.items() if "recording" in deps} == {"runner"}
    stages = package_import_graph(package="tasks.stages")
    assert stages and not any("recording" in deps for deps in stages.values())
    for folder in ("tasks", "flows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name not in ("recording.py", "fsck.py"):
                assert ".transaction()" not in path.read_text(), path


def test_the_stage_modules_import_no_cycle_and_no_runner():
    """A stage module imports the records, the shared ``tasks.stages.common`` and the stage modules it
    borrows from: never the graph, the runner or the recording (those import the stages)."""
    for path in sorted((ROOT / "tasks" / "stages").glob("*.py")):
        for _, module in _project_imports(path):
            assert module not in ("tasks.dag", "tasks.runner", "tasks.recording"), (path.name, module)
    assert import_cycle(package_import_graph(package="tasks.stages")) == []
