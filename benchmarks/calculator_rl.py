"""env=calculator through the whole pipeline (warm-up, curation, RFT, RL, evaluation) against the same
pipeline without the tool (env=single_turn), per seed, each arm in its own fresh workspace, through
the real CLI (``python -m flows.cli run``), one run after the other.

Both arms share every override but ``env``: the data config with the long level (``--levels``,
default 1-6; level 6 is a chain of 10 operations) and one token budget per turn for RL, evaluation
and curation's sampling (``--max-new-tokens``, default 96: a level-6 worked solution is at most 88
tokens, so the arm without the tool is not cut short by the budget). Collected per (arm, seed) from
the workspace: ``summary.json`` (held-out accuracy per level after warm-up, RFT and RL; tool calls,
tool errors and turns per episode), the RL stage's ``history.jsonl`` (tool calls per episode per
step) and each eval's ``rows.parquet`` (tool calls per level, counted from the episode text: lines
``calc: ...``). Writes ``OUT.json``, ``OUT.md`` and ``OUT.png`` (tool calls per episode over RL
steps, one line per seed).

    .venv/bin/python benchmarks/calculator_rl.py --seeds 0 1 2 --threads 1 \\
        --out benchmarks/results/environments/2026-12-05_calculator_rl [--keep] [--resume] [overrides...]
    .venv/bin/python benchmarks/calculator_rl.py --collect-only --seeds 0 1 2 --out ...   # tables only
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.pipeline_run import run_pipeline, run_summary  # noqa: E402

ARMS = {"plain": [], "tool": ["env=calculator"]}
EVALS = (("warmup", "eval_warmup"), ("rft", "eval_rft"), ("rl", "eval_rl"))


def common_overrides(levels: list[int], max_new_tokens: int) -> list[str]:
    lv = "[" + ",".join(str(x) for x in levels) + "]"
    n = str(max_new_tokens)
    return [
        f"data.levels={lv}",
        f"sft.levels={lv}",
        f"rl.max_new_tokens={n}",
        f"eval.max_new_tokens={n}",
        f"curation.difficulty.max_new_tokens={n}",
    ]


def run_arm(ws: Path, overrides: list[str], resume: bool, in_place: bool = False) -> dict:
    """Run ``laminar run`` into ``ws`` (unless ``resume`` and it finished before); the run's record.
    ``in_place``: keep what ``ws`` holds, so stages whose cache key is unchanged come from cache."""
    return run_pipeline(ws, overrides, resume=resume, fresh=not in_place)


def artifact_dir(ws: Path, sha: str) -> Path:
    hits = [p for p in (ws / "artifacts").glob(f"*/{sha}") if p.is_dir()]
    if not hits:
        raise FileNotFoundError(f"artifact {sha} not under {ws}/artifacts")
    return hits[0]


def per_level_tool_use(rows_path: Path) -> dict[str, dict[str, float]]:
    """Level -> accuracy (avg over samples), tool calls and tool errors per episode, counted from the
    episode text of ``rows.parquet`` (a call is a line starting ``calc:``, an error ``= error:``)."""
    import polars as pl

    df = pl.read_parquet(rows_path).filter(pl.col("benchmark") == "arith_heldout")
    out: dict[str, dict[str, float]] = {}
    for level in sorted(set(df["level"].to_list()), key=lambda x: int(x)):
        sub = df.filter(pl.col("level") == level)
        texts = sub["response"].to_list()
        calls = [sum(ln.startswith("calc:") for ln in t.splitlines()) for t in texts]
        errors = [sum(ln.startswith("= error:") for ln in t.splitlines()) for t in texts]
        out[level] = {
            "accuracy": float(sub["correct"].mean()),
            "tool_calls": sum(calls) / len(texts),
            "episodes_with_call": sum(c > 0 for c in calls) / len(texts),
            "tool_errors": sum(errors) / len(texts),
            "n_samples": len(texts),
        }
    return out


def collect(ws: Path, rec: dict, long_levels: list[str]) -> dict:
    summary = run_summary(ws, rec)
    stages = summary["stages"]
    row: dict = {"run": rec, "stage_seconds": {k: v["seconds"] for k, v in stages.items()}}
    row["warnings"] = summary.get("warnings", [])
    for role, stage in EVALS:
        held = stages[stage]["metrics"]["arith_heldout"]
        by_level = dict(sorted(held["by_level"].items(), key=lambda kv: int(kv[0])))
        long_acc = statistics.fmean(by_level[lv] for lv in long_levels)
        art = artifact_dir(ws, stages[stage]["artifacts"]["eval"])
        full = json.loads((art / "summary.json").read_text())["arith_heldout"]  # the stage metrics drop these
        row[role] = {
            "accuracy": held["accuracy"],
            "long_accuracy": long_acc,
            "by_level": by_level,
            "tool_calls_per_episode": full.get("tool_calls_per_episode", 0.0),
            "tool_errors_per_episode": full.get("tool_errors_per_episode", 0.0),
            "turns_per_episode": full.get("turns_per_episode", 1.0),
            "by_level_tool_use": per_level_tool_use(art / "rows.parquet"),
        }
    hist_path = artifact_dir(ws, stages["rl"]["artifacts"]["model"]) / "history.jsonl"
    hist = [json.loads(line) for line in hist_path.read_text().splitlines() if line.strip()]
    keys = ("step", "reward", "accuracy", "response_length", "episode/tool_calls", "episode/tool_errors")
    row["rl_history"] = [{k: h.get(k) for k in (*keys, "episode/turns") if k in h} for h in hist]
    return row


def mean_sd(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}" if xs else "-"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def first_last(hist: list[dict], key: str, k: int = 5) -> tuple[float, float]:
    vals = [h.get(key, 0.0) or 0.0 for h in hist]
    return statistics.fmean(vals[:k]), statistics.fmean(vals[-k:])


def markdown(result: dict) -> str:
    seeds = sorted({int(s) for s in result["rows"]["tool"]})
    long = "+".join(result["long_levels"])
    rows = result["rows"]
    lines = [
        "| seed | plain long (L" + long + ") after RL | tool long after RL | gain (points) | "
        "plain all levels | tool all levels | tool calls/episode RL first 5 steps | last 5 steps | "
        "eval tool calls/episode | eval tool errors/episode | eval turns/episode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gains, p_long, t_long, c0, c1 = [], [], [], [], []
    for s in seeds:
        p, t = rows["plain"].get(str(s)), rows["tool"].get(str(s))
        if p is None or t is None:
            continue
        a, b = first_last(t["rl_history"], "episode/tool_calls")
        g = 100 * (t["rl"]["long_accuracy"] - p["rl"]["long_accuracy"])
        gains.append(g)
        p_long.append(p["rl"]["long_accuracy"])
        t_long.append(t["rl"]["long_accuracy"])
        c0.append(a)
        c1.append(b)
        lines.append(
            f"| {s} | {p['rl']['long_accuracy']:.3f} | {t['rl']['long_accuracy']:.3f} | {g:+.1f} | "
            f"{p['rl']['accuracy']:.3f} | {t['rl']['accuracy']:.3f} | {a:.2f} | {b:.2f} | "
            f"{t['rl']['tool_calls_per_episode']:.2f} | {t['rl']['tool_errors_per_episode']:.3f} | "
            f"{t['rl']['turns_per_episode']:.2f} |"
        )
    if gains:
        gsd = f"{statistics.fmean(gains):+.1f}" + (
            f" ± {statistics.stdev(gains):.1f}" if len(gains) > 1 else ""
        )
        lines.append(
            f"| mean ± sd | {mean_sd(p_long)} | {mean_sd(t_long)} | {gsd} | | | "
            f"{mean_sd(c0)} | {mean_sd(c1)} | | | |"
        )
    lines += ["", "Accuracy by level (held-out, avg@4) after warm-up / RFT / RL:", ""]
    levels = sorted(
        {lv for arm in rows.values() for r in arm.values() for lv in r["rl"]["by_level"]}, key=int
    )
    lines.append(
        "| arm | seed | stage | " + " | ".join(f"L{lv}" for lv in levels) + " | all | tool calls/ep |"
    )
    lines.append("|---|---|---|" + "---|" * (len(levels) + 2))
    for arm in ("plain", "tool"):
        for s in seeds:
            r = rows[arm].get(str(s))
            if r is None:
                continue
            for role, _ in EVALS:
                bl = r[role]["by_level"]
                lines.append(
                    f"| {arm} | {s} | {role} | "
                    + " | ".join(f"{bl.get(lv, float('nan')):.2f}" for lv in levels)
                    + f" | {r[role]['accuracy']:.3f} | {r[role]['tool_calls_per_episode']:.2f} |"
                )
    lines += [
        "",
        "Tool arm, tool calls per episode by level (from the episode text; share of episodes with a call):",
        "",
    ]
    lines.append("| seed | stage | " + " | ".join(f"L{lv}" for lv in levels) + " |")
    lines.append("|---|---|" + "---|" * len(levels))
    for s in seeds:
        r = rows["tool"].get(str(s))
        if r is None:
            continue
        for role, _ in EVALS:
            u = r[role]["by_level_tool_use"]
            lines.append(
                f"| {s} | {role} | "
                + " | ".join(
                    f"{u[lv]['tool_calls']:.2f} ({u[lv]['episodes_with_call']:.2f})" if lv in u else "-"
                    for lv in levels
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s, r in sorted(result["rows"]["tool"].items()):
        h = r["rl_history"]
        steps = [x["step"] for x in h]
        axes[0].plot(steps, [x.get("episode/tool_calls", 0.0) for x in h], label=f"seed {s}")
        axes[1].plot(steps, [x.get("accuracy", 0.0) for x in h], label=f"tool, seed {s}")
    for s, r in sorted(result["rows"]["plain"].items()):
        h = r["rl_history"]
        axes[1].plot(
            [x["step"] for x in h], [x.get("accuracy", 0.0) for x in h], "--", label=f"plain, seed {s}"
        )
    axes[0].set(xlabel="RL step", ylabel="tool calls per episode", title="env=calculator: tool calls over RL")
    axes[1].set(xlabel="RL step", ylabel="training-batch accuracy", title="RL batch accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--long-levels", nargs="+", default=["6"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--workspaces", type=Path, default=ROOT / "workspace-bench-calculator")
    ap.add_argument("--keep", action="store_true", help="keep the workspaces (needed for --resume)")
    ap.add_argument("--resume", action="store_true", help="reuse finished runs of kept workspaces")
    ap.add_argument("--collect-only", action="store_true", help="run nothing: collect kept workspaces")
    ap.add_argument(
        "--in-place",
        action="store_true",
        help="run in the kept workspaces as they are (unchanged stages cached) instead of fresh ones",
    )
    ap.add_argument("--out", type=Path, required=True, help="path without extension")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    common = common_overrides(args.levels, args.max_new_tokens) + list(args.overrides)
    result: dict = {
        "date": dt.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "argv": sys.argv[1:],
        "common_overrides": common,
        "long_levels": args.long_levels,
        "rows": {arm: {} for arm in ARMS},
    }
    for seed in args.seeds:
        for arm in args.arms:
            ws = args.workspaces / f"{arm}-s{seed}"
            overrides = [f"seed={seed}", f"threads={args.threads}", *ARMS[arm], *common]
            if args.collect_only:
                if not (ws / "bench_wall.json").exists():
                    continue
                rec = json.loads((ws / "bench_wall.json").read_text())
            else:
                rec = run_arm(ws, overrides, args.resume, args.in_place)
            row = collect(ws, rec, args.long_levels)
            result["rows"][arm][str(seed)] = row
            print(
                arm,
                seed,
                json.dumps({k: row[k]["long_accuracy"] for k in ("warmup", "rft", "rl")}),
                flush=True,
            )
            if not (args.keep or args.resume or args.collect_only):
                shutil.rmtree(ws, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    args.out.with_suffix(".table.md").write_text(table)
    if result["rows"]["tool"]:
        plot(result, args.out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
