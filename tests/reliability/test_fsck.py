"""A file corrupted after its artifact was sealed is no longer served from cache without notice:
``laminar fsck`` rehashes every artifact in the store and moves the ones that no longer match
aside (never deleting them), records them, prints a one-line summary and exits 1; the stage that made
such an artifact is then stale and reruns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.artifacts import MANIFEST, ArtifactRef, hash_tree
from core.catalog import dumps
from core.workspace import Workspace, WorkspaceBusy

ROOT = Path(__file__).resolve().parents[2]


def _fill(files: dict[str, bytes]):
    def write(d: Path) -> None:
        for name, data in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)

    return write


def store_with_artifacts(ws: Workspace) -> dict[str, ArtifactRef]:
    ws.create()
    store = ws.artifacts
    return {
        "intact": store.write("dataset", _fill({"data.parquet": b"intact rows"})),
        "flipped": store.write("model", _fill({"config.json": b"{}", "model.safetensors": b"\x00" * 4096})),
        "deleted": store.write("prompts", _fill({"prompts.parquet": b"p" * 100, "sub/extra.json": b"[]"})),
        "added": store.write("metrics", _fill({"metrics.json": b'{"a": 1}'})),
        "manifest": store.write("eval", _fill({"summary.json": b'{"acc": 0.5}'})),
    }


def damage(refs: dict[str, ArtifactRef]) -> None:
    f = refs["flipped"].file("model.safetensors")
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF  # one flipped bit-pattern: same size, same mtime order
    f.write_bytes(bytes(data))
    refs["deleted"].file("sub/extra.json").unlink()
    refs["added"].file("notes.txt").write_text("edited by hand")
    refs["manifest"].file(MANIFEST).write_text("{ truncated")


def test_fsck_quarantines_what_no_longer_matches_and_keeps_the_rest(tmp_path):
    from tasks.fsck import fsck

    ws = Workspace.at(tmp_path / "ws")
    refs = store_with_artifacts(ws)
    damage(refs)
    corrupted = (ws.artifacts.root / "model" / refs["flipped"].sha256 / "model.safetensors").read_bytes()
    unsealed = ws.artifacts.root / "model" / ("0" * 64)  # a writer died before its manifest: not an artifact
    unsealed.mkdir()

    res = fsck(ws)

    assert not res.ok and res.checked == 5 and res.intact == 1
    assert res.incomplete == [str(unsealed)] and unsealed.exists()
    reasons = {q["kind"]: q["reason"] for q in res.quarantined}
    assert reasons["model"].startswith("content hashes to ")
    assert reasons["prompts"] == "missing file sub/extra.json"
    assert reasons["metrics"] == "unexpected file notes.txt"
    assert reasons["eval"].startswith("manifest unreadable")
    assert ws.artifacts.exists(refs["intact"])
    for name in ("flipped", "deleted", "added", "manifest"):
        assert not Path(refs[name].path).exists() and not ws.artifacts.exists(refs[name])
    # moved aside whole, never deleted, and recorded twice (catalog and fsck.jsonl)
    moved = {q["kind"]: Path(q["moved_to"]) for q in res.quarantined}
    assert all(p.is_dir() and p.is_relative_to(ws.root / "quarantine") for p in moved.values())
    assert (moved["model"] / "model.safetensors").read_bytes() == corrupted
    rows = ws.catalog.query("SELECT kind, sha256, reason, moved_to FROM quarantined_artifacts ORDER BY kind")
    assert [(r["kind"], r["sha256"]) for r in rows] == sorted(
        (refs[n].kind, refs[n].sha256) for n in ("flipped", "deleted", "added", "manifest")
    )
    log = [json.loads(line) for line in (ws.root / "quarantine" / "fsck.jsonl").read_text().splitlines()]
    assert {e["sha256"] for e in log} == {r["sha256"] for r in rows}

    again = fsck(ws)
    assert again.ok and again.checked == 1 and again.intact == 1


def test_an_artifact_written_again_after_quarantine_is_sealed_again(tmp_path):
    from tasks.fsck import fsck

    ws = Workspace.at(tmp_path / "ws")
    refs = store_with_artifacts(ws)
    damage(refs)
    fsck(ws)
    # the stage reruns and writes the same bytes: the same sha256 is published afresh
    ref = ws.artifacts.write("model", _fill({"config.json": b"{}", "model.safetensors": b"\x00" * 4096}))
    assert ref == refs["flipped"] and hash_tree(Path(ref.path)) == ref.sha256
    assert fsck(ws).ok


def test_fsck_waits_for_no_run_it_refuses_while_one_holds_the_workspace(tmp_path):
    from tasks.fsck import fsck

    ws = Workspace.at(tmp_path / "ws")
    refs = store_with_artifacts(ws)
    damage(refs)
    with ws.lock():
        with pytest.raises(WorkspaceBusy, match="in use by another laminar process"):
            fsck(ws)
    assert Path(refs["flipped"].path).exists()  # nothing moved


def _laminar(*args: str, ws: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_laminar_fsck_prints_one_summary_line_and_exits_1_when_it_quarantined(tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    refs = store_with_artifacts(ws)

    clean = _laminar("fsck", ws=ws.root)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.strip().splitlines() == [clean.stdout.strip()]
    assert (
        clean.stdout.startswith("fsck: 5 artifacts rehashed") and "5 intact, none quarantined" in clean.stdout
    )

    damage(refs)
    bad = _laminar("fsck", ws=ws.root)
    assert bad.returncode == 1, bad.stderr
    (summary,) = bad.stdout.strip().splitlines()
    assert "1 intact, 4 QUARANTINED to " + str(ws.root / "quarantine") in summary
    assert "Traceback" not in bad.stderr
    assert sorted(line.split()[2].split("/")[0] for line in bad.stderr.strip().splitlines()) == [
        "eval",
        "metrics",
        "model",
        "prompts",
    ]

    assert _laminar("fsck", ws=ws.root).returncode == 0
    missing = _laminar("fsck", ws=tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.startswith("laminar: no artifact store in ")


def test_a_stage_whose_artifact_was_quarantined_is_stale(tmp_path):
    """``laminar status``'s plan: cached while the artifact is sealed and intact, stale ("its artifact is
    missing from the store") once fsck moved it; ``run_stage`` reruns a cached stage in the same case
    (the slow test below goes through a real run)."""
    from conf.loader import load_config
    from tasks.fsck import fsck
    from tasks.dag import STAGES, stage_key
    from tasks.plan import plan

    cfg = load_config([])
    ws = Workspace.at(tmp_path / "ws")
    ws.create()
    first = STAGES[0]
    assert not first.inputs
    key = stage_key(first, cfg, {}, ws)
    refs = {
        name: ws.artifacts.write(name, _fill({f"{name}.parquet": f"{first.name} {name}".encode()}))
        for name in ("dataset",)
    }
    with ws.catalog.transaction() as con:
        con.execute(
            "INSERT INTO stage_runs (run_id, stage, status, cache_key, config_hash, inputs_hash, "
            "source_hash, seed, finished_at, outputs_json) VALUES ('r', ?, 'ran', ?, ?, ?, ?, ?, now(), ?)",
            [
                first.name,
                key.digest,
                key.config_hash,
                key.inputs_hash,
                key.source_hash,
                key.seed,
                dumps({n: r.to_dict() for n, r in refs.items()}),
            ],
        )
    assert plan(cfg, ws)[0].status == "cached"

    f = refs["dataset"].file("dataset.parquet")
    f.write_bytes(f.read_bytes()[::-1])
    assert plan(cfg, ws)[0].status == "cached"  # a corrupted file alone still looks cached
    assert not fsck(ws).ok
    p = plan(cfg, ws)[0]
    assert (p.status, p.reason) == ("stale", "its artifact is missing from the store")


@pytest.mark.slow
def test_a_cached_stage_whose_artifact_was_quarantined_reruns_and_restores_it(tmp_path):
    """Through the real CLI: run the first stage, truncate a file of its artifact; after `laminar fsck`
    the next run reruns the stage (instead of taking it from cache) and the artifact is sealed again
    with its original content."""
    from tasks.dag import STAGES

    ws = tmp_path / "ws"
    first = STAGES[0].name

    def run() -> dict:
        proc = _laminar("run", "--until", first, ws=ws)
        assert proc.returncode == 0, proc.stderr[-3000:]
        latest = max((ws / "runs").iterdir(), key=lambda p: p.name)
        return json.loads((latest / "summary.json").read_text())["stages"][first]

    s1 = run()
    assert s1["status"] == "ran"
    sha = next(iter(s1["artifacts"].values()))
    folder = next((ws / "artifacts").glob(f"*/{sha}"))
    victim = max(
        (p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST), key=lambda p: p.stat().st_size
    )
    original = victim.read_bytes()
    victim.write_bytes(original[: len(original) // 2])

    # (without fsck the next run takes the stage from cache and reads the truncated file)
    proc = _laminar("fsck", ws=ws)
    assert proc.returncode == 1 and "1 QUARANTINED" in proc.stdout, proc.stdout + proc.stderr
    s3 = run()
    assert s3["status"] == "ran" and next(iter(s3["artifacts"].values())) == sha
    assert victim.read_bytes() == original and hash_tree(folder) == sha
    assert _laminar("fsck", ws=ws).returncode == 0
