"""The example OpenAI-API agent through the whole pipeline (issue 52, deliverable 6 and its must-show),
against the in-process calculator environment on the same seeds and levels.

Two arms per seed, each in its own fresh workspace, through the real CLI: ``agent`` is
``recipe=agent_calc`` (``examples/agents/react_calc.py`` as ``env.target``: warm-up on the agent's own
tool demonstrations, curation sampling whole agent episodes, RFT on the correct ones, RL and every
evaluation through the endpoint and the same agent); ``calculator`` is ``env=calculator`` (the
in-process tool environment of ``benchmarks/calculator_rl.py``). Both get the same data, token budget
(``calculator_rl.common_overrides``) and the extra overrides given on the command line (shorter
settings for a loaded machine). Collected per (arm, seed) by ``calculator_rl.collect``: held-out
accuracy per level after warm-up, RFT and RL (the agent's before-RL numbers are its warm-up and RFT
checkpoints through the same agent), tool calls per episode in each evaluation and over RL steps.
The two arms of a seed run side by side (``--parallel``, two processes) or one after the other;
``OUT.json``, ``OUT.md`` and ``OUT.png`` (tool calls per episode over RL steps) are written after
every seed, so a run cut short still leaves the seeds it finished.

    .venv/bin/python benchmarks/agent_pipeline.py --seeds 0 1 2 --parallel --nice 5 \\
        --out benchmarks/results/agents/agent_pipeline_3seeds_2026-12-06 [--resume] [overrides...]
    # seeds side by side: one process per seed (each --out its own), then the tables of all of them
    .venv/bin/python benchmarks/agent_pipeline.py --collect-only --seeds 0 1 2 --out ...
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.calculator_rl import (  # noqa: E402
    EVALS,
    artifact_dir,
    collect,
    common_overrides,
    first_last,
    mean_sd,
)
from benchmarks.calculator_episodes import mix_lines, mix_result, run_mix  # noqa: E402
from benchmarks.pipeline_run import run_pipeline, run_summary  # noqa: E402

ARMS = {"agent": ["recipe=agent_calc"], "calculator": ["env=calculator"]}
# the must-show mix: the example agent 0.7 and the in-process calculator 0.3 in one RL run, over the
# agent arm's curated pool (run in place in its workspace: every stage before RL from cache)
MIX = (
    "envs=[{name: agent, target: 'examples.agents.react_calc:solve', weight: 0.7, max_turns: 4, "
    "tool_timeout_s: 30.0}, "
    "{name: calculator, target: calculator, weight: 0.3, max_turns: 4, tool_timeout_s: 5.0}]"
)
MIX_WEIGHTS = (("agent", 0.7), ("calculator", 0.3))


def run_seed(seed: int, args, common: list[str]) -> dict:
    """Both arms of ``seed`` (side by side with ``--parallel``); arm -> collected row."""

    def one(arm: str) -> dict | None:
        ws = args.workspaces / f"{arm}-s{seed}"
        if args.collect_only or arm not in args.run_arms:
            if not (ws / "bench_wall.json").exists():
                return None
            rec = json.loads((ws / "bench_wall.json").read_text())
        else:
            overrides = [f"seed={seed}", f"threads={args.threads}", *ARMS[arm], *common]
            rec = run_pipeline(ws, overrides, resume=args.resume, fresh=not args.keep, nice=args.nice)
        row = collect(ws, rec, args.long_levels)
        paths = eval_rows(ws, rec)
        row["eval_rows"] = {role: str(p) for role, p in paths.items()}
        row["no_turn"] = no_turn_episodes(paths, args.long_levels)
        return row

    with ThreadPoolExecutor(len(ARMS) if args.parallel else 1) as pool:
        return {arm: row for arm, row in zip(ARMS, pool.map(one, ARMS)) if row is not None}


def eval_rows(ws: Path, rec: dict) -> dict:
    """Role -> the ``rows.parquet`` of that evaluation of the run ``rec``."""
    stages = run_summary(ws, rec)["stages"]
    return {role: artifact_dir(ws, stages[st]["artifacts"]["eval"]) / "rows.parquet" for role, st in EVALS}


def no_turn_episodes(rows: dict, long_levels: list[str]) -> dict:
    """Per evaluation: held-out samples whose episode ended before any turn (no response token: an
    agent episode refused at ``reset``, e.g. ``agent_capacity`` past ``env.params.max_sessions``),
    and the ``[problem_id, sample_idx]`` of the long levels' samples that did run."""
    import polars as pl

    out = {}
    for role, path in rows.items():
        df = pl.read_parquet(path).filter(pl.col("benchmark") == "arith_heldout")
        ran = df.filter((pl.col("length") > 0) & pl.col("level").is_in(long_levels))
        out[role] = {
            "no_turn": int((df["length"] == 0).sum()),
            "samples": len(df),
            "long_ran": sorted([p, int(i)] for p, i in zip(ran["problem_id"], ran["sample_idx"])),
        }
    return out


def same_samples(res: dict) -> dict:
    """Long-level accuracy of both arms on the samples whose agent episode ran (per seed and eval):
    the comparison without the agent's refused episodes counted as wrong."""
    import polars as pl

    out: dict = {}
    for s, agent in res["rows"]["agent"].items():
        calc = res["rows"]["calculator"].get(s)
        if calc is None or "no_turn" not in agent:
            continue
        out[s] = {}
        for role, _ in EVALS:
            keep = {tuple(k) for k in agent["no_turn"][role]["long_ran"]}
            row = {"samples": len(keep)}
            for arm, r in (("agent", agent), ("calculator", calc)):
                df = pl.read_parquet(r["eval_rows"][role]).filter(pl.col("level").is_in(res["long_levels"]))
                hits = [
                    c for p, i, c in zip(df["problem_id"], df["sample_idx"], df["correct"]) if (p, i) in keep
                ]
                row[arm] = sum(hits) / len(hits) if hits else float("nan")
            out[s][role] = row
    return out


def markdown(res: dict) -> str:
    rows, long = res["rows"], "+".join(res["long_levels"])
    seeds = sorted({int(s) for arm in rows.values() for s in arm})
    lines = [
        f"| seed | arm | long (L{long}) warm-up | RFT | RL | all levels warm-up | RFT | RL | "
        "eval tool calls/ep warm-up | RFT | RL | RL tool calls/ep first 5 steps | last 5 steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    per_arm: dict = {arm: {"long": {r: [] for r, _ in EVALS}, "first": [], "last": []} for arm in ARMS}
    for s in seeds:
        for arm in ARMS:
            r = rows[arm].get(str(s))
            if r is None:
                continue
            a, b = first_last(r["rl_history"], "episode/tool_calls")
            per_arm[arm]["first"].append(a)
            per_arm[arm]["last"].append(b)
            for role, _ in EVALS:
                per_arm[arm]["long"][role].append(r[role]["long_accuracy"])
            lines.append(
                f"| {s} | {arm} | "
                + " | ".join(f"{r[role]['long_accuracy']:.3f}" for role, _ in EVALS)
                + " | "
                + " | ".join(f"{r[role]['accuracy']:.3f}" for role, _ in EVALS)
                + " | "
                + " | ".join(f"{r[role]['tool_calls_per_episode']:.2f}" for role, _ in EVALS)
                + f" | {a:.2f} | {b:.2f} |"
            )
    for arm in ARMS:
        p = per_arm[arm]
        if p["first"]:
            lines.append(
                f"| mean ± sd | {arm} | "
                + " | ".join(mean_sd(p["long"][role]) for role, _ in EVALS)
                + " | | | | | | | "
                + f"{mean_sd(p['first'])} | {mean_sd(p['last'])} |"
            )
    same = same_samples(res)
    if same:
        lines += [
            "",
            f"Long levels (L{long}) on the samples whose agent episode ran (the agent's episodes refused "
            "at reset left out of both arms), and the agent's refused episodes per evaluation:",
            "",
            "| seed | eval | samples kept | agent | calculator | agent episodes with no turn (all levels) |",
            "|---|---|---|---|---|---|",
        ]
        for s in sorted(same, key=int):
            for role, _ in EVALS:
                x, nt = same[s][role], rows["agent"][s]["no_turn"][role]
                lines.append(
                    f"| {s} | {role} | {x['samples']} | {x['agent']:.3f} | {x['calculator']:.3f} | "
                    f"{nt['no_turn']}/{nt['samples']} |"
                )
        for role, _ in EVALS:
            a = [same[s][role]["agent"] for s in same]
            c = [same[s][role]["calculator"] for s in same]
            lines.append(f"| mean ± sd | {role} | | {mean_sd(a)} | {mean_sd(c)} | |")
    levels = sorted(
        {lv for arm in rows.values() for r in arm.values() for lv in r["rl"]["by_level"]}, key=int
    )
    lines += ["", "Held-out accuracy by level (avg over samples) after warm-up / RFT / RL:", ""]
    lines.append("| arm | seed | stage | " + " | ".join(f"L{lv}" for lv in levels) + " | all |")
    lines.append("|---|---|---|" + "---|" * (len(levels) + 1))
    for arm in ARMS:
        for s in seeds:
            r = rows[arm].get(str(s))
            for role, _ in EVALS if r else ():
                bl = r[role]["by_level"]
                lines.append(
                    f"| {arm} | {s} | {role} | "
                    + " | ".join(f"{bl.get(lv, float('nan')):.2f}" for lv in levels)
                    + f" | {r[role]['accuracy']:.3f} |"
                )
    lines += ["", "| arm | seed | wall s | stages (s) |", "|---|---|---|---|"]
    for arm in ARMS:
        for s in seeds:
            r = rows[arm].get(str(s))
            if r:
                st = ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items() if v >= 1)
                lines.append(f"| {arm} | {s} | {r['run']['wall_s']:.0f} | {st} |")
    if "mix" in res:
        lines += ["", f"## The agent 0.7 / the calculator 0.3 in one RL run (seed {res['mix']['seed']})", ""]
        lines += mix_lines(res["mix"], MIX_WEIGHTS)
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, style in (("agent", "-"), ("calculator", "--")):
        for s, r in sorted(res["rows"][arm].items()):
            h = r["rl_history"]
            steps = [x["step"] for x in h]
            axes[0].plot(
                steps, [x.get("episode/tool_calls", 0.0) for x in h], style, label=f"{arm}, seed {s}"
            )
            axes[1].plot(steps, [x.get("accuracy", 0.0) for x in h], style, label=f"{arm}, seed {s}")
    axes[0].set(xlabel="RL step", ylabel="tool calls per episode", title="tool calls per episode over RL")
    axes[1].set(xlabel="RL step", ylabel="training-batch accuracy", title="RL batch accuracy")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("example OpenAI-API agent (solid) vs in-process calculator (dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, sort_keys=True))
    out.with_suffix(".md").write_text(markdown(res))
    if any(res["rows"].values()):
        plot(res, out.with_suffix(".png"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--long-levels", nargs="+", default=["6"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--workspaces", type=Path, default=ROOT / "workspace-bench-agent")
    ap.add_argument("--parallel", action="store_true", help="the two arms of a seed side by side")
    ap.add_argument("--nice", type=int, default=0, help="niceness increment of the pipeline runs")
    ap.add_argument("--resume", action="store_true", help="reuse finished runs in the workspaces")
    ap.add_argument("--collect-only", action="store_true", help="run nothing: collect finished runs")
    ap.add_argument("--keep", action="store_true", help="run in the workspaces as they are (cached stages)")
    ap.add_argument("--run-arms", nargs="+", choices=list(ARMS), default=list(ARMS),
                    help="the arms to run; the others are collected from their workspaces")  # fmt: skip
    ap.add_argument("--mix", type=int, metavar="SEED", default=None,
                    help="then the agent 0.7 / calculator 0.3 mix in place in agent-sSEED")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="path without extension")
    ap.add_argument("overrides", nargs="*", help="laminar run overrides for both arms")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    common = common_overrides(args.levels, args.max_new_tokens) + list(args.overrides)
    res: dict = {
        "date": dt.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "argv": sys.argv[1:],
        "arms": ARMS,
        "common_overrides": common,
        "long_levels": args.long_levels,
        "rows": {arm: {} for arm in ARMS},
    }
    for seed in args.seeds:
        for arm, row in run_seed(seed, args, common).items():
            res["rows"][arm][str(seed)] = row
            print(arm, seed, json.dumps({r: round(row[r]["long_accuracy"], 3) for r, _ in EVALS}), flush=True)
        write(res, args.out)
    if args.mix is not None:
        ws = args.workspaces / f"agent-s{args.mix}"
        rec = run_mix(
            ws, args.mix, args.levels, args.max_new_tokens, base=[*ARMS["agent"], *args.overrides], mix=MIX
        )
        res["mix"] = {"seed": args.mix, **mix_result(ws, rec, args.long_levels)}
        write(res, args.out)
    print(markdown(res))


if __name__ == "__main__":
    main()
