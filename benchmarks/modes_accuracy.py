"""Held-out accuracy and RL wall time of `rl.mode=laminar` against `rl.mode=sync`, over seeds.

Each (mode, seed) is one `laminar run seed=S rl.mode=M` in one workspace, so data, warm-up,
curation and RFT are computed once per seed and shared by the modes (cached); only RL and its
evaluation run per mode. Prints a markdown table: final held-out accuracy (avg@n of eval_rl) and
the RL stage's seconds, per seed and on average.

    .venv/bin/python benchmarks/modes_accuracy.py [--seeds 0 1 2] [--modes sync laminar] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from benchmarks.objectives import run

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--modes", nargs="+", default=["sync", "laminar"])
    ap.add_argument("--workspace", type=Path, default=ROOT / "workspace-bench-modes")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        for mode in args.modes:
            s = run(args.workspace, [f"seed={seed}", f"rl.mode={mode}", *args.overrides])
            row = {
                "seed": seed,
                "mode": mode,
                "accuracy": s["metrics"]["heldout_accuracy_rl"],
                "rft_accuracy": s["metrics"].get("heldout_accuracy_rft"),
                "rl_seconds": s["stages"]["rl"]["seconds"],
                "rl_status": s["stages"]["rl"]["status"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| seed | " + " | ".join(f"{m} acc | {m} RL s" for m in args.modes) + " |")
    print("|---|" + "---|---|" * len(args.modes))
    for seed in args.seeds:
        cells = []
        for mode in args.modes:
            r = next(r for r in rows if r["seed"] == seed and r["mode"] == mode)
            cells += [f"{r['accuracy']:.3f}", f"{r['rl_seconds']:.0f}"]
        print(f"| {seed} | " + " | ".join(cells) + " |")
    cells = []
    for mode in args.modes:
        rs = [r for r in rows if r["mode"] == mode]
        acc = [r["accuracy"] for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        cells += [
            f"{statistics.fmean(acc):.3f} ± {sd:.3f}",
            f"{statistics.fmean(r['rl_seconds'] for r in rs):.0f}",
        ]
    print("| mean | " + " | ".join(cells) + " |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
