"""Every objective preset on the default task over several seeds, through the real pipeline.

Each (seed, algorithm) is one `laminar run seed=S threads=T rl.algorithm=A` in one workspace, so the
data, base model, warm-up, curation and RFT (and their evaluations) are computed once per seed and
only the RL stage and its evaluation rerun per preset (cached). Reports per preset: held-out
accuracy after RL and its gain over RFT, the gain per level, the RL stage's seconds, the mean token
entropy over the last 10% of the updates, and for the critic presets the value loss and explained
variance over the last 10%. Every finished run is appended to ``--json-out`` at once, and
``--resume`` skips the (seed, algorithm) pairs it already holds, so a stopped benchmark goes on.

    .venv/bin/python benchmarks/objectives.py [--seeds 0 1 2] [--algorithms grpo dapo ...] \\
        [--threads 1] [--json-out F.json] [--md-out F.md] [--resume] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ("grpo", "dr_grpo", "dapo", "ppo", "vapo", "rloo", "reinforce_pp", "gspo")


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
    xs = [x for x in xs if x == x]  # NaN (no value that step) left out
    return statistics.fmean(xs) if xs else float("nan")


def spread(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def last_tenth(xs: list[float]) -> float:
    return mean(xs[-max(1, len(xs) // 10) :]) if xs else float("nan")


def held(summary: dict, stage: str) -> dict:
    return summary["stages"].get(stage, {}).get("metrics", {}).get("arith_heldout", {})


def ran_seconds(ws: Path, summary: dict, stage: str) -> float:
    """The seconds ``stage`` took in the run that computed it (a cached stage's own are the lookup's)."""
    st = summary["stages"][stage]
    if st["status"] != "cached":
        return st["seconds"]
    for path in sorted((ws / "runs").glob("*/summary.json")):
        other = json.loads(path.read_text())["stages"].get(stage, {})
        if other.get("cache_key") == st["cache_key"] and other.get("status") != "cached":
            return other["seconds"]
    return float("nan")


def row_of(summary: dict, ws: Path, seed: int, algo: str) -> dict:
    h = rl_history(ws, summary["stages"]["rl"]["cache_key"])
    rft, rl = held(summary, "eval_rft"), held(summary, "eval_rl")
    return {
        "algorithm": algo,
        "seed": seed,
        "acc_rft": rft.get("accuracy"),
        "acc_rl": rl.get("accuracy"),
        "by_level_rft": dict(sorted(rft.get("by_level", {}).items())),
        "by_level_rl": dict(sorted(rl.get("by_level", {}).items())),
        "rl_seconds": ran_seconds(ws, summary, "rl"),
        "rl_status": summary["stages"]["rl"]["status"],
        "entropy_end": last_tenth(h.get("entropy", [])),
        "value_loss_end": last_tenth(h.get("value_loss", [])),
        "explained_variance_end": last_tenth(h.get("explained_variance", [])),
        "run_id": summary["run_id"],
    }


def table(results: list[dict], algorithms: list[str]) -> str:
    lines = [
        "| algorithm | seeds | held-out acc after RL (mean ± sd) | per seed | gain over RFT | gain per level "
        "(RL - RFT) | RL s | entropy, last 10% | value loss, last 10% | explained variance, last 10% |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for algo in algorithms:
        rs = [r for r in results if r["algorithm"] == algo]
        if not rs:
            continue
        accs = [r["acc_rl"] for r in rs]
        levels = sorted({lv for r in rs for lv in r["by_level_rl"]})
        per_level = " ".join(
            f"L{lv} {mean([r['by_level_rl'][lv] - r['by_level_rft'][lv] for r in rs]):+.2f}" for lv in levels
        )
        critic = not all(r["value_loss_end"] != r["value_loss_end"] for r in rs)
        gain = mean([r["acc_rl"] - r["acc_rft"] for r in rs])
        lines.append(
            f"| {algo} | {len(rs)} | {mean(accs):.3f} ± {spread(accs):.3f} | "
            f"{', '.join(f'{a:.3f}' for a in accs)} | {gain:+.3f} | "
            f"{per_level} | {mean([r['rl_seconds'] for r in rs]):.0f} | "
            f"{mean([r['entropy_end'] for r in rs]):.3f} | "
            + (
                f"{mean([r['value_loss_end'] for r in rs]):.4f} | "
                f"{mean([r['explained_variance_end'] for r in rs]):.3f} |"
                if critic
                else "- | - |"
            )
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workspace", type=Path, default=ROOT / "workspace-bench-objectives")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--md-out", type=Path)
    ap.add_argument("--resume", action="store_true", help="skip the runs --json-out already holds")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.json_out:
        args.json_out = args.json_out.resolve()
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
    if args.md_out:
        args.md_out = args.md_out.resolve()
    results: list[dict] = []
    if args.resume and args.json_out and args.json_out.exists():
        results = json.loads(args.json_out.read_text())
    done = {(r["seed"], r["algorithm"]) for r in results}
    for seed in args.seeds:
        for algo in args.algorithms:
            if (seed, algo) in done:
                continue
            t0 = time.perf_counter()
            overrides = [f"seed={seed}", f"threads={args.threads}", f"rl.algorithm={algo}", *args.overrides]
            r = row_of(run(args.workspace, overrides), args.workspace, seed, algo)
            r["command_s"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1))
            print(
                f"seed {seed} {algo:<12} acc RFT {r['acc_rft']:.3f} -> RL {r['acc_rl']:.3f}  "
                f"RL {r['rl_seconds']:.0f}s  entropy {r['entropy_end']:.3f}  "
                f"value loss {r['value_loss_end']:.4f}  ev {r['explained_variance_end']:.3f}",
                flush=True,
            )
    text = table(results, args.algorithms)
    print("\n" + text)
    if args.md_out:
        args.md_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
