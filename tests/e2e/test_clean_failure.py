"""A failed `laminar run` through the real CLI says its one `laminar: ...` line and nothing else: no
Prefect ERROR repeats of the same failure, no traceback, no DuckDB (nanobind) leak report at exit.
The cheapest failure inside the Prefect flow: a source none of whose rows ingest keeps (a file that
does not parse fails before the run, in preflight: tests/flows/test_cli_bounds.py)."""

from __future__ import annotations

import pytest

from tests.e2e.test_operate import laminar

pytestmark = pytest.mark.e2e


def test_a_failed_stage_ends_the_run_with_its_one_line(tmp_path):
    source = tmp_path / "pool.json"
    source.write_text('[1, "two", {"problem": "1+1"}]\n')
    ws = tmp_path / "ws"
    proc = laminar(
        "run",
        "data.source=files",
        f"data.sources=[{{name: pool, path: {source}, format: json}}]",
        "eval.benchmarks=[gsm8k]",
        "--until",
        "ingest",
        ws=ws,
        check=False,
    )
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    assert proc.returncode == 1, out
    assert len(lines) == 3, out  # what the run is, the stage that ran, the failure
    assert lines[0].startswith("laminar: run ") and lines[0].endswith(
        "2 stages, each runs or comes from "
        "cache (when any must run, Prefect's local server starts first: ~15 s)"
    )
    assert lines[1].startswith("laminar: stage data ") and " ran " in lines[1]
    assert lines[2].startswith("laminar: the prompt pool is empty: none of its 3 rows was ingested")
    assert "(quarantined: not an object (int) 1, not an object (str) 1, missing answer 1)" in lines[2]
    assert "or pass --allow-empty" in lines[2]  # it says what to change
    assert proc.stderr.splitlines() == lines[2:]  # the failure on stderr, progress on stdout
