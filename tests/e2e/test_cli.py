"""The real `laminar` CLI end to end on a smaller config: accuracy rises, reruns come from cache,
changing rl.lr reruns exactly RL and its evaluation, config typos fail before any write."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAMINAR = [sys.executable, "-m", "flows.cli"]
# Smaller than the default: 50 RL steps instead of 100, difficulty on 600 prompts instead of 1,500 and a
# DART budget of 3,000 trials instead of 8,000 (warm-up must stay long enough for the tiny model to learn
# to copy operands: for some seeds that takes more than 600 steps).
# One torch thread: `make test` runs two pytest processes on 2 cores, and oversubscribed torch threads
# spin (the warm-up took 238 s instead of ~90 s).
# A short RFT (20 steps) leaves RL room to show learning: with the default 200 steps on DART's checked
# responses the RFT model starts RL near what 50 steps can reach (held-out 0.72 -> 0.73 on 2026-12-01).
SMALL = [
    "rl.steps=50",
    "curation.difficulty.max_prompts=600",
    "curation.dart.budget=3000",
    "curation.rft.steps=20",
    "threads=1",
]

pytestmark = pytest.mark.e2e


def laminar(*args: str, ws: Path, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*LAMINAR, *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"laminar {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def latest_summary(ws: Path) -> dict:
    runs = sorted((ws / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return json.loads((runs[-1] / "summary.json").read_text())


def tree(ws: Path) -> dict:
    return {str(p.relative_to(ws)): p.stat().st_mtime_ns for p in ws.rglob("*")} if ws.exists() else {}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    ws = tmp_path_factory.mktemp("ws")
    laminar("run", *SMALL, ws=ws)
    return ws, latest_summary(ws)


def test_first_run_learns(first_run):
    ws, summary = first_run
    assert all(s["status"] == "ran" for s in summary["stages"].values())
    m = summary["metrics"]
    assert m["heldout_accuracy_rl"] > m["heldout_accuracy_rft"] > m["heldout_accuracy_warmup"], m
    rl = summary["stages"]["rl"]["metrics"]
    assert rl["reward_last5"] > rl["reward_first"], rl
    run_dir = next(p for p in (ws / "runs").iterdir() if p.name == summary["run_id"])
    assert "rl:" in (run_dir / "config.yaml").read_text()


def test_dart_keeps_only_responses_whose_equations_hold(first_run):
    """The warm-up model imitates a teacher who slips (15% of steps), so some right answers come after
    a false step; DART's arithmetic check turns those down and keeps none in the RFT data."""
    import polars as pl

    from data_curation.dart import arithmetic_consistent

    ws, summary = first_run
    dart = summary["stages"]["dart"]
    assert dart["metrics"]["rejected_arithmetic"] > 0, dart["metrics"]
    data = pl.read_parquet(ws / "artifacts" / "rft_data" / dart["artifacts"]["rft_data"] / "rft.parquet")
    assert data.height == dart["metrics"]["rft_examples"] > 0
    assert all(arithmetic_consistent(r) for r in data["response"])


def test_first_run_is_tracked_in_tensorboard(first_run):
    """The default tracker (TensorBoard): every RL step's reward and the evaluation accuracy, read back
    with TensorBoard's own EventAccumulator (MLflow and W&B: tests/e2e/test_tracking_runs.py)."""
    from tests.tracking_readers import tensorboard_scalars

    ws, summary = first_run
    loc = json.loads((ws / "runs" / summary["run_id"] / "tracking.json").read_text())
    scalars = tensorboard_scalars(Path(loc["tensorboard"]["logdir"]))
    model = summary["stages"]["rl"]["artifacts"]["model"]
    history = [json.loads(line) for line in (ws / "artifacts" / "model" / model / "history.jsonl").open()]
    assert len(history) == 50
    assert scalars["rl/reward"] == [(m["step"], pytest.approx(m["reward"])) for m in history]
    for stage in ("eval_warmup", "eval_rft", "eval_rl"):
        acc = summary["stages"][stage]["metrics"]["arith_heldout"]["accuracy"]
        assert scalars[f"{stage}/arith_heldout/accuracy"] == [(0, pytest.approx(acc))]


def test_rerun_is_served_from_cache(first_run):
    ws, first = first_run
    laminar("run", *SMALL, ws=ws)
    summary = latest_summary(ws)
    assert {k: v["status"] for k, v in summary["stages"].items()} == {k: "cached" for k in first["stages"]}
    assert summary["metrics"] == first["metrics"]
    status = laminar("status", *SMALL, ws=ws).stdout
    assert all(line.split()[1] == "cached" for line in status.strip().splitlines()), status


def test_changing_rl_lr_reruns_rl_and_its_evaluation_only(first_run):
    ws, _ = first_run
    status = laminar("status", *SMALL, "rl.lr=0.0003", ws=ws).stdout
    stale = {line.split()[0] for line in status.strip().splitlines() if line.split()[1] == "stale"}
    assert stale == {"rl", "eval_rl"}, status
    assert "config" in next(line for line in status.splitlines() if line.startswith("rl "))
    laminar("run", *SMALL, "rl.lr=0.0003", "rl.steps=3", ws=ws)
    ran = {k for k, v in latest_summary(ws)["stages"].items() if v["status"] == "ran"}
    assert ran == {"rl", "eval_rl"}


@pytest.mark.parametrize("bad", [["no_such_key=1"], ["rl.lr=fast"], ["model=hf"]])
def test_config_errors_leave_workspace_unchanged(first_run, bad):
    ws, _ = first_run
    before = tree(ws)
    proc = laminar("run", *bad, ws=ws, check=False)
    assert proc.returncode == 2
    assert "config error" in proc.stderr and bad[0].split("=")[0] in proc.stderr
    assert tree(ws) == before


def test_config_error_on_fresh_workspace_creates_nothing(tmp_path):
    proc = laminar("run", "no_such_key=1", ws=tmp_path / "fresh", check=False)
    assert proc.returncode == 2 and not (tmp_path / "fresh").exists()
