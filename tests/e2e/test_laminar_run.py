"""`laminar run rl.mode=laminar` through the real CLI: the Ray runtime inside the pipeline with the
DeepSpeed trainer, a trainer killed with SIGKILL mid-run and `laminar run` again resuming from the
last complete checkpoint, the report files; (slow) the same with the torch trainer and 40 updates."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.configs import TINY_CURATED
from tests.e2e.test_operate import laminar, popen, summaries

pytestmark = pytest.mark.e2e


def rl_artifact(ws: Path, summary: dict) -> Path:
    return ws / "artifacts" / "model" / summary["stages"]["rl"]["artifacts"]["model"]


def _trainer_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::TrainerWorker"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_sigkill_the_trainer_then_laminar_run_resumes(tmp_path):
    ws = tmp_path / "ws"
    args = ("run", *TINY_CURATED, "rl.mode=laminar", "rl.steps=40", "rl.checkpoint_every=5", "--until", "rl")
    laminar("run", *TINY_CURATED, "--until", "select", ws=ws)  # curation first, so the kill lands in RL
    proc = popen(*args, ws=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    marker = None
    while time.time() < deadline and marker is None:
        found = sorted(ws.glob("state/rl-*/checkpoints/step-*/COMPLETE.json"))
        marker = found[-1] if found else None
        time.sleep(0.2)
    assert marker is not None, "no checkpoint appeared"
    pids = _trainer_pids()
    assert pids, "no trainer actor process"
    for pid in pids:
        subprocess.run(["kill", "-9", str(pid)])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, "the run survived its trainer"
    state = marker.parents[2]
    assert state.exists() and list(state.glob("checkpoints/step-*/COMPLETE.json"))
    laminar(*args, ws=ws)  # the rerun resumes
    latest = max(summaries(ws).values(), key=lambda s: s["run_id"])
    runtime = json.loads((rl_artifact(ws, latest) / "runtime.json").read_text())
    assert runtime.get("resumed") == 1 and runtime["updates"] == 40
    uids = runtime["trained_uids"]
    assert len(uids) == len(set(uids)) == 40 * 4
    assert not state.exists()


# ~165 s on 2 cores; make test keeps DeepSpeed's resume and backend tests (tests/reliability, tests/training)
@pytest.mark.slow
def test_laminar_deepspeed_run_checkpoints_resumes_and_reports(tmp_path):
    """`laminar run rl.mode=laminar trainer.backend=deepspeed` (ZeRO-2, CPU, gloo) in the pipeline: the
    trainer is SIGKILLed after its first checkpoint, the run fails, the rerun resumes from that
    checkpoint to the end, and the run report shows the runtime and its timeline."""
    ws = tmp_path / "ws"
    args = (
        "run",
        *TINY_CURATED,
        "trainer.backend=deepspeed",
        "rl.mode=laminar",
        "rl.steps=8",
        "rl.checkpoint_every=2",
        "--until",
        "rl",
    )
    proc = popen(
        *args, ws=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )  # curation, then RL checkpoints
    deadline = time.time() + 400
    marker = None
    while time.time() < deadline and marker is None and proc.poll() is None:
        found = sorted(ws.glob("state/rl-*/checkpoints/step-*/COMPLETE.json"))
        marker = found[-1] if found else None
        time.sleep(0.1)
    assert marker is not None, (
        f"no checkpoint appeared: {proc.communicate()[0][-3000:] if proc.poll() is not None else ''}"
    )
    assert (marker.parent / "deepspeed").is_dir()  # DeepSpeed's own files inside the atomic folder
    for pid in _trainer_pids():
        subprocess.run(["kill", "-9", str(pid)])
    proc.communicate(timeout=300)
    assert proc.returncode != 0, "the run survived its trainer"
    laminar(*args, ws=ws)
    latest = max(summaries(ws).values(), key=lambda s: s["run_id"])
    art = rl_artifact(ws, latest)
    runtime = json.loads((art / "runtime.json").read_text())
    assert runtime["mode"] == "laminar" and runtime["trainer_backend"] == "deepspeed"
    assert runtime.get("resumed") == 1 and runtime["updates"] == 8
    uids = runtime["trained_uids"]
    assert len(uids) == len(set(uids)) == 8 * 4
    assert (art / "timeline.png").stat().st_size > 1000 and (art / "model.safetensors").exists()
    assert not list((ws / "state").glob("rl-*"))  # the finished stage's resumable state is gone
    history = [json.loads(line) for line in (art / "history.jsonl").read_text().splitlines()]
    assert len(history) == 8 and all("staleness_mean" in m and m["loss"] == m["loss"] for m in history)
    laminar("report", latest["run_id"], ws=ws)  # the run report shows the runtime and its timeline
    report = ws / "runs" / latest["run_id"] / "report"
    assert "## RL runtime" in (report / "report.md").read_text()
    assert (report / "rl_timeline.png").stat().st_size > 1000
    cpu = runtime["cpu_seconds"]  # every role's CPU over the loop, in runtime.json and the report
    assert cpu["driver"] > 0 and cpu["trainer-0"] > 0 and cpu["relay-0"] >= 0
    assert sorted(k for k in cpu if k.startswith("rollout-")) == ["rollout-0", "rollout-1"]
    assert all(cpu[k] > 0 for k in cpu if k.startswith("rollout-")) and runtime["loop_seconds"] > 0
    assert runtime.get("machine_busy") is None or 0 < runtime["machine_busy"] <= 1
    assert "CPU seconds per role over the loop" in (report / "report.md").read_text()
    # the driver logged every update the actors reported to the default tracker (TensorBoard), live:
    # the killed run's curves up to its kill, the resumed run's from its checkpoint on
    from tests.tracking_readers import tensorboard_scalars

    logged: dict[int, float] = {}
    for run_dir in sorted((ws / "runs").iterdir()):  # run ids sort by start time: the resumed run's steps win
        scalars = tensorboard_scalars(
            Path(json.loads((run_dir / "tracking.json").read_text())["tensorboard"]["logdir"])
        )
        logged.update(scalars.get("rl/reward", []))
        if run_dir.name == latest["run_id"]:
            assert {
                "rl/staleness_mean",
                "rl/staleness_max",
                "rl/occupancy",
                "rl/publish_stall_s",
                "rl/tokens_per_s",
                "rl/repacks",
            } <= set(scalars)
    assert logged == {m["step"]: pytest.approx(m["reward"]) for m in history}
