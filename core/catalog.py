"""The DuckDB catalog: curation and lineage tables, one database per workspace.

Every table has a key that makes a retried write idempotent (``INSERT ... ON CONFLICT DO NOTHING`` /
``DO UPDATE``). DuckDB locks a file per process and never waits: a writer cannot open it while any
other process holds a connection (a notebook, ``laminar status``), nor a reader while a run writes.
So the catalog is two files:

- ``catalog.live.duckdb``: what laminar writes. One write connection at a time in a process (a
  lock), short-lived (a stage's rows, a run's row).
- ``catalog.duckdb``: what everyone reads. After every write connection the live file is
  checkpointed and copied to a temporary name, which then replaces ``catalog.duckdb`` atomically: a
  reader (``Catalog.query``, ``laminar status``, a notebook's own ``duckdb.connect(...,
  read_only=True)``) always opens a complete, committed state and never meets the writer's lock; one
  holding it open keeps its own copy (the replaced file stays readable) and never delays a write.

Opening a connection still retries on DuckDB's lock conflict, with a bounded, jittered exponential
backoff (writers up to ``LAMINAR_CATALOG_WRITE_WAIT_S``, default 300 s; readers up to
``LAMINAR_CATALOG_READ_WAIT_S``, default 30 s), for a process that opens a file directly read-write
(``catalog.live.duckdb``, or ``catalog.duckdb`` itself), then raises ``CatalogBusy`` with a
one-line message naming the process holding the lock. Only the open is retried: once open, the
connection holds the lock until it closes, so nothing is written twice. A workspace written before
the split (one ``catalog.duckdb``) is carried over to ``catalog.live.duckdb`` at its first write.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Sequence

LOG = logging.getLogger("laminar.catalog")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY,
    started_at TIMESTAMP, finished_at TIMESTAMP, status VARCHAR,
    command VARCHAR, config_json VARCHAR, prefect_flow_run_id VARCHAR
);
CREATE TABLE IF NOT EXISTS stage_runs (
    run_id VARCHAR, stage VARCHAR, status VARCHAR, cache_key VARCHAR,
    config_hash VARCHAR, inputs_hash VARCHAR, source_hash VARCHAR, seed BIGINT,
    started_at TIMESTAMP, finished_at TIMESTAMP, seconds DOUBLE,
    prefect_task_run_id VARCHAR, outputs_json VARCHAR, metrics_json VARCHAR,
    PRIMARY KEY (run_id, stage)
);
CREATE TABLE IF NOT EXISTS artifacts (
    kind VARCHAR, sha256 VARCHAR, path VARCHAR, created_at TIMESTAMP,
    stage VARCHAR, cache_key VARCHAR, meta_json VARCHAR,
    PRIMARY KEY (kind, sha256)
);
CREATE TABLE IF NOT EXISTS artifact_edges (
    parent_kind VARCHAR, parent_sha VARCHAR, child_kind VARCHAR, child_sha VARCHAR,
    stage VARCHAR, cache_key VARCHAR,
    PRIMARY KEY (parent_sha, child_sha, stage)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    checkpoint_sha VARCHAR PRIMARY KEY, stage VARCHAR, step BIGINT, base_sha VARCHAR,
    cache_key VARCHAR, created_at TIMESTAMP
);
CREATE TABLE IF NOT EXISTS consumed_prompts (
    checkpoint_sha VARCHAR, prompt_id VARCHAR, n_trajectories BIGINT,
    PRIMARY KEY (checkpoint_sha, prompt_id)
);
CREATE TABLE IF NOT EXISTS prompts (
    artifact_sha VARCHAR, prompt_id VARCHAR, source VARCHAR, split VARCHAR,
    problem VARCHAR, answer VARCHAR, level INTEGER,
    PRIMARY KEY (artifact_sha, prompt_id)
);
-- eval_sha: the evaluation artifact (its config), so two evaluations of one checkpoint never mix
CREATE TABLE IF NOT EXISTS eval_results (
    checkpoint_sha VARCHAR, eval_sha VARCHAR, benchmark VARCHAR, problem_id VARCHAR, sample_idx INTEGER,
    response VARCHAR, pred VARCHAR, correct BOOLEAN, error VARCHAR,
    length INTEGER, truncated BOOLEAN, level VARCHAR, subject VARCHAR,
    PRIMARY KEY (checkpoint_sha, eval_sha, benchmark, problem_id, sample_idx)
);
ALTER TABLE eval_results ADD COLUMN IF NOT EXISTS subject VARCHAR;
-- the decontamination certificate of the score (tasks.certificate): clean | contaminated-removed |
-- not-checked | unknown-origin, and as JSON with the benchmark file's sha256, the rules and the pools
ALTER TABLE eval_results ADD COLUMN IF NOT EXISTS certificate VARCHAR;
ALTER TABLE eval_results ADD COLUMN IF NOT EXISTS certificate_json VARCHAR;
-- curation decisions, keyed by the artifact that made them (a cached rerun inserts nothing new)
CREATE TABLE IF NOT EXISTS quarantine (
    artifact_sha VARCHAR, source VARCHAR, source_row BIGINT, raw VARCHAR, reason VARCHAR,
    PRIMARY KEY (artifact_sha, source, source_row)
);
CREATE TABLE IF NOT EXISTS duplicates (
    artifact_sha VARCHAR, source VARCHAR, source_row BIGINT, prompt_id VARCHAR, canonical_id VARCHAR,
    kind VARCHAR, similarity DOUBLE,
    PRIMARY KEY (artifact_sha, source, source_row)
);
-- the instruction wrapper ingest took out of a source's rows (the source's own template)
CREATE TABLE IF NOT EXISTS source_templates (
    artifact_sha VARCHAR, source VARCHAR, template VARCHAR, prefix VARCHAR, suffix VARCHAR, rows BIGINT,
    matched BIGINT,
    PRIMARY KEY (artifact_sha, source)
);
CREATE TABLE IF NOT EXISTS contamination (
    artifact_sha VARCHAR, prompt_id VARCHAR, source VARCHAR, benchmark VARCHAR, benchmark_problem_id VARCHAR,
    matched VARCHAR, overlap BIGINT,
    PRIMARY KEY (artifact_sha, prompt_id, benchmark, benchmark_problem_id)
);
-- rule: which check flagged the prompt (ngram | paraphrase | paraphrase+answer);
-- score: its coverage or similarity
ALTER TABLE contamination ADD COLUMN IF NOT EXISTS rule VARCHAR;
ALTER TABLE contamination ADD COLUMN IF NOT EXISTS score DOUBLE;
CREATE TABLE IF NOT EXISTS attempts (
    artifact_sha VARCHAR, model_sha VARCHAR, prompt_id VARCHAR, n BIGINT, n_correct BIGINT, pass_rate DOUBLE,
    mean_length DOUBLE, mean_entropy DOUBLE, level INTEGER,
    PRIMARY KEY (artifact_sha, prompt_id)
);
CREATE TABLE IF NOT EXISTS dart_stats (
    artifact_sha VARCHAR, prompt_id VARCHAR, fail_rate DOUBLE, target BIGINT, trials BIGINT, corrects BIGINT,
    stopped_reason VARCHAR, level INTEGER,
    PRIMARY KEY (artifact_sha, prompt_id)
);
CREATE TABLE IF NOT EXISTS selections (
    artifact_sha VARCHAR, prompt_id VARCHAR, pass_rate_est DOUBLE, score DOUBLE, n_observations BIGINT,
    selected BOOLEAN, reason VARCHAR,
    PRIMARY KEY (artifact_sha, prompt_id)
);
-- HIVE's reward history: one row per rolled-out group (difficulty sampling and every RL step)
CREATE TABLE IF NOT EXISTS reward_history (
    source_sha VARCHAR, origin VARCHAR, step BIGINT, idx BIGINT, prompt_id VARCHAR, mean_reward DOUBLE,
    n BIGINT, recorded_at TIMESTAMP,
    PRIMARY KEY (source_sha, step, idx)
);
CREATE TABLE IF NOT EXISTS metrics (
    cache_key VARCHAR, stage VARCHAR, step BIGINT, name VARCHAR, value DOUBLE,
    PRIMARY KEY (cache_key, stage, step, name)
);
-- preference comparisons (data_curation.preferences) and the preference rows quarantined, by artifact
CREATE TABLE IF NOT EXISTS comparisons (
    artifact_sha VARCHAR, comparison_id VARCHAR, prompt VARCHAR, chosen VARCHAR, rejected VARCHAR,
    margin DOUBLE, annotator VARCHAR, source VARCHAR,
    PRIMARY KEY (artifact_sha, comparison_id)
);
CREATE TABLE IF NOT EXISTS preference_quarantine (
    artifact_sha VARCHAR, source VARCHAR, source_row BIGINT, reason VARCHAR,
    PRIMARY KEY (artifact_sha, source, source_row)
);
-- the reward an RL checkpoint trained under: one row per component (docs/rewards.md)
CREATE TABLE IF NOT EXISTS reward_components (
    checkpoint_sha VARCHAR, position INTEGER, component VARCHAR, weight DOUBLE, correctness BOOLEAN,
    params_json VARCHAR,
    PRIMARY KEY (checkpoint_sha, component)
);
-- every rolled-out response's score per reward component (unweighted; component 'total' is the sum)
CREATE TABLE IF NOT EXISTS reward_terms (
    checkpoint_sha VARCHAR, idx BIGINT, step BIGINT, prompt_id VARCHAR, sample_idx BIGINT,
    component VARCHAR, value DOUBLE,
    PRIMARY KEY (checkpoint_sha, idx)
);
"""


WRITE_WAIT_S = 300.0
"""How long a writer (the run) waits for other processes' connections to close before failing."""
READ_WAIT_S = 30.0
"""How long a reader waits for a run's write to finish (a stage's rows take well under a second)."""
FIRST_DELAY_S, MAX_DELAY_S = 0.005, 0.1
_HOLDER = re.compile(r"Conflicting lock is held in (.*?) \(PID (\d+)\)")


class CatalogBusy(RuntimeError):
    """Another process kept DuckDB's lock on the catalog for the whole bounded wait."""


def _env_seconds(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ[name]))
    except (KeyError, ValueError):
        return default


def is_lock_conflict(err: BaseException) -> bool:
    """DuckDB's "Could not set lock on file": another process holds the file."""
    return "could not set lock" in str(err).lower()


def lock_holder(err: BaseException) -> str:
    """``PID n, /path/to/program`` from DuckDB's lock error, or ``another process``."""
    m = _HOLDER.search(str(err))
    return f"PID {m.group(2)}, {m.group(1)}" if m else "another process"


_WRITE_LOCK = threading.RLock()
"""One write connection at a time in this process (stages may run in threads): the checkpoint and
copy that publish ``catalog.duckdb`` then see no other transaction."""
_NESTING = threading.local()


class Catalog:
    def __init__(self, path: Path, write_wait_s: float | None = None, read_wait_s: float | None = None):
        self.path = Path(path)
        """The published copy every reader opens (``catalog.duckdb``)."""
        self.live = self.path.with_name(self.path.stem + ".live" + self.path.suffix)
        """What laminar writes (``catalog.live.duckdb``)."""
        self.write_wait_s = (
            _env_seconds("LAMINAR_CATALOG_WRITE_WAIT_S", WRITE_WAIT_S)
            if write_wait_s is None
            else write_wait_s
        )
        self.read_wait_s = (
            _env_seconds("LAMINAR_CATALOG_READ_WAIT_S", READ_WAIT_S) if read_wait_s is None else read_wait_s
        )

    def _open(self, read_only: bool, path: Path | None = None) -> Any:
        """``duckdb.connect`` (readers: the published copy; writers: the live file), retried while
        another process holds the file's lock (bounded)."""
        import duckdb

        path = Path(path) if path is not None else (self.path if read_only else self.live)
        wait = self.read_wait_s if read_only else self.write_wait_s
        t0 = time.monotonic()
        delay, warned, tries = FIRST_DELAY_S, False, 0
        while True:
            try:
                con = duckdb.connect(str(path), read_only=read_only)
                break
            except duckdb.IOException as err:
                if not is_lock_conflict(err):
                    raise
                waited = time.monotonic() - t0
                if waited >= wait:
                    if read_only:
                        msg = (
                            f"the catalog {path} is locked for writing by another process "
                            f"({lock_holder(err)}) and stayed locked for {waited:.1f} s; "
                            "try again in a moment"
                        )
                    else:
                        msg = (
                            f"the catalog {path} is held open by another process ({lock_holder(err)}) "
                            f"and stayed locked for {waited:.1f} s; close that connection (a notebook or "
                            "shell holding the catalog open) and rerun: finished stages come from cache"
                        )
                    raise CatalogBusy(msg) from None
                if not warned and not read_only and waited >= 5.0:
                    LOG.warning(
                        "catalog %s is locked by %s; waiting up to %.0f s", path, lock_holder(err), wait
                    )
                    warned = True
                time.sleep(min(delay * random.uniform(0.5, 1.5), max(0.0, wait - waited)))
                delay, tries = min(2 * delay, MAX_DELAY_S), tries + 1
        if tries:
            LOG.log(
                logging.DEBUG if read_only else logging.INFO,
                "catalog %s: %s waited %.3f s (%d retries) for another process's connection",
                path,
                "reader" if read_only else "writer",
                time.monotonic() - t0,
                tries,
            )
        return con

    @contextmanager
    def connect(self, read_only: bool = False) -> Iterator[Any]:
        """A connection: read-only ones to the published ``catalog.duckdb`` (an empty in-memory catalog
        before the first write), read-write ones to the live file, published when they close."""
        if read_only:
            import duckdb

            published = self.path.exists()  # once: the first write may publish it meanwhile
            con = self._open(True) if published else duckdb.connect(":memory:")
            if not published:
                con.execute(SCHEMA)
            try:
                yield con
            finally:
                con.close()
            return
        with _WRITE_LOCK:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._carry_over()
            con = self._open(False)
            _NESTING.depth = getattr(_NESTING, "depth", 0) + 1
            try:
                con.execute(SCHEMA)
                yield con
            finally:
                _NESTING.depth -= 1
                try:
                    if _NESTING.depth == 0:  # a connection opened inside another publishes with the outer one
                        self._publish(con)
                finally:
                    con.close()

    def _publish(self, con: Any) -> None:
        """Checkpoint the live file (the write-ahead log into the file) and replace ``catalog.duckdb``
        with a copy of it, atomically. A failure here (a full disk) leaves the previous copy and never
        hides the error of the write itself: it is logged, and the next write publishes again."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            con.execute("CHECKPOINT")
            shutil.copyfile(self.live, tmp)
            os.replace(tmp, self.path)
        except Exception as err:  # the live file holds the truth; readers keep the last copy
            tmp.unlink(missing_ok=True)
            LOG.warning(
                "catalog %s: could not publish the readers' copy (%s: %s); it stays at the last write",
                self.path,
                type(err).__name__,
                err,
            )

    def _carry_over(self) -> None:
        """A workspace from before the split has only ``catalog.duckdb``, written in place: fold its
        write-ahead log in and make it the live file (once)."""
        if self.live.exists() or not self.path.exists():
            return
        con = self._open(False, self.path)
        try:
            con.execute("CHECKPOINT")
        finally:
            con.close()
        tmp = self.live.with_name(f".{self.live.name}.{os.getpid()}.tmp")
        shutil.copyfile(self.path, tmp)
        os.replace(tmp, self.live)

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """All-or-nothing writes: a crash inside leaves no partial rows."""
        with self.connect() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict]:
        with self.connect(read_only=True) as con:
            cur = con.execute(sql, list(params))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, row)) for row in cur.fetchall()]

    def insert_rows(
        self, con: Any, table: str, rows: Sequence[dict], on_conflict: str = "DO NOTHING"
    ) -> None:
        if rows:
            cols = list(rows[0])
            insert_many(con, table, cols, [[r[c] for c in cols] for r in rows], on_conflict)


def insert_many(
    con: Any,
    table: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    on_conflict: str = "DO NOTHING",
) -> None:
    """Insert ``rows`` (tuples in ``columns`` order) as one statement over an Arrow table: DuckDB's
    ``executemany`` runs one statement per row (5,000 metric rows took 17.6 s, this 0.4 s). Rows
    with the same key keep the last one, as row-by-row inserts did."""
    if not rows:
        return
    import polars as pl

    frame = pl.DataFrame(
        [list(r) for r in rows], schema=list(columns), orient="row", infer_schema_length=None
    )
    con.register("_laminar_rows", frame.to_arrow())
    try:
        cols = ", ".join(columns)
        con.execute(
            f"INSERT INTO {table} ({cols}) SELECT {cols} FROM _laminar_rows ON CONFLICT {on_conflict}"
        )
    finally:
        con.unregister("_laminar_rows")


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
