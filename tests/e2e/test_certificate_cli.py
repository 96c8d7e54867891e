"""The decontamination certificate through the real CLI: a run whose pool was checked against
arith_heldout and math500 only; `laminar eval` of its RL checkpoint on aime24 says `not-checked` (in
its output, its summary, the catalog, `laminar lineage` and `laminar report`), the benchmarks it
was checked against say `clean`, and a checkpoint from outside the store is `unknown-origin`."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from tests.configs import TINY_CURATED
from tests.evaluation.test_eval_cli import laminar, latest_eval_summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # one tiny pipeline run (about a minute on 2 cores)
EVAL = ["eval.n_samples=1", "eval.max_new_tokens=16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ws = tmp_path_factory.mktemp("cert_ws")
    out = laminar("run", *TINY_CURATED, "curation.decontam.benchmarks=[math500]", ws=ws).stdout
    summary = json.loads(next((ws / "runs").glob("2*/summary.json")).read_text())
    return ws, summary, out


def test_run_summary_certifies_its_own_scores(run):
    ws, summary, out = run
    assert set(summary["certificates"]) == {"eval_warmup", "eval_rft", "eval_rl"}
    assert all(c == {"arith_heldout": "clean"} for c in summary["certificates"].values())
    assert "decontamination certificates: eval_warmup arith_heldout clean" in out
    pool = json.loads(next((ws / "artifacts" / "prompts").glob("*/certificate.json")).read_text())
    assert set(pool["benchmarks"]) == {"arith_heldout", "math500"}
    assert (
        pool["benchmarks"]["math500"]["sha256"]
        == "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"
    )  # the vendored file (data README)


def test_eval_on_a_benchmark_the_pool_was_not_checked_against(run):
    ws, summary, _ = run
    rl = summary["checkpoints"]["rl"]
    out = laminar("eval", f"ckpt={rl[:12]}", "eval.benchmarks=[arith_heldout,aime24]", *EVAL, ws=ws).stdout
    aime = next(line for line in out.splitlines() if line.strip().startswith("aime24") and "sha256" in line)
    assert "not-checked" in aime and "af2b8bd2aa91" in aime and "['arith_heldout', 'math500']" in aime, out
    held = next(
        line for line in out.splitlines() if line.strip().startswith("arith_heldout") and "sha256" in line
    )
    assert " clean " in held
    s = latest_eval_summary(ws)
    assert s["certificates"]["aime24"]["status"] == "not-checked"
    assert s["certificates"]["aime24"]["benchmark_sha256"].startswith("af2b8bd2aa91")
    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT benchmark, certificate, count(*) FROM eval_results WHERE checkpoint_sha = ? "
            "AND eval_sha = ? GROUP BY ALL ORDER BY 1",
            [rl, s["eval"]],
        ).fetchall()
        unset = con.execute("SELECT count(*) FROM eval_results WHERE certificate IS NULL").fetchone()[0]
    finally:
        con.close()
    assert rows == [("aime24", "not-checked", 30), ("arith_heldout", "clean", 20)] and unset == 0

    lineage = laminar("lineage", rl[:12], ws=ws).stdout
    assert "decontamination: not-checked against aime24" in lineage
    assert "decontamination: clean against arith_heldout" in lineage
    laminar("report", ws=ws)
    report = (ws / "runs" / summary["run_id"] / "report" / "report.md").read_text()
    assert "aime24 (not-checked)" in report and "arith_heldout (" not in report


def test_checkpoint_from_outside_the_store_is_unknown_origin(run, tmp_path):
    ws, summary, _ = run
    import torch

    from generation.model import load_model

    model, tokenizer = load_model(ws / "artifacts" / "model" / summary["checkpoints"]["rl"])
    with torch.no_grad():  # weights the catalog has never seen: nobody here knows what they learned from
        next(model.parameters()).add_(0.01)
    folder = Path(tmp_path) / "exported"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = laminar("eval", f"ckpt={folder}", *EVAL, ws=ws).stdout
    cert = latest_eval_summary(ws)["certificates"]["arith_heldout"]
    assert cert["status"] == "unknown-origin" and "outside the store" in cert["detail"]
    assert any(
        line.strip().startswith("arith_heldout") and "unknown-origin" in line for line in out.splitlines()
    )
