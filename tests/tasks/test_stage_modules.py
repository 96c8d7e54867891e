"""A stage is one module of ``tasks.stages``: the DAG table lists them, each stage's source fingerprint
comes from its module's imports (``tasks.cache.stage_modules``), its own tables and rows are
declared beside its body, and the summary, report and trackers read its metadata, never its name."""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path

from conf.schema import Config
from core.workspace import Workspace
from tasks import cache, recording
from tasks.cache import CacheKey, stage_modules
from tasks.dag import EVAL_STAGE, STAGE_BY_NAME, STAGES
from tasks.records import Stage, StageOutcome, StageResult

ROOT = Path(__file__).resolve().parents[2]


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_stage_fingerprints_what_its_module_and_the_stages_it_borrows_from_import(tmp_path):
    for rel in (
        "data_curation/x.py",
        "training/t.py",
        "evaluation/e.py",
        "core/catalog.py",
        "generation/g.py",
    ):
        _write(tmp_path, rel)
    _write(
        tmp_path,
        "tasks/stages/foo.py",
        "from typing import TYPE_CHECKING\n"
        "from tasks.stages.common import helper\n"
        "from tasks.stages.bar import borrowed\n"
        "if TYPE_CHECKING:\n    from core.catalog import Catalog\n"
        "def body(ctx):\n    from data_curation.x import run\n    import generation.g\n",
    )
    _write(tmp_path, "tasks/stages/bar.py", "def borrowed():\n    from training.t import fit\n")
    _write(tmp_path, "tasks/stages/common.py", "def helper():\n    from evaluation.e import note\n")
    found = stage_modules("tasks.stages.foo", tmp_path)
    # an annotation-only import runs nothing; the shared helpers are not followed
    assert found == ("data_curation.x", "generation.g", "training.t")
    _write(tmp_path, "tasks/stages/baz.py", "import generation.g\n")
    assert stage_modules("tasks.stages.baz", tmp_path) == ("generation.g",)


def test_each_stage_fingerprints_the_library_its_body_calls():
    expect = {
        "data": {"data_curation.synthetic", "data_curation.sources"},
        "ingest": {"data_curation.ingest"},
        "decontaminate": {"data_curation.decontaminate", "evaluation.stages"},
        "preferences": {"data_curation.annotators", "data_curation.decontaminate", "evaluation.stages"},
        "warmup": {"training.warmup", "generation.setup"},
        "difficulty": {"data_curation.sampling", "rewards.verdicts"},
        "dart": {"data_curation.sampling", "data_curation.dart"},
        "rft": {"training.rft"},
        "select": {"data_curation.hive"},
        "rl": {"training.rl.stage", "evaluation.stages", "rewards.compose"},
        "eval_rl": {"evaluation.stages", "data_curation.synthetic"},
    }
    for name, modules in expect.items():
        assert modules <= set(STAGE_BY_NAME[name].modules), name
    # the catalog and the report's formatting are nobody's computation
    closure = {m for s in (*STAGES, EVAL_STAGE) for m, _ in cache.module_closure(tuple(sorted(s.modules)))}
    assert "core.catalog" not in closure and "evaluation.report" not in {
        m for s in STAGES if not s.step_metrics for m, _ in cache.module_closure(tuple(sorted(s.modules)))
    }


def test_every_stage_module_is_in_the_dag_table():
    """A module added under ``tasks/stages/`` that the table leaves out would never run."""
    listed = {s.body.__module__ for s in (*STAGES, EVAL_STAGE)}
    modules = {
        f"tasks.stages.{p.stem}"
        for p in (ROOT / "tasks" / "stages").glob("*.py")
        if p.stem not in ("__init__", "common")
    }
    assert modules == listed


def test_summary_report_and_tracking_name_no_stage():
    names = {s.name for s in (*STAGES, EVAL_STAGE)}
    for rel in ("tasks/report.py", "tasks/summary.py", "tasks/tracking.py"):
        literals = {
            n.value
            for n in ast.walk(ast.parse((ROOT / rel).read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        assert not literals & names, (rel, literals & names)


def test_a_stage_declares_its_own_table_and_rows(tmp_path):
    """``Stage.tables`` is created in the runner's transaction before the stage's ``record`` hook:
    a new stage's rows need no edit of ``core.catalog``."""
    ws = Workspace.at(tmp_path / "ws")
    with ws.artifacts.create("toy") as pending:
        (pending.dir / "n.txt").write_text("3")
    ref = pending.ref

    def record(con, ctx, res, key):
        n = int(res.artifacts["toy"].file("n.txt").read_text())
        con.execute(
            "INSERT INTO toy_rows VALUES (?, ?) ON CONFLICT DO NOTHING", [res.artifacts["toy"].sha256, n]
        )

    stage = Stage(
        name="toy",
        inputs={},
        config=lambda c: {},
        body=lambda ctx: StageResult({"toy": ref}),
        tables="CREATE TABLE IF NOT EXISTS toy_rows (artifact_sha VARCHAR PRIMARY KEY, n BIGINT);",
        record=record,
    )
    out = StageOutcome("toy", "ran", 0.1, CacheKey("toy", "c", "i", "s", 0), StageResult({"toy": ref}), None)
    recording.open_run(ws, "r1", "laminar run", {}, None)
    for _ in range(2):  # a replayed stage writes its rows once
        recording.record_stage_run(ws, "r1", stage, out, {}, datetime.now(UTC), Config(), "cpu")
    assert ws.catalog.query("SELECT artifact_sha, n FROM toy_rows") == [{"artifact_sha": ref.sha256, "n": 3}]
