import pytest

from core.catalog import Catalog
from core.workspace import Workspace, WorkspaceBusy


def test_idempotent_inserts_and_rollback(tmp_path):
    cat = Catalog(tmp_path / "c.duckdb")
    row = {
        "checkpoint_sha": "c1",
        "eval_sha": "e1",
        "benchmark": "b",
        "problem_id": "p",
        "sample_idx": 0,
        "response": "r",
        "pred": "1",
        "correct": True,
        "error": None,
        "length": 3,
        "truncated": False,
        "level": "1",
    }
    for _ in range(2):
        with cat.transaction() as con:
            cat.insert_rows(con, "eval_results", [row])
    assert cat.query("SELECT count(*) AS n FROM eval_results")[0]["n"] == 1
    with pytest.raises(RuntimeError):
        with cat.transaction() as con:
            cat.insert_rows(con, "eval_results", [{**row, "sample_idx": 1}])
            raise RuntimeError("crash mid-stage")
    assert cat.query("SELECT count(*) AS n FROM eval_results")[0]["n"] == 1


def test_read_only_query_on_missing_catalog(tmp_path):
    cat = Catalog(tmp_path / "none.duckdb")
    assert cat.query("SELECT count(*) AS n FROM runs")[0]["n"] == 0
    assert not (tmp_path / "none.duckdb").exists()


def test_second_writer_fails_at_once(tmp_path):
    ws = Workspace.at(tmp_path / "ws")
    with ws.lock():
        with pytest.raises(WorkspaceBusy, match="in use by another laminar process"):
            with ws.lock():
                pass
    with ws.lock():  # released
        pass
