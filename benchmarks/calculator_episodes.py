"""Curation on episodes (issue 52, parts 4 and 5), measured on ``env=calculator`` with the long level.

Part 4, before/after: two workspaces of ``benchmarks/calculator_rl.py --arms tool`` (same seed, same
overrides), ``--before`` run at a commit whose curation samples single-turn, with the default recipe
(``curation.rft.steps=30 curation.select.strategy=hive``, what ``conf/env/calculator.yaml`` had to turn
off), ``--after`` at a commit whose curation samples episodes, with the same recipe. Collected per arm:
held-out accuracy per level after warm-up, RFT and RL, tool calls per episode (eval and over RL steps)
and the curation stages' own numbers (difficulty's pass rate and tool calls, DART's kept examples and
how many of them call the tool).

Part 5 (``--mix``): one more ``laminar run`` in the ``--after`` workspace, in place (every stage before
RL comes from cache), with ``envs=[calculator 0.7, single_turn 0.3]`` on the same pool: the share of
trained groups per environment (``consumed.json``, ``training.rl.mix.trained_shares``) against the
weights, and the per-environment metrics of every RL step (``env/NAME/...`` in ``history.jsonl``).

    .venv/bin/python benchmarks/calculator_episodes.py --before WS_BEFORE --after WS_AFTER [--mix] \\
        --out benchmarks/results/environments/2026-12-06_calculator_episodes
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.calculator_rl import EVALS, artifact_dir, collect, common_overrides  # noqa: E402
from benchmarks.pipeline_run import run_pipeline, run_summary  # noqa: E402

MIX = (
    "envs=[{target: calculator, weight: 0.7, max_turns: 4, tool_timeout_s: 5.0}, "
    "{target: single_turn, weight: 0.3}]"
)
CURATION_KEYS = (
    "mean_pass_rate",
    "learning_edge",
    "tool_calls_per_episode",
    "rft_examples",
    "rft_tool_episodes",
    "yield",
)


def arm(ws: Path, long_levels: list[str]) -> dict:
    rec = json.loads((ws / "bench_wall.json").read_text())
    row = collect(ws, rec, long_levels)
    stages = run_summary(ws, rec)["stages"]
    row["curation"] = {
        s: {k: v for k, v in stages[s]["metrics"].items() if k in CURATION_KEYS}
        for s in ("difficulty", "dart", "rft", "difficulty_rft")
        if s in stages
    }
    return row


def run_mix(
    ws: Path, seed: int, levels: list[int], max_new_tokens: int, base=("env=calculator",), mix=MIX
) -> dict:
    """``laminar run`` in ``ws`` in place with the environments of ``mix`` (an ``envs=[...]`` override)
    over the ``base`` overrides the workspace's run had (so every stage before RL comes from cache)."""
    overrides = [f"seed={seed}", "threads=1", *base, *common_overrides(levels, max_new_tokens), mix]
    return run_pipeline(
        ws, overrides, record="bench_mix.json", log="bench_mix_stdout.log", resume=True, fresh=False
    )


def mix_result(ws: Path, rec: dict, long_levels: list[str]) -> dict:
    from training.rl.mix import trained_shares

    stages = run_summary(ws, rec)["stages"]
    art = artifact_dir(ws, stages["rl"]["artifacts"]["model"])
    consumed = json.loads((art / "consumed.json").read_text())
    hist = [json.loads(line) for line in (art / "history.jsonl").read_text().splitlines() if line.strip()]
    per_step = [{k: v for k, v in h.items() if k == "step" or k.startswith("env/")} for h in hist]
    names = sorted({k.split("/")[1] for h in per_step for k in h if k.startswith("env/")})
    import yaml

    group_size = yaml.safe_load((ws / "runs" / rec["run_id"] / "config.yaml").read_text())["rl"]["group_size"]
    metrics = stages["eval_rl"]["metrics"]
    held = metrics.get("arith_heldout@all", metrics["arith_heldout"])
    by_level = dict(sorted(held["by_level"].items(), key=lambda kv: int(kv[0])))
    per_env_eval = {
        k.split("@", 1)[1]: {"accuracy": v["accuracy"], "by_level": v["by_level"]}
        for k, v in metrics.items()
        if k.startswith("arith_heldout@")
    }
    summary = {}
    for n in names:
        groups = [h.get(f"env/{n}/groups", 0.0) for h in per_step]
        summary[n] = {
            "trained_groups": sum(v for k, v in consumed.items() if k.startswith(n + "/")) / group_size,
            "group_share_min_step": min(h.get(f"env/{n}/group_share", 0.0) for h in per_step),
            "group_share_max_step": max(h.get(f"env/{n}/group_share", 0.0) for h in per_step),
            "groups_total": sum(groups),
            **{
                f"{key}_{part}": statistics.fmean(
                    h.get(f"env/{n}/{key}", 0.0)
                    for h in (per_step[:5] if part == "first5" else per_step[-5:])
                )
                for key in ("accuracy", "tool_calls", "turns")
                for part in ("first5", "last5")
            },
        }
    return {
        "run": rec,
        "trained_shares": trained_shares(consumed),
        "per_env": summary,
        "per_step": per_step,
        "eval_rl": {
            "accuracy": held["accuracy"],
            "long_accuracy": statistics.fmean(by_level[lv] for lv in long_levels),
            "by_level": by_level,
        },
        "eval_rl_per_env": per_env_eval,
    }


def markdown(res: dict) -> str:
    lines = ["## Part 4: curation on episodes, before/after (seed " + str(res["seed"]) + ")", ""]
    levels = sorted({lv for a in ("before", "after") for lv in res[a]["rl"]["by_level"]}, key=int)
    lines.append("| arm | stage | " + " | ".join(f"L{lv}" for lv in levels) + " | all | eval tool calls/ep |")
    lines.append("|---|---|" + "---|" * (len(levels) + 2))
    for a in ("before", "after"):
        for role, _ in EVALS:
            r = res[a][role]
            lines.append(
                f"| {a} | {role} | "
                + " | ".join(f"{r['by_level'].get(lv, float('nan')):.2f}" for lv in levels)
                + f" | {r['accuracy']:.3f} | {r['tool_calls_per_episode']:.2f} |"
            )
    lines += [
        "",
        "| arm | stage | " + " | ".join(CURATION_KEYS) + " |",
        "|---|---|" + "---|" * len(CURATION_KEYS),
    ]
    for a in ("before", "after"):
        for s, m in res[a]["curation"].items():
            lines.append(
                f"| {a} | {s} | " + " | ".join(f"{m[k]:.3f}" if k in m else "-" for k in CURATION_KEYS) + " |"
            )
    lines += ["", "| arm | RL tool calls/episode first 5 steps | last 5 steps |", "|---|---|---|"]
    for a in ("before", "after"):
        vals = [h.get("episode/tool_calls", 0.0) or 0.0 for h in res[a]["rl_history"]]
        lines.append(f"| {a} | {statistics.fmean(vals[:5]):.2f} | {statistics.fmean(vals[-5:]):.2f} |")
    if "mix" in res:
        lines += ["", "## Part 5: calculator 0.7 / single_turn 0.3 in one run", ""]
        lines += mix_lines(res["mix"], (("calculator", 0.7), ("single_turn", 0.3)))
    return "\n".join(lines) + "\n"


def mix_lines(m: dict, weights) -> list[str]:
    """The table of a mixed run (``mix_result``) for the environments ``weights`` ((name, weight), ...)."""
    lines = [
        "| env | weight | trained share | trained groups | per-step share min..max | "
        "accuracy first 5 / last 5 | tool calls/ep first 5 / last 5 | turns/ep last 5 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, w in weights:
        e = m["per_env"][n]
        lines.append(
            f"| {n} | {w} | {m['trained_shares'][n]:.3f} | {e['trained_groups']:.0f} | "
            f"{e['group_share_min_step']:.3f}..{e['group_share_max_step']:.3f} | "
            f"{e['accuracy_first5']:.2f} / {e['accuracy_last5']:.2f} | "
            f"{e['tool_calls_first5']:.2f} / {e['tool_calls_last5']:.2f} | {e['turns_last5']:.2f} |"
        )
    ev = m["eval_rl"]
    lines.append(f"\nHeld-out after the mixed RL: all {ev['accuracy']:.3f}, long {ev['long_accuracy']:.3f}.")
    for n, e in sorted(m.get("eval_rl_per_env", {}).items()):
        lines.append(f"- under `{n}`: all {e['accuracy']:.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--mix", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--long-levels", nargs="+", default=["6"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    res = {"date": dt.date.today().isoformat(), "seed": a.seed}
    res["before"], res["after"] = arm(a.before, a.long_levels), arm(a.after, a.long_levels)
    if a.mix:
        rec = run_mix(a.after, a.seed, a.levels, a.max_new_tokens)
        res["mix"] = mix_result(a.after, rec, a.long_levels)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(res, indent=1, sort_keys=True))
    a.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
