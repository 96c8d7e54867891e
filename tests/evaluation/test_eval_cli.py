"""`laminar eval` and `laminar report` through the real CLI on one tiny workspace: rows land in the
catalog once per (checkpoint, eval artifact, benchmark, problem, sample) however often the evaluation
runs or is killed, a save_pretrained folder is evaluated like a catalog checkpoint, and the report
writes its markdown and plots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "data.pool_size=200",
    "data.heldout_size=20",
    "sft.steps=10",
    "sft.batch_size=8",
    "rl.steps=2",
    "rl.prompts_per_step=4",
    "rl.group_size=2",
    "rl.max_new_tokens=32",
    "eval.n_samples=2",
    "eval.max_new_tokens=32",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "curation.difficulty.max_prompts=50",
    "curation.difficulty.max_new_tokens=16",
    "curation.dart.budget=200",
    "curation.rft.steps=5",
]
EVAL = ["eval.n_samples=2", "eval.max_new_tokens=32"]
HELDOUT = 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def laminar(*args: str, ws: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"laminar {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def query(ws: Path, sql: str, params=()) -> list[tuple]:
    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def eval_run(ws: Path, run_id: str) -> dict:
    return json.loads((ws / "runs" / run_id / "summary.json").read_text())


def latest_eval_summary(ws: Path) -> dict:
    runs = sorted(
        (p for p in (ws / "runs").iterdir() if p.name.startswith("eval-")), key=lambda p: p.stat().st_mtime
    )
    return eval_run(ws, runs[-1].name)


def row_counts(ws: Path, checkpoint: str, eval_sha: str) -> tuple[int, int]:
    """(rows, distinct (benchmark, problem, sample)) of one evaluation of one checkpoint."""
    return query(
        ws,
        "SELECT count(*), count(DISTINCT (benchmark, problem_id, sample_idx)) FROM eval_results "
        "WHERE checkpoint_sha = ? AND eval_sha = ?",
        [checkpoint, eval_sha],
    )[0]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    ws = tmp_path_factory.mktemp("eval_ws")
    laminar("run", *TINY, ws=ws)
    runs = [p for p in (ws / "runs").iterdir()]
    summary = json.loads((runs[0] / "summary.json").read_text())
    return ws, summary


def test_eval_by_sha_prefix_is_idempotent(workspace):
    ws, summary = workspace
    rl = summary["checkpoints"]["rl"]
    out = laminar("eval", f"ckpt={rl[:10]}", *EVAL, ws=ws).stdout
    assert "arith_heldout" in out and "avg@2" in out and "pass@2" in out and "maj@2" in out, out
    first = latest_eval_summary(ws)
    assert first["checkpoint"]["sha256"] == rl
    ev = first["eval"]
    assert row_counts(ws, rl, ev) == (HELDOUT * 2, HELDOUT * 2)

    laminar("eval", f"ckpt={rl[:10]}", *EVAL, ws=ws)
    second = latest_eval_summary(ws)
    assert second["status"] == "cached" and second["eval"] == ev
    assert row_counts(ws, rl, ev) == (HELDOUT * 2, HELDOUT * 2)
    dup = query(
        ws,
        "SELECT count(*) FROM (SELECT count(*) AS n FROM eval_results GROUP BY checkpoint_sha, eval_sha, "
        "benchmark, problem_id, sample_idx HAVING n > 1)",
    )
    assert dup == [(0,)]


def test_max_problems_evaluates_a_seeded_subset_and_counts_prompts_over_the_context(workspace):
    """`eval.max_problems=N`: N problems of the benchmark, the same for every checkpoint, part of the
    cache key and printed with the score; prompts longer than the model's context are counted."""
    ws, summary = workspace
    from evaluation.benchmarks import build_prompt, load_benchmark
    from evaluation.stages import subset
    from generation.model import encode_prompt, load_model

    args = ["eval.benchmarks=[gsm8k]", "eval.max_problems=12", "eval.n_samples=1", "eval.max_new_tokens=4"]
    out = laminar("eval", f"ckpt={summary['checkpoints']['rl'][:12]}", *args, ws=ws).stdout
    s = latest_eval_summary(ws)
    g = s["benchmarks"]["gsm8k"]
    full = load_benchmark("gsm8k")
    assert (g["n_problems"], g["problems_total"]) == (12, len(full)) and f"12/{len(full)}" in out
    picked = subset(full, 12, seed=0, name="gsm8k")
    ids = {
        r[0]
        for r in query(ws, "SELECT DISTINCT problem_id FROM eval_results WHERE eval_sha = ?", [s["eval"]])
    }
    assert ids == {it.problem_id for it in picked}
    model, tokenizer = load_model(ws / "artifacts" / "model" / summary["checkpoints"]["rl"])
    context = model.config.max_position_embeddings
    expected = sum(len(encode_prompt(tokenizer, build_prompt(it))) > context for it in picked)
    assert (g["too_long"], g["context"]) == (expected, context) and expected > 0
    assert f"{expected} > {context}" in out and "longer than the model's" in out
    # the same subset for another checkpoint; another size is another cache key
    laminar("eval", f"ckpt={summary['checkpoints']['warmup'][:12]}", *args, ws=ws)
    warm = latest_eval_summary(ws)
    assert {
        r[0]
        for r in query(ws, "SELECT DISTINCT problem_id FROM eval_results WHERE eval_sha = ?", [warm["eval"]])
    } == ids
    laminar(
        "eval",
        f"ckpt={summary['checkpoints']['rl'][:12]}",
        *args[:1],
        "eval.max_problems=13",
        *args[2:],
        ws=ws,
    )
    assert (
        latest_eval_summary(ws)["status"] == "ran" and latest_eval_summary(ws)["cache_key"] != s["cache_key"]
    )


def test_bad_ckpt_fails_with_a_clear_message(workspace):
    ws, _ = workspace
    missing = laminar("eval", *EVAL, ws=ws, check=False)
    assert missing.returncode == 2 and "ckpt=" in missing.stderr
    unknown = laminar("eval", "ckpt=abcdef0123", *EVAL, ws=ws, check=False)
    assert unknown.returncode == 2 and "no checkpoint" in unknown.stderr and "recent ones" in unknown.stderr


def test_killed_evaluation_reruns_to_one_row_per_sample(workspace):
    ws, summary = workspace
    warm = summary["checkpoints"]["warmup"]
    args = [f"ckpt={warm[:12]}", "eval.n_samples=48", "eval.max_new_tokens=32", "seed=7"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "eval", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    sampling = threading.Event()

    def watch() -> None:  # the progress bar of the evaluation appears once the model is loaded
        seen = b""
        while chunk := os.read(proc.stderr.fileno(), 4096):
            seen = (seen + chunk)[-4096:]
            if b"evaluate:" in seen:
                sampling.set()

    threading.Thread(target=watch, daemon=True).start()
    assert sampling.wait(timeout=180), "the evaluation never started sampling"
    assert proc.poll() is None, "the evaluation finished before it could be killed; raise eval.n_samples"
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its verifier workers
    proc.wait()
    tmp = ws / "artifacts" / ".tmp"

    incomplete = [p for p in (ws / "artifacts" / "eval").iterdir() if not (p / "manifest.json").exists()]
    assert incomplete == []
    killed_run = query(
        ws, "SELECT run_id, status FROM runs WHERE run_id LIKE 'eval-%' ORDER BY started_at DESC LIMIT 1"
    )
    assert killed_run[0][1] == "running"  # never reached its end

    laminar("eval", *args, ws=ws)
    done = latest_eval_summary(ws)
    assert done["status"] == "ran"
    assert row_counts(ws, warm, done["eval"]) == (HELDOUT * 48, HELDOUT * 48)
    assert not list(tmp.glob("eval-*"))  # the killed writer's folder was cleaned up, never published


def test_eval_of_a_save_pretrained_folder(workspace, tmp_path):
    ws, summary = workspace
    rl = summary["checkpoints"]["rl"]
    import torch

    from generation.model import load_model

    model, tokenizer = load_model(ws / "artifacts" / "model" / rl)
    with torch.no_grad():  # a checkpoint the catalog has never seen
        next(model.parameters()).add_(0.01)
    folder = tmp_path / "exported"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert not (folder / "manifest.json").exists()
    out = laminar("eval", f"ckpt={folder}", *EVAL, ws=ws).stdout
    assert "arith_heldout" in out
    s = latest_eval_summary(ws)
    assert s["checkpoint"]["path"] == str(folder.resolve())
    sha = s["checkpoint"]["sha256"]
    assert row_counts(ws, sha, s["eval"]) == (HELDOUT * 2, HELDOUT * 2)
    assert sha not in summary["checkpoints"].values()
    assert query(ws, "SELECT stage FROM checkpoints WHERE checkpoint_sha = ?", [sha]) == [("external",)]


def test_report_writes_markdown_and_plots(workspace):
    ws, summary = workspace
    out = laminar("report", ws=ws).stdout
    report_dir = ws / "runs" / summary["run_id"] / "report"
    assert str(report_dir / "report.md") in out
    text = (report_dir / "report.md").read_text()
    for heading in ("Benchmark accuracy per checkpoint", "RL reward and response length", "difficulty level"):
        assert heading in text
    assert summary["checkpoints"]["rl"][:12] in text and "warm-up" in text
    pngs = sorted(report_dir.glob("*.png"))
    assert {p.name for p in pngs} == {
        "benchmark_accuracy.png",
        "rl_reward_length.png",
        "accuracy_by_level.png",
    }
    for p in pngs:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, p
    assert f"]({pngs[0].name})" in text
    # naming the run gives the same report; an unknown run fails clearly
    assert laminar("report", summary["run_id"], ws=ws).returncode == 0
    bad = laminar("report", "no-such-run", ws=ws, check=False)
    assert bad.returncode == 2 and "no run" in bad.stderr
