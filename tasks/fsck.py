"""``laminar fsck``: rehash every artifact in the store and quarantine those whose files changed
after they were sealed.

A sealed artifact (``<workspace>/artifacts/<kind>/<sha256>/`` with its ``manifest.json``) is served
from cache by its name alone, so a file corrupted or edited later would be fed to every later stage.
``fsck`` recomputes each artifact's ``core.artifacts.hash_tree`` and checks its manifest (readable,
naming the same kind and sha256, listing exactly the files present). An artifact that fails is moved,
whole, to ``<workspace>/quarantine/<kind>/<sha256>-<UTC time>/`` (never deleted) and recorded in the
catalog (``quarantined_artifacts``) and in ``quarantine/fsck.jsonl``. With the folder gone from the
store the artifact no longer exists: a stage whose cached result names it reruns on the next run
(``tasks.runner.run_stage``), and ``laminar status`` shows it stale ("its artifact is missing").

Folders without a manifest are not artifacts (a writer died before sealing; the next publish of the
same content replaces them) and are only counted. ``fsck`` holds the workspace lock, so it never
moves an artifact a run is reading.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path

from core.artifacts import MANIFEST, hash_tree
from core.workspace import Workspace

FSCK_SCHEMA = """
CREATE TABLE IF NOT EXISTS quarantined_artifacts (
    kind VARCHAR, sha256 VARCHAR, quarantined_at TIMESTAMP, reason VARCHAR, moved_to VARCHAR,
    PRIMARY KEY (kind, sha256, quarantined_at)
);
"""
_SHA = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class FsckResult:
    checked: int = 0
    intact: int = 0
    bytes: int = 0
    incomplete: list[str] = field(default_factory=list)  # folders without a manifest: not artifacts
    quarantined: list[dict] = field(default_factory=list)  # kind, sha256, reason, moved_to
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.quarantined


def quarantine_root(ws: Workspace) -> Path:
    return ws.root / "quarantine"


def check_artifact(folder: Path, kind: str, sha: str) -> str | None:
    """Why the sealed artifact in ``folder`` no longer is ``kind``/``sha``, or None when it still is."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"manifest unreadable ({type(err).__name__})"
    if not isinstance(manifest, dict) or manifest.get("sha256") != sha or manifest.get("kind") != kind:
        return (
            "manifest names another artifact" if isinstance(manifest, dict) else "manifest is not an object"
        )
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST}
    listed = set(manifest.get("files") or [])
    if listed - present:
        return "missing file " + ", ".join(sorted(listed - present)[:3])
    if present - listed:
        return "unexpected file " + ", ".join(sorted(present - listed)[:3])
    try:
        found = hash_tree(folder)
    except OSError as err:
        return f"unreadable ({err})"
    if found != sha:
        return f"content hashes to {found[:16]}, not {sha[:16]}"
    return None


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _quarantine(ws: Workspace, folder: Path, kind: str, sha: str, reason: str) -> dict:
    """Move ``folder`` out of the store (one rename), then record it."""
    now = datetime.now(UTC)
    dest = quarantine_root(ws) / kind / f"{sha}-{now.strftime('%Y%m%dT%H%M%S%fZ')}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(folder, dest)
    entry = {
        "kind": kind,
        "sha256": sha,
        "reason": reason,
        "moved_from": str(folder),
        "moved_to": str(dest),
        "quarantined_at": now.isoformat(),
    }
    with open(quarantine_root(ws) / "fsck.jsonl", "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
    return entry


def fsck(ws: Workspace) -> FsckResult:
    """Rehash the whole store of ``ws`` under its lock (raises ``WorkspaceBusy`` while a run holds it)."""
    t0 = time.perf_counter()
    res = FsckResult()
    root = ws.artifacts.root
    with ws.lock():
        kinds = (
            sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
            if root.is_dir()
            else []
        )
        for kind_dir in kinds:
            for folder in sorted(d for d in kind_dir.iterdir() if d.is_dir() and _SHA.match(d.name)):
                if not (folder / MANIFEST).exists():
                    res.incomplete.append(str(folder))
                    continue
                res.checked += 1
                res.bytes += _size(folder)
                reason = check_artifact(folder, kind_dir.name, folder.name)
                if reason is None:
                    res.intact += 1
                else:
                    res.quarantined.append(_quarantine(ws, folder, kind_dir.name, folder.name, reason))
        if res.quarantined:
            with ws.catalog.transaction() as con:
                con.execute(FSCK_SCHEMA)
                for q in res.quarantined:
                    con.execute(
                        "INSERT INTO quarantined_artifacts VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [q["kind"], q["sha256"], q["quarantined_at"], q["reason"], q["moved_to"]],
                    )
    res.seconds = time.perf_counter() - t0
    return res


def format_fsck(ws: Workspace, res: FsckResult) -> tuple[list[str], str]:
    """(one line per quarantined artifact, the one-line summary)."""
    lines = [
        f"quarantined {q['kind']}/{q['sha256'][:16]}: {q['reason']} (moved to {q['moved_to']})"
        for q in res.quarantined
    ]
    extra = f", {len(res.incomplete)} unsealed folders left alone" if res.incomplete else ""
    if res.quarantined:
        tail = (
            f"{len(res.quarantined)} QUARANTINED to {quarantine_root(ws)} "
            "(the stages that made them rerun on the next `laminar run`)"
        )
    else:
        tail = "none quarantined"
    summary = (
        f"fsck: {res.checked} artifacts rehashed ({res.bytes / 1e6:.1f} MB in {res.seconds:.1f} s): "
        f"{res.intact} intact, {tail}{extra}"
    )
    return lines, summary
