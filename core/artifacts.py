"""Content-addressed artifact store under ``<workspace>/artifacts/<kind>/<sha256>/``.

An artifact is a folder; it exists only once its ``manifest.json`` is written (temp name, fsync,
rename), so a crash mid-write never leaves something that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterator

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ArtifactRef:
    """A small, JSON-serialisable handle on a complete artifact. ``path`` is absolute in memory;
    what is stored (catalog rows, Prefect results, run summaries) is ``ArtifactStore.stored(ref)``,
    relative to the workspace root, and ``ArtifactStore.locate`` turns it back into an absolute path
    under wherever the workspace is now."""

    kind: str
    sha256: str
    path: str

    def file(self, name: str) -> Path:
        return Path(self.path) / name

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ArtifactRef:
        return cls(kind=d["kind"], sha256=d["sha256"], path=d["path"])


@dataclass
class PendingArtifact:
    """A folder being written; ``meta`` goes into the manifest."""

    kind: str
    dir: Path
    meta: dict[str, Any] = field(default_factory=dict)
    ref: ArtifactRef | None = None  # set once the artifact is published


def hash_tree(root: Path) -> str:
    """sha256 over the relative paths and bytes of every file under ``root`` (manifest excluded)."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temp name, fsync and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file's data to disk, so a manifest never seals files still in the page cache."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.tmp_root = self.root / ".tmp"

    def clean_tmp(self) -> None:
        """Drop folders left by writers that crashed (they never got a manifest)."""
        shutil.rmtree(self.tmp_root, ignore_errors=True)

    @contextmanager
    def create(self, kind: str, meta: dict[str, Any] | None = None) -> Iterator[PendingArtifact]:
        """Write files into ``pending.dir``; on clean exit the folder is hashed, moved into place and
        sealed with a manifest. On an exception nothing is published."""
        self.tmp_root.mkdir(parents=True, exist_ok=True)
        # ``meta`` is kept by reference: the writer may add to it until the artifact is published
        pending = PendingArtifact(
            kind=kind, dir=self.tmp_root / f"{kind}-{uuid.uuid4().hex}", meta=meta if meta is not None else {}
        )
        pending.dir.mkdir()
        try:
            yield pending
            pending.ref = self.publish(pending)
        finally:
            shutil.rmtree(pending.dir, ignore_errors=True)

    def publish(self, pending: PendingArtifact) -> ArtifactRef:
        sha = hash_tree(pending.dir)
        final = self.root / pending.kind / sha
        if not (final / MANIFEST).exists():
            shutil.rmtree(final, ignore_errors=True)  # a half-moved folder of an earlier crash
            final.parent.mkdir(parents=True, exist_ok=True)
            _fsync_tree(pending.dir)
            os.replace(pending.dir, final)
            files = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file())
            write_json_atomic(
                final / MANIFEST,
                {
                    "kind": pending.kind,
                    "sha256": sha,
                    "created": time.time(),
                    "files": files,
                    "meta": pending.meta,
                },
            )
        return ArtifactRef(kind=pending.kind, sha256=sha, path=str(final))

    def write(self, kind: str, writer, meta: dict[str, Any] | None = None) -> ArtifactRef:
        """Call ``writer(dir)`` to fill a new artifact and return its ref."""
        with self.create(kind, meta) as pending:
            writer(pending.dir)
        assert pending.ref is not None
        return pending.ref

    @property
    def workspace_root(self) -> Path:
        """The folder stored paths are relative to: the workspace (the store's parent)."""
        return self.root.parent

    def stored(self, ref: ArtifactRef) -> dict:
        """``ref`` as it is written down: a path inside the workspace relative to its root
        (``artifacts/model/<sha>``), so the workspace can be moved or copied; a path outside it (a
        ``laminar eval ckpt=/models/x`` folder) stays absolute."""
        path = Path(ref.path)
        try:
            rel = path.relative_to(self.workspace_root).as_posix() if path.is_absolute() else path.as_posix()
        except ValueError:
            rel = str(path)
        return {"kind": ref.kind, "sha256": ref.sha256, "path": rel}

    def locate(self, ref: ArtifactRef | dict) -> ArtifactRef:
        """A stored ref with an absolute path under this workspace. A relative path is taken from the
        workspace root; an absolute one written before paths were stored relative (or by a workspace
        since moved) that names a store folder (``.../artifacts/<kind>/<sha>``) is read from this
        store, where a content-addressed artifact of that kind and sha lives wherever the workspace is;
        any other absolute path (a folder outside the workspace) is kept."""
        if isinstance(ref, dict):
            ref = ArtifactRef.from_dict(ref)
        path = Path(ref.path)
        if not path.is_absolute():
            return ArtifactRef(ref.kind, ref.sha256, str(self.workspace_root / path))
        own = self.root / ref.kind / ref.sha256
        if (
            path != own
            and path.name == ref.sha256
            and path.parent.name == ref.kind
            and path.parent.parent.name == "artifacts"
            and (own / MANIFEST).exists()
        ):
            return ArtifactRef(ref.kind, ref.sha256, str(own))
        return ref

    def locate_path(self, kind: str, sha256: str, path: str | None) -> str | None:
        """``locate`` for a catalog row's (kind, sha256, path); None stays None."""
        return None if path is None else self.locate(ArtifactRef(kind, sha256, path)).path

    def exists(self, ref: ArtifactRef | dict) -> bool:
        ref = self.locate(ref)
        return (Path(ref.path) / MANIFEST).exists()

    def manifest(self, ref: ArtifactRef) -> dict:
        with open(Path(self.locate(ref).path) / MANIFEST) as f:
            return json.load(f)
