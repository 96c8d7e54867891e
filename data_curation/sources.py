"""Prompt-pool sources: where they are, their hashes, and their snapshot into the artifact store.

The ``data`` stage copies every configured source file (or folder) into its dataset artifact, so a
checkpoint's lineage ends at the exact bytes it was curated from, and ``ingest`` reads only the
snapshot. A Hugging Face hub name (not a local path) cannot be copied: it is recorded by name and
loaded by ``ingest`` through ``datasets.load_dataset``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Iterable

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SOURCES_FILE = "sources.json"


def resolve_source_path(path: str) -> Path | None:
    """A local file or folder: as given (``~`` expanded, relative to the working directory), else
    relative to the project root (for the vendored pools); None when neither exists."""
    p = Path(path).expanduser()
    for candidate in (p, PROJECT_ROOT / p):
        if candidate.exists():
            return candidate.resolve()
    return None


def source_hashes(sources: Iterable[Any]) -> dict[str, str]:
    """``source:<name>`` -> sha256 of the file or folder (a hub name hashes as its name)."""
    from core.artifacts import hash_file, hash_tree

    out = {}
    for s in sources:
        local = resolve_source_path(s.path)
        if local is None:
            out[f"source:{s.name}"] = f"hub:{s.path}"
        else:
            out[f"source:{s.name}"] = hash_tree(local) if local.is_dir() else hash_file(local)
    return out


def snapshot_sources(sources: Iterable[Any], out_dir: Path) -> list[dict]:
    """Copy each source into ``out_dir/sources/<name>/`` and write ``sources.json``: the specs with
    paths relative to ``out_dir`` (``hub: true`` for a hub name, kept as it is)."""
    from conf.schema import SOURCE_NAME

    specs = []
    for s in sources:
        spec = s.model_dump() if hasattr(s, "model_dump") else dict(s)
        if not isinstance(spec["name"], str) or not SOURCE_NAME.fullmatch(
            spec["name"]
        ):  # the config refuses it first
            raise ValueError(
                f"data source name {spec['name']!r} is not an identifier (letters, digits, _ and -); "
                "it names a folder inside the dataset artifact"
            )
        local = resolve_source_path(spec["path"])
        if local is None:
            if spec.get("format") != "hf":
                raise FileNotFoundError(
                    f"data source {spec['name']!r}: no file or folder at {spec['path']!r} "
                    "(only format=hf may name a hub dataset)"
                )
            spec["hub"] = True
        else:
            dest = Path(out_dir) / "sources" / spec["name"] / local.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if local.is_dir():
                shutil.copytree(local, dest)
            else:
                shutil.copy2(local, dest)
            spec["path"] = str(dest.relative_to(out_dir))
            spec["hub"] = False
        spec["extra_fields"] = list(spec.get("extra_fields") or [])
        specs.append(spec)
    return specs


def write_sources(out_dir: Path, specs: list[dict]) -> None:
    with open(Path(out_dir) / SOURCES_FILE, "w") as f:
        json.dump(specs, f, indent=1, sort_keys=True)


def read_sources(data_dir: Path) -> list[dict]:
    """The snapshot's source specs with absolute paths (hub names unchanged)."""
    with open(Path(data_dir) / SOURCES_FILE) as f:
        specs = json.load(f)
    for spec in specs:
        if not spec.pop("hub", False):
            spec["path"] = str(Path(data_dir) / spec["path"])
    return specs


ARITH_SOURCE = {
    "name": "arith",
    "path": "pool.parquet",
    "format": "parquet",
    "problem_field": "problem",
    "answer_field": "answer",
    "id_field": "prompt_id",
    "level_field": "level",
    "subject_field": None,
    "extra_fields": ["solution", "demonstration"],
    "split": "train",
    "hub": False,
}
"""The synthetic pool, as the ``data`` stage writes it, read by ``ingest`` like any other source."""
