"""``benchmarks/device_proof.sh --cpu-smoke``: the device proof's steps on this CPU with tiny shapes,
and the output folder a device call brings back (at most 8 files, each named as the device tool
allows; proof.json with the steps, the environment and the targets). Slow: four Ray runs and the
gpu_check smoke take a minute or two on 2 cores."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "proof.log",
    "proof.json",
    "gpu_check.json",
    "rl_throughput_cpu.json",
    "gpu_check.png",
    "rl_throughput.png",
    "timelines.tar.gz",
}


@pytest.mark.slow
def test_cpu_smoke_runs_every_step_and_writes_the_device_layout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(
        PYTHON=sys.executable,
        PROOF_OUT=str(tmp_path / "out"),
        PROOF_WORK=str(tmp_path / "work"),
        PYTHONPATH=str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
    )
    proc = subprocess.run(
        ["bash", "benchmarks/device_proof.sh", "--cpu-smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert set(files) == EXPECTED, files
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)

    proof = json.loads((out / "proof.json").read_text())
    assert {"env", "steps", "targets", "gpu_check", "rl_throughput", "plots"} <= set(proof)
    steps = {s["step"]: s for s in proof["steps"]}
    assert steps["gpu_check"]["status"] == "ok" and steps["rl_cpu"]["status"] == "ok"
    assert steps["install"]["status"] == "skipped"
    assert steps["rl_cuda"]["status"] == "skipped" and "no CUDA" in steps["rl_cuda"]["note"]
    assert proof["plots"] == {"gpu_check.png": True, "rl_throughput.png": True}

    gpu = proof["gpu_check"]
    engine = [r for r in gpu["rows"] if r["section"] == "engine"]
    assert any(r.get("skipped") == "no CUDA" and r["variant"] == "graphs" for r in engine)
    assert any(r.get("ratio", 0) > 0 for r in engine)
    assert [r["ours"] for r in gpu["rows"] if "ZeRO" in r.get("case", "")] == [
        "skipped: --no-deepspeed (no CUDA)"
    ] * 2
    assert gpu["env"]["complete"] is True
    # a smoke measures no 0.5B engine at batch 256 and no ZeRO update: no target may read as met
    targets = proof["targets"]["gpu_check"]
    assert targets["engine_0.5b_batch256_vs_eager"]["ok"] is None
    assert targets["deepspeed_zero2_update"]["ok"] is None

    rl = json.loads((out / "rl_throughput_cpu.json").read_text())
    assert [m["mode"] for m in rl["modes"]] == ["sync", "one_step", "partial", "laminar"]
    assert rl["partial"] is False and rl["shape"]["device"] == "cpu"
    for m in rl["modes"]:
        assert m["trained_tokens"] > 0 and m["cpu_trainer_s"] > 0 and m["cores_rollout"] > 0
    with tarfile.open(out / "timelines.tar.gz") as tar:
        assert any(n.endswith(".png") for n in tar.getnames())
