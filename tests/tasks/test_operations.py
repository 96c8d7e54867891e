"""Stage selections computed from the DAG (never from a list of names), stale-run bookkeeping and the
Prefect asset events of a stage: no pipeline run, no Prefect server."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from core.artifacts import ArtifactRef
from core.workspace import Workspace
from tasks.cache import make_key
from tasks.dag import (
    DEFAULT_CONFIG,
    STAGE_BY_NAME,
    STAGES,
    UnknownStage,
    active_inputs,
    stages_of,
    downstream_of,
    in_dag_order,
    select,
    upstream_of,
)
from tasks.operate import orphan_prefect_servers, workspace_busy
from tasks.prefect_publish import artifact_key, asset_events, asset_key, metric_rows
from tasks.recording import mark_interrupted
from tasks.records import StageOutcome, StageResult

NAMES = [s.name for s in stages_of()]  # the default run's stages


def _sources(name: str) -> set[str]:
    """The stages ``name`` reads from in the default run (an input from a stage it leaves out is not read)."""
    return {src for src, _ in active_inputs(STAGE_BY_NAME[name], DEFAULT_CONFIG).values()}


def _readers(name: str) -> set[str]:
    return {s.name for s in stages_of() if name in _sources(s.name)}


@pytest.mark.parametrize("name", NAMES)
def test_downstream_closure_is_every_transitive_reader(name):
    down = downstream_of([name])
    assert name in down
    for other in down - {name}:  # each one reads from something in the closure
        assert _sources(other) & down, other
    for member in down:  # and nothing that reads from the closure is missing
        assert _readers(member) <= down


@pytest.mark.parametrize("name", NAMES)
def test_upstream_closure_is_every_transitive_source(name):
    up = upstream_of([name])
    assert name in up
    for member in up:
        assert _sources(member) <= up
    assert all(name in downstream_of([u]) for u in up)


@pytest.mark.parametrize("name", NAMES)
def test_rerun_forces_the_stage_and_its_downstream_and_runs_only_what_they_need(name):
    sel = select(rerun=name)
    assert set(sel.force) == downstream_of([name])
    assert set(sel.stages) == upstream_of(downstream_of([name]))
    assert sel.stages == in_dag_order(sel.stages)  # the flow walks STAGES in order
    # whatever is not forced comes from cache: only upstream stages of the forced set
    for s in set(sel.stages) - set(sel.force):
        assert downstream_of([s]) & set(sel.force)


@pytest.mark.parametrize("name", NAMES)
def test_until_runs_the_stage_and_its_upstream(name):
    sel = select(until=name)
    assert set(sel.stages) == upstream_of([name]) and sel.force == []
    order = {n: i for i, n in enumerate(NAMES)}
    for s in sel.stages:  # every input is produced before it is read
        assert all(order[src] < order[s] for src in _sources(s))


def test_default_selection_is_the_whole_dag_and_unknown_stages_fail():
    assert select().stages is None
    assert select(force=[NAMES[-1]]).force == [NAMES[-1]]
    with pytest.raises(UnknownStage, match="stages are"):
        select(until="no_such_stage")
    with pytest.raises(UnknownStage):
        select(rerun="nope")
    with pytest.raises(UnknownStage):
        select(force=["nope"])


def test_force_outside_until_is_dropped():
    last = NAMES[-1]
    first = next(s.name for s in STAGES if not s.inputs)
    assert select(until=first, force=[last]).force == []


def test_stale_running_rows_are_marked_interrupted(tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    ws.create()
    with ws.catalog.transaction() as con:
        con.execute("INSERT INTO runs VALUES ('a', now(), NULL, 'running', 'laminar run', '{}', NULL)")
        con.execute("INSERT INTO runs VALUES ('b', now(), now(), 'completed', 'laminar run', '{}', NULL)")
    assert mark_interrupted(ws) == ["a"]
    rows = {r["run_id"]: r["status"] for r in ws.catalog.query("SELECT run_id, status FROM runs")}
    assert rows == {"a": "interrupted", "b": "completed"}
    assert mark_interrupted(ws) == []


def test_workspace_busy_reads_the_lock_without_taking_it(tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    assert not workspace_busy(ws)
    with ws.lock():
        assert workspace_busy(ws)
        # asking never takes the lock: another process could still fail to lock it right now
        fd = os.open(ws.root / ".lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not workspace_busy(ws)


def test_no_orphan_servers_for_a_fresh_workspace(tmp_path):
    assert orphan_prefect_servers(Workspace.at(tmp_path / "ws")) == []


def _in_prefect(tmp_path: Path, code: str, *args: str) -> None:
    """Run ``code`` (``sys`` imported) in a fresh interpreter with its Prefect home in ``tmp_path``."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root), "PREFECT_HOME": str(tmp_path / "prefect")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_cron_expressions_are_checked(tmp_path):
    from tasks.serving import ServeError, check_cron_shape

    assert check_cron_shape("0 3 * * *") == "0 3 * * *" and check_cron_shape("*/5 1-3 * jan mon-fri")
    for bad in ("bad cron", "* * *", "0 3 * * * * *", "0 3 * * {x}"):
        with pytest.raises(ServeError, match="not a cron expression"):
            check_cron_shape(bad)
    _in_prefect(
        tmp_path,
        "from tasks.serving import ServeError, check_cron\n"
        "assert check_cron('0 3 * * *') == '0 3 * * *'\n"
        "try:\n    check_cron('99 * * * *')\nexcept ServeError as e:\n    assert 'Invalid cron' in str(e)\n"
        "else:\n    raise AssertionError('accepted')\n",
    )


def _Outcome(stage, status, artifacts, metrics) -> StageOutcome:
    key = make_key(stage, {}, {}, STAGE_BY_NAME[stage].modules, 0)
    return StageOutcome(stage, status, 0.5, key, StageResult(artifacts, metrics), None)


def _stage_with_inputs():
    return next(s for s in STAGES if s.inputs)


def test_asset_events_follow_prefects_materialize_shape(tmp_path):
    ws = Workspace.at(tmp_path / "my ws")
    stage = _stage_with_inputs()
    inputs = {
        name: ArtifactRef(out, f"{i:064x}", f"/x/{i}")
        for i, (name, (_, out)) in enumerate(stage.inputs.items())
    }
    out = ArtifactRef("model", "f" * 64, "/x/out")
    ran = _Outcome(stage.name, "ran", {"model": out}, {"loss": 1.5, "nested": {"a": 1}})
    events = asset_events(ws, stage.name, ran, inputs)
    refs = [e for e in events if e["event"] == "prefect.asset.referenced"]
    mats = [e for e in events if e["event"] == "prefect.asset.materialization.succeeded"]
    assert len(refs) == len(inputs) and len(mats) == 1
    (mat,) = mats
    assert mat["resource"]["prefect.resource.id"] == asset_key(ws, stage.name, "model")
    upstream = {asset_key(ws, *stage.inputs[n]) for n in inputs}
    assert {
        r["prefect.resource.id"] for r in mat["related"] if r["prefect.resource.role"] == "asset"
    } == upstream
    assert mat["payload"]["sha256"] == out.sha256 and mat["payload"]["metrics"] == {
        "loss": 1.5,
        "nested.a": 1,
    }
    _in_prefect(
        tmp_path,
        "from pydantic import TypeAdapter\nfrom prefect.types import ValidAssetKey\n"
        "for key in sys.argv[1:]: TypeAdapter(ValidAssetKey).validate_python(key)\n",
        *[mat["resource"]["prefect.resource.id"], *upstream],
    )  # Prefect's own validation accepts the keys
    cached = _Outcome(stage.name, "cached", {"model": out}, {})
    assert (
        asset_events(ws, stage.name, cached, inputs) == []
    )  # like Prefect: a cache hit materialises nothing


def test_artifact_keys_and_metric_rows():
    for s in STAGES:
        key = artifact_key(s.name, "lineage")
        assert key.startswith("laminar-") and all(c.islower() or c.isdigit() or c == "-" for c in key)
    assert metric_rows({"a": {"b": 1, "c": {"d": 2}}, "e": None}) == [
        {"metric": "a.b", "value": 1},
        {"metric": "a.c.d", "value": 2},
        {"metric": "e", "value": None},
    ]


def test_operate_modules_import_without_prefect():
    import subprocess
    import sys

    code = (
        "import sys, tasks.operate, tasks.lineage, tasks.serving, tasks.prefect_publish, tasks.runner\n"
        "assert 'prefect' not in sys.modules, 'imported prefect'\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
