"""Workspace layout: artifacts, the catalog, Prefect's home, logs and per-run folders."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

from core.artifacts import ArtifactStore
from core.catalog import Catalog


class WorkspaceBusy(RuntimeError):
    pass


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike) -> Workspace:
        return cls(Path(root).resolve())

    @property
    def artifacts(self) -> ArtifactStore:
        return ArtifactStore(self.root / "artifacts")

    @property
    def catalog(self) -> Catalog:
        return Catalog(self.root / "catalog.duckdb")

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def stage_state(self, stage: str, key: str) -> Path:
        """Resumable state of one stage run (RL checkpoints), keyed like the stage's cache: a rerun
        of the same stage with the same inputs and config finds it; a finished stage's is removed."""
        return self.root / "state" / f"{stage}-{key[:20]}"

    def run_dir(self, run_id: str) -> Path:
        return self.root / "runs" / run_id

    def create(self) -> None:
        for d in (self.root, self.prefect_home, self.logs, self.root / "runs", self.root / "artifacts"):
            d.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """One writing run per workspace: a second one fails at once with a clear message."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                raise WorkspaceBusy(
                    f"workspace {self.root} is in use by another laminar process (pid {holder or '?'}); "
                    "wait for it to finish or pass --workspace DIR to use another workspace"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(fd)
