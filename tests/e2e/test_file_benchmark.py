"""A benchmark from a file, through the real CLI: a run with it in ``eval.benchmarks`` decontaminates
the pool against it (training prompts copied into the file are removed, under the file's hash), and
`laminar eval` scores a checkpoint on it with its certificate line."""

from __future__ import annotations

import json

import pytest

from core.artifacts import hash_file
from data_curation.synthetic import generate
from tests.configs import TINY_CURATED
from tests.evaluation.test_eval_cli import laminar, latest_eval_summary, query

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # one tiny pipeline run (about a minute on 2 cores)
EVAL = ["eval.n_samples=1", "eval.max_new_tokens=16"]
COPIED = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("file_bench")
    pool, _ = generate(0, 200, 20, [1, 2, 3, 4, 5])  # TINY_CURATED's pool (seed 0)
    rows = [
        {"uid": f"copy{i}", "question": p.problem, "final": p.answer} for i, p in enumerate(pool[:COPIED])
    ]
    rows += [
        {
            "uid": "own0",
            "question": "A train leaves at noon and travels 60 miles per hour. How far in 3 hours?",
            "final": "180",
        },
        {
            "uid": "own1",
            "question": "How many sides does a hexagon have, counting every edge once?",
            "final": 6,
        },
    ]
    path = tmp / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = f"{{name: mine, path: {path}, problem_field: question, answer_field: final, id_field: uid}}"
    ws = tmp / "ws"
    laminar("run", *TINY_CURATED, f"eval.benchmarks=[arith_heldout,{spec}]", ws=ws)
    summary = json.loads(next((ws / "runs").glob("2*/summary.json")).read_text())
    return ws, summary, path, spec, [p.problem for p in pool[:COPIED]]


def test_training_prompts_copied_into_the_file_benchmark_are_removed(run):
    ws, summary, path, _, copied = run
    pool_cert = json.loads(next((ws / "artifacts" / "prompts").glob("*/certificate.json")).read_text())
    assert pool_cert["benchmarks"]["mine"]["sha256"] == hash_file(path)
    assert pool_cert["benchmarks"]["mine"]["removed"] == COPIED
    hits = query(ws, "SELECT benchmark_problem_id FROM contamination WHERE benchmark = 'mine' ORDER BY 1")
    assert [h[0] for h in hits] == [f"copy{i}" for i in range(COPIED)]
    assert summary["certificates"]["eval_rl"]["mine"] == "contaminated-removed"


def test_laminar_eval_scores_the_file_benchmark_with_its_certificate(run):
    ws, summary, path, spec, _ = run
    rl = summary["checkpoints"]["rl"]
    scored = spec[:-1] + ", score_with: [math_verify, repetition, format]}"
    out = laminar("eval", f"ckpt={rl[:12]}", f"eval.benchmarks=[{scored}]", *EVAL, ws=ws).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("mine") and "sha256" in x)
    assert "contaminated-removed" in line and hash_file(path)[:12] in line, out
    terms = next(x for x in out.splitlines() if x.startswith("mine reward terms (mean): "))
    assert " repetition " in f" {terms}" and " format " in terms, out
    s = latest_eval_summary(ws)
    assert s["certificates"]["mine"]["status"] == "contaminated-removed"
    rows = query(
        ws,
        "SELECT count(*) FROM eval_results WHERE checkpoint_sha = ? AND eval_sha = ? AND benchmark = 'mine'",
        [rl, s["eval"]],
    )
    assert rows[0][0] == 6  # 6 problems x 1 sample


def test_a_bad_file_spec_fails_before_any_write(run, tmp_path):
    ws, summary, path, _, _ = run
    fresh = tmp_path / "fresh_ws"
    proc = laminar(
        "eval",
        f"ckpt={summary['checkpoints']['rl'][:12]}",
        f"eval.benchmarks=[{{name: mine, path: {path}, answer_field: gold}}]",
        ws=fresh,
        check=False,
    )
    assert proc.returncode != 0
    assert "row 0 has no field 'problem' (problem_field)" in proc.stderr + proc.stdout
    assert not fresh.exists()
