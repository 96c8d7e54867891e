"""Cache keys: hash(stage name, resolved config subtree, input artifact hashes, source fingerprint, seed).

The source fingerprint covers the stage library's modules and every project module they import,
transitively (found by reading their imports, not by importing them), so editing a module
invalidates exactly the stages whose code reaches it.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from collections.abc import Iterable

ROOT = Path(__file__).resolve().parent.parent
# conf/ is left out: config values enter the key themselves, and the schema's code computes nothing.
PROJECT_PACKAGES = ("core", "generation", "data_curation", "training", "evaluation")


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return None
    base = ROOT.joinpath(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
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


@cache
def module_closure(modules: tuple[str, ...]) -> tuple[tuple[str, Path], ...]:
    """Every project module reachable from ``modules`` by imports, with its file, sorted."""
    seen: dict[str, Path] = {}
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_file(name)
        if path is None:
            continue
        seen[name] = path
        todo.extend(_imports(path, name))
    return tuple(sorted(seen.items()))


def source_fingerprint(modules: Iterable[str]) -> str:
    h = hashlib.sha256()
    for name, path in module_closure(tuple(sorted(modules))):
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


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
