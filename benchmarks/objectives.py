"""GRPO vs DAPO vs Dr. GRPO on the default task over several seeds, through the real pipeline.

Each (algorithm, seed) is one `laminar run seed=S rl.algorithm=A` in one workspace, so the data,
base model, warm-up and its evaluation are computed once per seed and shared by the three
algorithms (cached). Reports final held-out accuracy, policy entropy over training and the groups
dynamic sampling dropped, as a markdown table (and JSON with --json-out).

    .venv/bin/python benchmarks/objectives.py [--seeds 0 1 2] [--algorithms grpo dapo dr_grpo] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(ws: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "flows.cli", "run", *overrides, "--workspace", str(ws)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    latest = max((ws / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return json.loads((latest / "summary.json").read_text())


def rl_history(ws: Path, cache_key: str) -> dict[str, list[float]]:
    import duckdb

    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT name, step, value FROM metrics WHERE cache_key = ? AND stage = 'rl' ORDER BY step",
            [cache_key],
        ).fetchall()
    finally:
        con.close()
    out: dict[str, list[float]] = {}
    for name, _, value in rows:
        out.setdefault(name, []).append(value)
    return out


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algorithms", nargs="+", default=["grpo", "dapo", "dr_grpo"])
    ap.add_argument("--workspace", type=Path, default=ROOT / "workspace-bench-objectives")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        for algo in args.algorithms:
            s = run(args.workspace, [f"seed={seed}", f"rl.algorithm={algo}", *args.overrides])
            h = rl_history(args.workspace, s["stages"]["rl"]["cache_key"])
            ent = h.get("entropy", [])
            tenth = max(1, len(ent) // 10)
            results.append(
                {
                    "algorithm": algo,
                    "seed": seed,
                    "acc_warmup": s["metrics"]["heldout_accuracy_warmup"],
                    "acc_rl": s["metrics"]["heldout_accuracy_rl"],
                    "entropy_first10pct": mean(ent[:tenth]),
                    "entropy_last10pct": mean(ent[-tenth:]),
                    "dropped_groups": sum(h.get("dropped_groups", [])),
                    "generated": sum(h.get("generated_trajectories", [])),
                    "trained": sum(h.get("trained_trajectories", [])),
                    "rl_seconds": s["stages"]["rl"]["seconds"],
                }
            )
            r = results[-1]
            print(
                f"seed {seed} {algo:<8} acc {r['acc_warmup']:.3f} -> {r['acc_rl']:.3f}  entropy "
                f"{r['entropy_first10pct']:.3f} -> {r['entropy_last10pct']:.3f}  "
                f"dropped {r['dropped_groups']:.0f}",
                flush=True,
            )
    print(
        "\n| algorithm | held-out acc after RL (mean over seeds) | per seed | gain over warm-up "
        "| entropy first 10% -> last 10% | groups dropped (total) | trajectories generated / trained "
        "| RL seconds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for algo in args.algorithms:
        rs = [r for r in results if r["algorithm"] == algo]
        per_seed = ", ".join(f"{r['acc_rl']:.3f}" for r in rs)
        print(
            f"| {algo} | {mean([r['acc_rl'] for r in rs]):.3f} | {per_seed} | "
            f"{mean([r['acc_rl'] - r['acc_warmup'] for r in rs]):+.3f} | "
            f"{mean([r['entropy_first10pct'] for r in rs]):.3f} -> "
            f"{mean([r['entropy_last10pct'] for r in rs]):.3f} | "
            f"{sum(r['dropped_groups'] for r in rs):.0f} | {sum(r['generated'] for r in rs):.0f} / "
            f"{sum(r['trained'] for r in rs):.0f} | {mean([r['rl_seconds'] for r in rs]):.0f} |"
        )
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
