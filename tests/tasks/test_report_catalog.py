"""``laminar report`` on a hand-made catalog: the learned reward model's metrics, which the catalog's
per-sample rows do not hold, come from each evaluation artifact's summary.json; a checkpoint
evaluated without a reward model has none, and a run without one has no reward-model section."""

from __future__ import annotations

import json

from core.workspace import Workspace
from tasks.report import gather, write

RUN = "run-rm"


def _catalog(tmp_path, rm_summary: dict | None) -> Workspace:
    """One run: a warm-up checkpoint and its eval stage (summary.json ``rm_summary`` merged in, when
    given), and an RFT checkpoint evaluated without a reward model."""
    ws = Workspace.at(tmp_path / "ws")
    ws.create()
    stages, arts, rows = [], [], []
    for role, ckpt, ev, extra in (
        ("warmup", "a" * 64, "e" * 64, rm_summary),
        ("rft", "b" * 64, "f" * 64, None),
    ):
        folder = ws.root / "artifacts" / "eval" / ev
        folder.mkdir(parents=True)
        summary = {"n_samples": 2, "context": 64, "too_long": 0, **(extra or {})}
        (folder / "summary.json").write_text(json.dumps({"arith_heldout": summary}))
        model = {"kind": "model", "sha256": ckpt, "path": f"artifacts/model/{ckpt}"}
        evalref = {"kind": "eval", "sha256": ev, "path": f"artifacts/eval/{ev}"}
        stages += [(role, {"model": model}), (f"eval_{role}", {"eval": evalref})]
        arts.append((ev, f"artifacts/eval/{ev}", f"eval_{role}"))
        rows += [(ckpt, ev, f"p{p}", i, p == i == 0) for p in range(2) for i in range(2)]
    with ws.catalog.transaction() as con:
        con.execute(
            "INSERT INTO runs VALUES (?, now(), now(), 'completed', 'laminar run', '{}', NULL)", [RUN]
        )
        for i, (stage, outputs) in enumerate(stages):
            con.execute(
                "INSERT INTO stage_runs (run_id, stage, status, cache_key, started_at, seconds, "
                "outputs_json, metrics_json) VALUES (?, ?, 'ran', ?, now() + to_seconds(?), 1.0, ?, '{}')",
                [RUN, stage, f"key-{stage}", i, json.dumps(outputs)],
            )
        for sha, path, stage in arts:
            con.execute(
                "INSERT INTO artifacts VALUES ('eval', ?, ?, now(), ?, NULL, '{}')", [sha, path, stage]
            )
        for ckpt, ev, pid, idx, correct in rows:
            con.execute(
                "INSERT INTO eval_results (checkpoint_sha, eval_sha, benchmark, problem_id, sample_idx, "
                "pred, correct, length, truncated) VALUES (?, ?, 'arith_heldout', ?, ?, '3', ?, 5, false)",
                [ckpt, ev, pid, idx, correct],
            )
    return ws


def test_the_report_reads_the_reward_model_metrics_from_the_evaluation_artifacts(tmp_path):
    rm = {"reward/reward_model": 0.625, "reward_errors/reward_model": 1, "rm_best@2": 0.5}
    ws = _catalog(tmp_path, rm)
    warm, rft = gather(ws, RUN).evals
    assert (warm.role, rft.role) == ("warmup", "rft") and warm.summary["accuracy"] == 0.25
    assert {k: warm.summary[k] for k in rm} == rm
    assert not any(k in rft.summary for k in rm)  # evaluated without a reward model
    report = write(ws, RUN).read_text()
    assert "| warm-up | arith_heldout | 2 | 0.625 | 0.250 | 0.500 | 0.500 | 1 |" in report
    assert (ws.run_dir(RUN) / "report" / "reward_model.png").exists()


def test_a_run_without_a_reward_model_reports_none(tmp_path):
    ws = _catalog(tmp_path, None)
    evals = gather(ws, RUN).evals
    assert evals and not any("rm_best@2" in e.summary or "reward/reward_model" in e.summary for e in evals)
    report = write(ws, RUN).read_text()
    assert "reward model" not in report.lower() and "RM score" not in report
    assert not (ws.run_dir(RUN) / "report" / "reward_model.png").exists()
