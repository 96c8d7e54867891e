"""What experiment tracking costs a whole default run: fresh-workspace `laminar run`s with the default
trackers (`tracking.backends=[tensorboard]`) and with none (`tracking.backends=[]`), alternated so
that a change in the machine's load falls on both, then the median of each and the overhead.

    .venv/bin/python benchmarks/tracking_whole_run.py [--repeats 3] [--seed 0] [--threads 0]
        [--cached-rerun] [overrides...]

Each run is `benchmarks/default_run.py`'s: the command's wall seconds and the pipeline's own seconds
(summary.json), plus held-out accuracy after RL (which the trackers must not change: on the CPU the
synchronous default is deterministic, so both arms give the same numbers). Writes
``benchmarks/results/tracking/whole_run_<date>.json`` and ``.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_run import laminar

ROOT = Path(__file__).resolve().parent.parent

ARMS = {"default": [], "none": ["tracking.backends=[]"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--workspaces", type=Path, default=ROOT / "workspace-bench-tracking")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tracking")
    ap.add_argument(
        "--cached-rerun",
        action="store_true",
        help="after each default-arm run, the same command again (every stage cached), timed",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows = []
    for rep in range(args.repeats):
        order = list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            ws = args.workspaces / f"{arm}-r{rep}"
            shutil.rmtree(ws, ignore_errors=True)
            load = os.getloadavg()[0]
            summary, wall = laminar(
                ws, [f"seed={args.seed}", f"threads={args.threads}", *ARMS[arm], *args.overrides]
            )
            acc = (
                summary["stages"]
                .get("eval_rl", {})
                .get("metrics", {})
                .get("arith_heldout", {})
                .get("accuracy")
            )
            rows.append(
                {
                    "arm": arm,
                    "repeat": rep,
                    "wall_s": round(wall, 1),
                    "pipeline_s": round(summary["seconds"], 1),
                    "rl_accuracy": acc,
                    "load_before": round(load, 2),
                    "run_id": summary["run_id"],
                }
            )
            if args.cached_rerun and arm == "default":
                again, wall2 = laminar(
                    ws, [f"seed={args.seed}", f"threads={args.threads}", *ARMS[arm], *args.overrides]
                )
                rows[-1]["cached_rerun_wall_s"] = round(wall2, 1)
                rows[-1]["cached_rerun_ran"] = [
                    k for k, v in again["stages"].items() if v["status"] != "cached"
                ]
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(ws, ignore_errors=True)
    med = {
        arm: {k: statistics.median(r[k] for r in rows if r["arm"] == arm) for k in ("wall_s", "pipeline_s")}
        for arm in ARMS
    }
    overhead = {k: round(100 * (med["default"][k] / med["none"][k] - 1), 2) for k in ("wall_s", "pipeline_s")}
    stamp = dt.date.today().isoformat()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "date": stamp,
        "seed": args.seed,
        "threads": args.threads,
        "overrides": args.overrides,
        "cores": os.cpu_count(),
        "rows": rows,
        "median": med,
        "overhead_percent": overhead,
        "within_3_percent": overhead["wall_s"] <= 3.0,
    }
    (args.out / f"whole_run_{stamp}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Tracking overhead on the whole default run, {stamp} ({os.cpu_count()} cores, seed {args.seed}, "
        f"threads {args.threads})",
        "",
        "| repeat | arm | wall s | pipeline s | RL held-out | load before |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['repeat']} | {r['arm']} | {r['wall_s']} | {r['pipeline_s']} | {r['rl_accuracy']} | "
        f"{r['load_before']} |"
        for r in rows
    ]
    reruns = [r["cached_rerun_wall_s"] for r in rows if "cached_rerun_wall_s" in r]
    if reruns:
        lines += [
            "",
            f"Fully cached reruns of the default arm (same command, same workspace): "
            f"{', '.join(f'{w} s' for w in reruns)} (median {statistics.median(reruns)} s).",
        ]
    lines += [
        "",
        f"Median wall: default {med['default']['wall_s']} s, none {med['none']['wall_s']} s: "
        f"overhead {overhead['wall_s']}% (pipeline seconds: {overhead['pipeline_s']}%).",
    ]
    (args.out / f"whole_run_{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
