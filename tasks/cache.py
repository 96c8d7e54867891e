"""Cache keys: hash(stage name, resolved config subtree, input artifact hashes, source fingerprint, seed).

The source fingerprint covers the stage library's modules and every project module they import,
transitively (found by reading their imports, not by importing them), and the compiled-code package
data of every package reached (``generation/kernels/decode.c``: it computes each CPU decode step), so
editing either invalidates exactly the stages whose code reaches it.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from core import pyast

ROOT = Path(__file__).resolve().parent.parent
"""The tree whose library sources are fingerprinted (tests point it at an edited copy)."""
HOME = ROOT
"""This checkout: where the stage modules whose imports name their library modules are read."""
# conf/ is left out: config values enter the key themselves, and the schema's code computes nothing.
PROJECT_PACKAGES = (
    "core",
    "generation",
    "data_curation",
    "training",
    "evaluation",
    "rewards",
    "environments",
)
"""The library packages whose modules enter source fingerprints (every one a stage's code can reach
but ``conf``, whose config values enter the key themselves; ``tasks`` and ``flows`` orchestrate and
the library layers never import them)."""
CODE_DATA_SUFFIXES = (".c", ".h", ".cc", ".cpp", ".cu")
"""Package data that is code: a package's files with these suffixes are part of its source."""


def _module_file(name: str, root: Path) -> Path | None:
    parts = name.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return None
    base = root.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _imports(path: Path, module: str) -> set[str]:
    tree = pyast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    # parent packages run on import too
    for name in list(found):
        parts = name.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return found


def _code_data(package: str, init: Path) -> dict[str, Path]:
    """A package's compiled-code data files, named ``package/file``."""
    return {
        f"{package}/{f.name}": f
        for f in sorted(init.parent.iterdir())
        if f.suffix in CODE_DATA_SUFFIXES and f.is_file()
    }


@cache
def module_closure(modules: tuple[str, ...], root: Path | None = None) -> tuple[tuple[str, Path], ...]:
    """Every project module reachable from ``modules`` by imports, with its file, and the code data
    files of the packages among them (``generation.kernels/decode.c``), sorted. ``root``: the tree to
    read (default ``ROOT``, the project's own)."""
    root = ROOT if root is None else root
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name, root)
        if path is None:
            continue
        seen[name] = path
        if path.name == "__init__.py":
            seen.update(_code_data(name, path))
        todo.extend(_imports(path, name))
    return tuple(sorted(seen.items()))


def source_fingerprint(modules: Iterable[str], root: Path | None = None) -> str:
    h = hashlib.sha256()
    for name, path in module_closure(tuple(sorted(modules)), root):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def source_files(modules: Iterable[str], root: Path | None = None) -> dict[str, dict]:
    """The project files behind a source fingerprint, each with its path (relative to the tree read)
    and sha256."""
    base = ROOT if root is None else root
    return {
        name: {"path": str(path.relative_to(base)), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        for name, path in module_closure(tuple(sorted(modules)), root)
    }


STAGE_PACKAGE = "tasks.stages"
SHARED = f"{STAGE_PACKAGE}.common"
"""What every stage shares (artifact plumbing, key parts of shared config sections, catalog rows,
presentation helpers): not followed; what a stage computes with, its own module imports."""


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _named_imports(path: Path) -> set[str]:
    """The modules ``path`` imports by absolute name, anywhere in it (inside functions too), with
    ``from a import b`` read as ``a`` and ``a.b``; imports for type annotations only (``if
    TYPE_CHECKING:``) run nothing and are left out."""
    found: set[str] = set()
    todo: list[ast.AST] = [pyast.parse(path.read_text(), filename=str(path))]
    while todo:
        node = todo.pop()
        if _type_checking_block(node):
            todo.extend(getattr(node, "orelse", []))
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return found


@cache
def stage_modules(module: str, root: Path | None = None) -> tuple[str, ...]:
    """The library modules (of ``PROJECT_PACKAGES``) a stage's module imports, and those of the stage
    modules it borrows from (``tasks.stages.X``, transitively; never the shared ``SHARED``): the
    stage's ``Stage.modules``, so its source fingerprint follows its code's imports instead of a list
    kept by hand. ``root``: the tree to read (default ``HOME``, this checkout)."""
    root = HOME if root is None else root
    out: set[str] = set()
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imp in _named_imports(root.joinpath(*name.split(".")).with_suffix(".py")):
            if _module_file(imp, root) is not None:
                out.add(imp)
            elif imp.startswith(STAGE_PACKAGE + ".") and imp != SHARED:
                if root.joinpath(*imp.split(".")).with_suffix(".py").exists():
                    todo.append(imp)
    return tuple(sorted(out))


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """The parts of a stage's cache key, kept apart so ``laminar status`` can say which changed."""

    stage: str
    config_hash: str
    inputs_hash: str
    source_hash: str
    seed: int

    @property
    def digest(self) -> str:
        return _digest([self.stage, self.config_hash, self.inputs_hash, self.source_hash, self.seed])

    def changed_parts(self, other: CacheKey) -> list[str]:
        names = {
            "config_hash": "config",
            "inputs_hash": "inputs",
            "source_hash": "source code",
            "seed": "seed",
        }
        return [label for attr, label in names.items() if getattr(self, attr) != getattr(other, attr)]


def make_key(stage: str, config: dict, inputs: dict[str, str], modules: Iterable[str], seed: int) -> CacheKey:
    return CacheKey(
        stage=stage,
        config_hash=_digest(config),
        inputs_hash=_digest(dict(sorted(inputs.items()))),
        source_hash=source_fingerprint(modules),
        seed=seed,
    )
