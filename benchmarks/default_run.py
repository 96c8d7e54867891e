"""The default pipeline per seed (and per torch thread count), each in a fresh workspace.

For every (threads, seed): `laminar run seed=S threads=T` in a new workspace, timed from the
command's start to its exit (what a user waits for), then optionally the same command again (every
stage cached) timed the same way. Writes one JSON with every row (held-out accuracy after warm-up,
RFT and RL, overall and per level; each stage's seconds; the run's warnings) and a markdown table
next to it, and checks the default's promises on every row:

- RL >= warm-up + 0.15 and RL > RFT on every seed;
- mean (RL - RFT) >= 0.03 per thread count;
- the hardest level gains the most from RFT + RL (RL - warm-up, per level).

    .venv/bin/python benchmarks/default_run.py --seeds 0 1 2 3 4 [--threads 0 1] [--cached-rerun]
        [--repeats 1] [--out benchmarks/results/default_run] [--label NAME] [--paths before-issue-30]
        [overrides...]

``--threads 0`` is the default (torch's own choice, one thread per core); ``threads`` is part of
every training and sampling stage's cache key, so each count computes its own results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = (("warmup", "eval_warmup"), ("rft", "eval_rft"), ("rl", "eval_rl"))


def laminar(
    ws: Path, overrides: list[str], resume: bool = False, paths: str = "current"
) -> tuple[dict, float]:
    """(summary.json of the run, wall seconds of the whole command). ``resume``: a workspace that
    already holds a run of this benchmark (``bench_wall.json``) gives that run back instead."""
    done = ws / "bench_wall.json"
    if resume and done.exists():
        d = json.loads(done.read_text())
        return json.loads((ws / "runs" / d["run_id"] / "summary.json").read_text()), d["wall_s"]
    entry = ["-m", "flows.cli"] if paths == "current" else [str(ROOT / "benchmarks" / "before_issue30.py")]
    cmd = [sys.executable, *entry, "run", "--workspace", str(ws), *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    latest = max((ws / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    summary = json.loads((latest / "summary.json").read_text())
    if not done.exists():
        done.write_text(json.dumps({"run_id": summary["run_id"], "wall_s": wall}))
    return summary, wall


def row_of(summary: dict, *, seed: int, threads: int, wall: float) -> dict:
    stages = summary["stages"]
    acc, levels = {}, {}
    for role, stage in STAGES:
        held = stages.get(stage, {}).get("metrics", {}).get("arith_heldout", {})
        acc[role] = held.get("accuracy")
        levels[role] = dict(sorted(held.get("by_level", {}).items()))  # stage metrics keep avg@n per level
    return {
        "seed": seed,
        "threads": threads,
        "wall_s": round(wall, 1),
        "pipeline_s": round(summary["seconds"], 1),
        "accuracy": acc,
        "by_level": levels,
        "stage_seconds": {k: v["seconds"] for k, v in stages.items()},
        "stage_status": {k: v["status"] for k, v in stages.items()},
        "warnings": summary.get("warnings", []),
        "run_id": summary["run_id"],
    }


def checks(rows: list[dict]) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for r in rows:
        a = r["accuracy"]
        tag = f"threads={r['threads']} seed={r['seed']}"
        out[f"{tag}: RL >= warm-up + 0.15"] = a["rl"] >= a["warmup"] + 0.15
        out[f"{tag}: RL > RFT"] = a["rl"] > a["rft"]
        gains = {lv: r["by_level"]["rl"][lv] - r["by_level"]["warmup"][lv] for lv in r["by_level"]["rl"]}
        hardest = max(gains, key=int)
        out[f"{tag}: level {hardest} gains most from RFT + RL"] = gains[hardest] >= max(gains.values())
    for t in sorted({r["threads"] for r in rows}):
        d = [r["accuracy"]["rl"] - r["accuracy"]["rft"] for r in rows if r["threads"] == t]
        out[f"threads={t}: mean RL - RFT >= 0.03 ({statistics.fmean(d):+.3f})"] = statistics.fmean(d) >= 0.03
    return out


def markdown(rows: list[dict], cached: list[dict], verdicts: dict[str, bool], header: str) -> str:
    lines = [
        header,
        "",
        "| threads | seed | warm-up | RFT | RL | RL - RFT | RL by level (warm-up -> RL) | warm-up s | "
        "curation s | RFT s | RL s | evals s | pipeline s | command s | warnings |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, s = r["accuracy"], r["stage_seconds"]
        lv = " ".join(
            f"L{k} {r['by_level']['warmup'][k]:.2f}->{r['by_level']['rl'][k]:.2f}"
            for k in r["by_level"]["rl"]
        )
        curation = sum(
            s.get(k, 0.0)
            for k in ("data", "ingest", "decontaminate", "difficulty", "dart", "difficulty_rft", "select")
        )
        evals = sum(s.get(k, 0.0) for k in ("eval_warmup", "eval_rft", "eval_rl"))
        lines.append(
            f"| {r['threads']} | {r['seed']} | {a['warmup']:.3f} | {a['rft']:.3f} | {a['rl']:.3f} | "
            f"{a['rl'] - a['rft']:+.3f} | {lv} | {s.get('warmup', 0):.0f} | {curation:.0f} | "
            f"{s.get('rft', 0):.0f} | {s.get('rl', 0):.0f} | {evals:.0f} | {r['pipeline_s']:.0f} | "
            f"{r['wall_s']:.0f} | {'; '.join(r['warnings']) or '-'} |"
        )
    for t in sorted({r["threads"] for r in rows}):
        rs = [r for r in rows if r["threads"] == t]
        m = {k: statistics.fmean(r["accuracy"][k] for r in rs) for k in ("warmup", "rft", "rl")}
        lines.append(
            f"| {t} | mean | {m['warmup']:.3f} | {m['rft']:.3f} | {m['rl']:.3f} | {m['rl'] - m['rft']:+.3f} "
            f"| | | | | | | {statistics.median(r['pipeline_s'] for r in rs):.0f} (median) | "
            f"{statistics.median(r['wall_s'] for r in rs):.0f} (median) | |"
        )
    if cached:
        lines += [
            "",
            "Fully cached rerun (same command, same workspace): "
            + ", ".join(f"seed {c['seed']} threads {c['threads']}: {c['wall_s']:.1f} s" for c in cached),
        ]
    lines += ["", "Checks:"] + [f"- {'PASS' if ok else 'FAIL'} {name}" for name, ok in verdicts.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--threads", type=int, nargs="+", default=[0])
    ap.add_argument("--repeats", type=int, default=1, help="fresh-workspace runs per (threads, seed)")
    ap.add_argument("--cached-rerun", action="store_true", help="time the same command again (all cached)")
    ap.add_argument("--workspaces", type=Path, default=ROOT / "workspace-bench-default")
    ap.add_argument(
        "--keep", action="store_true", help="keep the workspaces (default: delete each after use)"
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="take the first run of a kept workspace from an earlier (interrupted) call instead of rerunning",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "default_run")
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--paths",
        choices=("current", "before-issue-30"),
        default="current",
        help="before-issue-30: the sampling and update paths before issue 30 (benchmarks/before_issue30.py)",
    )
    ap.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: one table (and checks) from these earlier results files, e.g. seeds split "
        "over two processes",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows, cached = [], []
    if args.combine:
        parts = [json.loads(p.read_text()) for p in args.combine]
        for part in parts:
            rows += part["rows"]
            cached += part.get("cached_reruns", [])
        args.overrides = sorted({o for part in parts for o in part.get("overrides", [])})
    for threads in [] if args.combine else args.threads:
        for seed in args.seeds:
            for rep in range(args.repeats):
                ws = args.workspaces / f"t{threads}-s{seed}-r{rep}"
                if not (args.resume and (ws / "bench_wall.json").exists()):
                    shutil.rmtree(ws, ignore_errors=True)
                overrides = [f"seed={seed}", f"threads={threads}", *args.overrides]
                summary, wall = laminar(ws, overrides, resume=args.resume, paths=args.paths)
                rows.append({**row_of(summary, seed=seed, threads=threads, wall=wall), "repeat": rep})
                print(json.dumps(rows[-1]), flush=True)
                if args.cached_rerun and rep == 0:
                    summary, wall = laminar(ws, overrides, paths=args.paths)
                    ran = [k for k, v in summary["stages"].items() if v["status"] != "cached"]
                    cached.append({"seed": seed, "threads": threads, "wall_s": round(wall, 1), "ran": ran})
                    print(json.dumps(cached[-1]), flush=True)
                if not args.keep:
                    shutil.rmtree(ws, ignore_errors=True)
    first = [r for r in rows if r["repeat"] == 0]
    verdicts = checks(first)
    stamp = dt.date.today().isoformat()
    name = f"{stamp}{'_' + args.label if args.label else ''}"
    combined = f" (combined from {', '.join(p.name for p in args.combine)})" if args.combine else ""
    header = (
        f"# Default run, {stamp}{combined}: {platform.processor() or platform.machine()}, "
        f"{__import__('os').cpu_count()} cores; overrides: {' '.join(args.overrides) or '(none)'}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(
        json.dumps(
            {
                "date": stamp,
                "paths": args.paths,
                "overrides": args.overrides,
                "rows": rows,
                "cached_reruns": cached,
                "checks": verdicts,
            },
            indent=1,
        )
    )
    table = markdown(first, cached, verdicts, header)
    (args.out / f"{name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
