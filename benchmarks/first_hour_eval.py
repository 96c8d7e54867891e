"""GSM8K on the default model, as a new user meets it: the score with its count of prompts longer than
the model's context, and the wall time of ``eval.max_problems=N`` (a seeded subset) against the full
set, each through the real ``laminar eval``.

    .venv/bin/python benchmarks/first_hour_eval.py --workspace WS --ckpt SHA_PREFIX --sizes 100 300 0 \
        --out benchmarks/results/first_hour/gsm8k_eval_<date>.json

``--sizes``: values of ``eval.max_problems`` (0 = every problem), run in order; each is its own cache
key, so a size already evaluated in WS comes back ``cached`` (recorded as such). Each run records wall
seconds and CPU seconds (user + system of the CLI and its workers): on a shared machine the CPU
seconds are the comparable number.
Extra ``--overrides`` go to every run (default ``eval.n_samples=1``: one sample per problem).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child_cpu() -> float:
    """User + system CPU seconds of finished child processes (the CLI and the verifier workers it reaped):
    on a shared, loaded machine the wall time says more about the neighbours than about the evaluation."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def latest_eval(ws: Path) -> dict:
    runs = sorted(
        (p for p in (ws / "runs").iterdir() if p.name.startswith("eval-") and (p / "summary.json").exists()),
        key=lambda p: p.name,
    )
    return json.loads((runs[-1] / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--ckpt", required=True, help="checkpoint sha prefix in the workspace")
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 0])
    ap.add_argument("--overrides", nargs="*", default=["eval.n_samples=1"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = []
    for n in args.sizes:
        cmd = [
            sys.executable,
            "-m",
            "flows.cli",
            "eval",
            f"ckpt={args.ckpt}",
            "eval.benchmarks=[gsm8k]",
            f"eval.max_problems={n}",
            *args.overrides,
            "--workspace",
            args.workspace,
        ]
        t0, cpu0 = time.perf_counter(), _child_cpu()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, _child_cpu() - cpu0
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        s = latest_eval(Path(args.workspace))
        g = s["benchmarks"]["gsm8k"]
        table = [line for line in proc.stdout.splitlines() if line.startswith("gsm8k")]
        results.append(
            {
                "max_problems": n,
                "status": s["status"],
                "wall_s": round(wall, 1),
                "cpu_s": round(cpu, 1),
                "eval_s": round(s["seconds"], 1),
                "problems": g["n_problems"],
                "problems_total": g.get("problems_total", g["n_problems"]),
                "accuracy": g["accuracy"],
                "too_long": g.get("too_long"),
                "context": g.get("context"),
                "lines": table,
                "command": "laminar " + " ".join(cmd[3:]),
            }
        )
        print(json.dumps(results[-1]), flush=True)
        _write(args, results)  # after every size: a long full-set run may be cut short
    print(f"wrote {args.out}")


def _write(args, results: list[dict]) -> None:
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "checkpoint": args.ckpt,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
