"""The layering rules of DESIGN.md: stage libraries never import Prefect; flows hold no logic."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ["generation", "data_curation", "training", "evaluation", "core", "conf"]


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
    allowed = ("tasks", "conf", "core", "flows", "prefect")
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
    assert layer_violations(tmp_path) == ["generation/engine.py:2 imports training.rl.loop (layer 4 > 1)"]
