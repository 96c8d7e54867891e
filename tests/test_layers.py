"""The layering rules of DESIGN.md: stage libraries never import Prefect; flows hold no logic."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ["data_curation", "training", "evaluation", "core", "conf"]


def _modules(pkg):
    for path in sorted((ROOT / pkg).rglob("*.py")):
        yield ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@pytest.mark.parametrize("pkg", LIBRARIES)
def test_library_does_not_import_prefect(pkg):
    mods = list(_modules(pkg))
    code = ("import sys, importlib\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
            "assert not bad, bad[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_flows_import_only_tasks_and_config():
    allowed = ("tasks", "conf", "core", "flows", "prefect")
    for path in (ROOT / "flows").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                top = node.module.split(".")[0]
                if top in ("data_curation", "training", "evaluation"):
                    raise AssertionError(f"{path.name} imports {node.module}: flows may import tasks and config only")
