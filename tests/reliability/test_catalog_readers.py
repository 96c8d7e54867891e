"""No catalog reader kills a run, and no run makes a reader print a traceback.

DuckDB locks the catalog file per process and never waits: a read-only connection held by another
process (a notebook, ``laminar status``) made the run's next write raise ``IOException: Could not
set lock on file``, and a reader opening it during a write crashed the same way. ``Catalog`` now
retries the open (bounded, jittered backoff) and then fails with ``CatalogBusy``, one line naming
the process that holds the lock; the CLI prints that line (exit 3), never a traceback. A failing
run whose final status update fails too still raises its own error, with the status failure noted.

Every other process here is a plain ``duckdb`` connection in a subprocess, as a notebook's would be.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pytest

from core.catalog import Catalog, CatalogBusy
from core.workspace import Workspace
from tasks import runner as operate
from tasks.records import RunSummary
from tasks.runner import RunRecordError, Selection, run_pipeline

ROOT = Path(__file__).resolve().parents[2]

HOLDER = textwrap.dedent("""
    import sys, duckdb
    con = duckdb.connect(sys.argv[1], read_only=sys.argv[2] == "ro")
    print("open", flush=True)
    sys.stdin.read()  # hold the connection until the test closes our stdin
    con.close()
""")


@contextmanager
def held(path: Path, mode: str, seconds: float | None = None):
    """Another process holding a ``mode`` ("ro"/"rw") connection to ``path`` until the block ends, or
    for ``seconds`` when given (the block may go on meanwhile)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "open"
        if seconds is not None:
            # close its stdin after ``seconds`` from a thread, so the block runs meanwhile
            import threading

            threading.Timer(seconds, proc.stdin.close).start()
        yield proc
    finally:
        if not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def fresh_catalog(tmp_path: Path, **kw) -> Catalog:
    cat = Catalog(tmp_path / "catalog.duckdb", **kw)
    with cat.transaction():
        pass  # creates the file and its schema
    return cat


def insert_run(con, run_id: str) -> None:
    con.execute("INSERT INTO runs VALUES (?, now(), NULL, 'running', 'test', '{}', NULL)", [run_id])


# ---- the writer's side --------------------------------------------------------------------------


def test_a_reader_holding_the_catalog_open_never_delays_a_write(tmp_path):
    """A notebook's own ``duckdb.connect("catalog.duckdb", read_only=True)``, held open: the write goes
    to the live file at once and republishes; the reader keeps the state it opened, a new connection
    sees the write."""
    cat = fresh_catalog(tmp_path)
    with held(cat.path, "ro"):
        t0 = time.monotonic()
        with cat.transaction() as con:
            insert_run(con, "r1")
        assert time.monotonic() - t0 < 1.0
        fresh = duckdb.connect(str(cat.path), read_only=True)
        assert fresh.execute("SELECT run_id FROM runs").fetchall() == [("r1",)]
        fresh.close()


def test_a_write_waits_for_a_process_holding_the_live_file_then_lands(tmp_path):
    cat = fresh_catalog(tmp_path)
    with held(cat.live, "ro", seconds=1.5):
        t0 = time.monotonic()
        with cat.transaction() as con:
            insert_run(con, "r1")
        waited = time.monotonic() - t0
    assert 1.0 < waited < 10, waited
    assert cat.query("SELECT run_id FROM runs") == [{"run_id": "r1"}]


def test_a_reader_held_past_the_writers_wait_fails_with_one_line_naming_it(tmp_path):
    cat = fresh_catalog(tmp_path, write_wait_s=0.5)
    with held(cat.live, "ro") as reader:
        t0 = time.monotonic()
        with pytest.raises(CatalogBusy) as err:
            with cat.transaction() as con:
                insert_run(con, "r1")
        assert 0.5 <= time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "\n" not in msg
    assert f"is held open by another process (PID {reader.pid}" in msg
    assert "close that connection" in msg and "finished stages come from cache" in msg
    assert cat.query("SELECT count(*) AS n FROM runs") == [{"n": 0}]  # nothing half-written


def test_other_io_errors_are_not_retried(tmp_path):
    (tmp_path / "catalog.live.duckdb").write_bytes(b"not a duckdb file" * 100)
    t0 = time.monotonic()
    with pytest.raises(duckdb.Error) as err:
        with Catalog(tmp_path / "catalog.duckdb").transaction():
            pass
    assert not isinstance(err.value, CatalogBusy) and time.monotonic() - t0 < 5


def test_every_write_lands_while_a_reader_polls(tmp_path, caplog):
    """A stage record per transaction, 40 of them, while another process polls the catalog with its
    own short read-only connections (as `laminar status` in a loop or a notebook cell does): every
    read succeeds and no write ever waits for it."""
    cat = fresh_catalog(tmp_path)
    poller = textwrap.dedent("""
        import select, sys, time
        from core.catalog import Catalog
        cat, n, errors = Catalog(sys.argv[1]), 0, 0
        print("open", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0.005)[0]:
            try:
                cat.query("SELECT count(*) AS n FROM runs")
                n += 1
            except Exception as e:
                errors += 1
                print(type(e).__name__, e, file=sys.stderr)
        print(n, errors, flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", poller, str(cat.path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "open"
    caplog.set_level(logging.INFO, logger="laminar.catalog")
    t0, n = time.monotonic(), 0
    while n < 40 or time.monotonic() - t0 < 3:
        with cat.transaction() as con:
            insert_run(con, f"r{n}")
        n += 1
    out, err = proc.communicate(input="", timeout=60)  # closes its stdin: it stops
    reads, errors = map(int, out.split())
    assert cat.query("SELECT count(*) AS n FROM runs") == [{"n": n}]
    assert errors == 0, err
    assert reads > 10
    waits = [r for r in caplog.records if "writer waited" in r.getMessage()]
    assert not waits, [r.getMessage() for r in waits]


# ---- the reader's side --------------------------------------------------------------------------


def test_a_reader_waits_for_a_write_then_reads(tmp_path):
    cat = fresh_catalog(tmp_path)
    with cat.transaction() as con:
        insert_run(con, "r1")
    with held(cat.path, "rw", seconds=1.5):
        t0 = time.monotonic()
        rows = cat.query("SELECT run_id FROM runs")
        waited = time.monotonic() - t0
    assert rows == [{"run_id": "r1"}] and 1.0 < waited < 10


def _laminar(*args: str, ws: Path, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full_env.pop("PREFECT_API_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_laminar_status_waits_for_a_write_and_prints_no_traceback(tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    fresh_catalog(ws.root)
    # held longer than the CLI takes to start, so its first query meets the writer
    with held(ws.catalog.path, "rw", seconds=3):
        proc = _laminar("status", ws=ws.root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "never ran in this workspace" in proc.stdout


@pytest.mark.parametrize(
    "command", [["status"], ["report"], ["runs"], ["lineage", "abcd1234"]], ids=lambda c: c[0]
)
def test_a_reader_behind_a_write_past_its_wait_prints_one_line(tmp_path, command):
    ws = Workspace.at(tmp_path / "ws")
    fresh_catalog(ws.root)
    with held(ws.catalog.path, "rw") as writer:
        proc = _laminar(*command, ws=ws.root, LAMINAR_CATALOG_READ_WAIT_S="0.3")
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"laminar: the catalog {ws.catalog.path} is locked for writing by another process (PID {writer.pid}"
    ), lines[0]
    assert lines[0].endswith("try again in a moment")


# ---- the run's final status ---------------------------------------------------------------------


def _run(ws: Workspace, pipeline):
    from conf.loader import load_config

    return run_pipeline(
        load_config([]),
        ws,
        pipeline,
        overrides=[],
        selection=Selection(None, []),
        command="test",
        say=lambda m: None,
        warn=lambda m: None,
    )


@pytest.fixture
def bare_run(monkeypatch):
    """``run_pipeline`` without Prefect's setup (it would point this process's Prefect at tmp_path)."""
    monkeypatch.setattr(operate, "prepare_workspace", lambda ws, say: ws.create())
    monkeypatch.setattr(operate, "save_run_files", lambda *a, **k: None)
    monkeypatch.setenv("LAMINAR_CATALOG_WRITE_WAIT_S", "0.3")


def test_a_failed_final_status_update_does_not_hide_the_runs_error(tmp_path, bare_run):
    ws = Workspace.at(tmp_path / "ws")
    holder: dict = {}

    def pipeline(**kw):
        holder["cm"] = held(ws.catalog.live, "ro")
        holder["cm"].__enter__()  # a reader opens the catalog and keeps it, then the disk fills up
        raise OSError(28, "No space left on device (simulated)")

    try:
        with pytest.raises(OSError, match="No space left on device") as err:
            _run(ws, pipeline)
    finally:
        holder["cm"].__exit__(None, None, None)
    notes = getattr(err.value, "__notes__", [])
    assert len(notes) == 1 and "could not be recorded as failed in the catalog (CatalogBusy:" in notes[0], (
        notes
    )
    rows = ws.catalog.query("SELECT status FROM runs")
    assert rows == [{"status": "running"}]  # the next run marks it interrupted


def test_a_completed_run_whose_status_cannot_be_closed_says_so(tmp_path, bare_run, monkeypatch):
    ws = Workspace.at(tmp_path / "ws")
    monkeypatch.setattr(
        "tasks.summary.build_summary",
        lambda run_id, outcomes, seconds, *rest: RunSummary(run_id, seconds, [], {}, {}, {}, {}, {}, []),
    )
    monkeypatch.setattr("tasks.summary.format_table", lambda summary: "")
    holder: dict = {}

    def pipeline(**kw):
        holder["cm"] = held(ws.catalog.live, "ro")
        holder["cm"].__enter__()
        return []

    try:
        with pytest.raises(RunRecordError, match="could not be recorded as completed in the catalog"):
            _run(ws, pipeline)
    finally:
        holder["cm"].__exit__(None, None, None)


# ---- a real run with readers polling (slow) ------------------------------------------------------


@pytest.mark.slow
def test_a_tiny_run_completes_with_every_row_while_readers_poll(tmp_path):
    """`laminar status` and a raw read-only DuckDB connection, every 200 ms, through a whole tiny run."""
    from benchmarks.catalog_readers import run_with_readers
    from tests.configs import TINY_CURATED

    res = run_with_readers(tmp_path / "ws", TINY_CURATED, poll_s=0.2, timeout_s=900)
    assert res["run"]["returncode"] == 0, res["run"]["stderr_tail"]
    assert res["run_row"] == "completed"
    assert res["missing_stage_rows"] == []
    assert res["status_reader"]["tracebacks"] == 0 and res["status_reader"]["failures"] == 0
    assert res["status_reader"]["polls"] > 5
    assert res["raw_reader"]["polls"] > 5
    raw = res["raw_reader"]
    assert raw["lock_conflicts"] == 0 and raw["other_errors"] == 0, raw  # a notebook's own connection too
