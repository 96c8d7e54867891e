"""Experiment tracking through the real CLI: a fast `laminar run` logging to every backend (W&B when
installed: requirements.txt pins it), read back with each tracker's own reader, then a rerun served
from cache whose tracker run is complete all the same; `laminar runs` / `laminar lineage` name them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.configs import TINY_CURATED
from tests.tracking_readers import mlflow_client, mlflow_history, tensorboard_scalars, wandb_run

ROOT = Path(__file__).resolve().parents[2]
HAS_WANDB = importlib.util.find_spec("wandb") is not None
BACKENDS = ["tensorboard", "mlflow", *(["wandb"] if HAS_WANDB else [])]
ARGS = [*TINY_CURATED, f"tracking.backends=[{','.join(BACKENDS)}]"]

# two tiny runs with all three backends (~2 minutes): the slow suite; make test reads the TensorBoard
# curves of its own first run back (tests/e2e/test_cli.py)
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def laminar(*args: str, ws: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    env.pop("WANDB_API_KEY", None)  # offline files, never the network
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"laminar {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _run(ws: Path) -> dict:
    laminar("run", *ARGS, ws=ws)
    latest = max((ws / "runs").iterdir(), key=lambda p: p.name)
    summary = json.loads((latest / "summary.json").read_text())
    tracking = json.loads((latest / "tracking.json").read_text())
    assert tracking.pop("workspace") == str(ws.resolve())
    return {"summary": summary, "tracking": tracking}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of one config on one workspace: the first runs every stage, the second is all cached."""
    ws = tmp_path_factory.mktemp("tracking_ws")
    first = _run(ws)
    second = _run(ws)
    model = first["summary"]["stages"]["rl"]["artifacts"]["model"]
    history = [json.loads(line) for line in (ws / "artifacts" / "model" / model / "history.jsonl").open()]
    return ws, first, second, history


def _rewards(history: list[dict]) -> list[tuple[int, float]]:
    return [(int(m["step"]), pytest.approx(m["reward"])) for m in history]


def test_tensorboard_has_every_rl_step_and_the_evaluation_accuracy(runs):
    ws, first, _, history = runs
    assert len(history) == 2  # rl.steps=2 in TINY_CURATED
    scalars = tensorboard_scalars(Path(first["tracking"]["tensorboard"]["logdir"]))
    assert scalars["rl/reward"] == _rewards(history)
    for key in (
        "accuracy",
        "response_length",
        "entropy",
        "clipfrac",
        "staleness_mean",
        "staleness_max",
        "dropped_groups",
        "gen_tokens_per_s",
    ):
        assert [s for s, _ in scalars[f"rl/{key}"]] == [1, 2], key
    acc = first["summary"]["metrics"]["heldout_accuracy_rl"]
    assert scalars["eval_rl/arith_heldout/accuracy"] == [(0, pytest.approx(acc))]
    assert "eval_rl/arith_heldout/pass_at_2" in scalars and "eval_rl/arith_heldout/maj_at_2" in scalars
    assert "dart/by_level/1/acceptance" in scalars and "select/skipped" in scalars
    assert "ingest/quarantined" in scalars and "decontaminate/contaminated" in scalars
    for stage in first["summary"]["stages"]:
        assert scalars[f"{stage}/cached"] == [(0, 0.0)], stage
        assert f"{stage}/seconds" in scalars


def test_mlflow_run_has_config_lineage_curves_and_accuracy(runs):
    _, first, _, history = runs
    loc = first["tracking"]["mlflow"]
    client = mlflow_client(loc["uri"])
    run = client.get_run(loc["run"])
    summary = first["summary"]
    assert run.info.run_name == summary["run_id"] and run.info.status == "FINISHED"
    assert run.data.params["rl.steps"] == "2" and run.data.params["tracking.backends"] == json.dumps(BACKENDS)
    tags = run.data.tags
    assert tags["laminar.run_id"] == summary["run_id"] and tags["laminar.status"] == "completed"
    assert len(tags["git.revision"].split("+")[0]) in (40, 7) or tags["git.revision"] == "unknown"
    for stage, sha in summary["checkpoints"].items():
        assert tags[f"checkpoint.{stage}"] == sha
    for stage, s in summary["stages"].items():
        for name, sha in s["artifacts"].items():
            assert tags[f"artifact.{stage}.{name}"] == sha
    assert mlflow_history(client, run.info.run_id, "rl/reward") == _rewards(history)
    assert run.data.metrics["eval_rl/arith_heldout/accuracy"] == pytest.approx(
        summary["metrics"]["heldout_accuracy_rl"]
    )
    found = client.search_runs([loc["experiment_id"]], f"tags.`laminar.run_id` = '{summary['run_id']}'")
    assert [r.info.run_id for r in found] == [run.info.run_id]


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (it is in requirements.txt)")
def test_wandb_offline_run_files_have_the_curves(runs):
    _, first, _, history = runs
    loc = first["tracking"]["wandb"]
    assert loc["mode"] == "offline" and loc["id"] == first["summary"]["run_id"]
    files = list(Path(loc["dir"]).glob("run-*.wandb"))
    assert len(files) == 1
    rows, summary = wandb_run(files[0])
    steps = [(r["rl/step"], pytest.approx(r["rl/reward"])) for r in rows if "rl/reward" in r]
    assert steps == _rewards(history)
    assert summary["eval_rl/arith_heldout/accuracy"] == pytest.approx(
        first["summary"]["metrics"]["heldout_accuracy_rl"]
    )


def test_a_cached_rerun_is_logged_as_cached_with_its_curves(runs):
    _, first, second, history = runs
    assert {s["status"] for s in second["summary"]["stages"].values()} == {"cached"}
    assert second["tracking"]["tensorboard"]["logdir"] != first["tracking"]["tensorboard"]["logdir"]
    scalars = tensorboard_scalars(Path(second["tracking"]["tensorboard"]["logdir"]))
    for stage in second["summary"]["stages"]:
        assert scalars[f"{stage}/cached"] == [(0, 1.0)], stage
    assert scalars["rl/reward"] == _rewards(history)  # from the catalog's metrics rows
    assert scalars["eval_rl/arith_heldout/accuracy"] == [
        (0, pytest.approx(first["summary"]["metrics"]["heldout_accuracy_rl"]))
    ]
    run = mlflow_client(second["tracking"]["mlflow"]["uri"]).get_run(second["tracking"]["mlflow"]["run"])
    assert (
        run.data.tags["stage.rl"] == "cached"
        and run.data.tags["checkpoint.rl"] == first["summary"]["checkpoints"]["rl"]
    )


def test_runs_and_lineage_print_each_runs_tracker_location(runs):
    ws, first, second, _ = runs
    out = laminar("runs", ws=ws).stdout
    tracked = out[out.index("tracker runs:") :]
    for r in (first, second):
        assert r["summary"]["run_id"] in tracked
        assert r["tracking"]["tensorboard"]["logdir"] in tracked and r["tracking"]["mlflow"]["run"] in tracked
    listing = json.loads(laminar("runs", "--json", ws=ws).stdout)
    assert {r["run_id"]: r["tracking"] for r in listing["runs"]} == {
        r["summary"]["run_id"]: r["tracking"] for r in (first, second)
    }
    lin = laminar("lineage", first["summary"]["checkpoints"]["rl"][:12], ws=ws).stdout
    assert "tracker runs:" in lin and first["tracking"]["tensorboard"]["logdir"] in lin


def test_report_plots_reach_the_trackers(runs):
    ws, first, _, _ = runs
    laminar("report", first["summary"]["run_id"], ws=ws)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(first["tracking"]["tensorboard"]["logdir"], size_guidance={"images": 0})
    acc.Reload()
    assert {"report/benchmarks", "report/rl", "report/levels"} <= set(acc.Tags()["images"])
    client = mlflow_client(first["tracking"]["mlflow"]["uri"])
    plots = {Path(a.path).name for a in client.list_artifacts(first["tracking"]["mlflow"]["run"], "plots")}
    assert {"benchmark_accuracy.png", "rl_reward_length.png", "accuracy_by_level.png"} <= plots
