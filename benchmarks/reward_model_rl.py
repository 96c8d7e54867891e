"""RL with the verifier + the learned reward model against the verifier alone, from workspaces that ran
both arms of ``reward=reward_model`` (one seed each):

    # per seed, in one workspace (the arms share every stage up to RL; the reward model at weight 0
    # only watches in the verifier arm, ends_with at weight 0 watches the rubric in both)
    E='{name: ends_with, weight: 0.0}'
    laminar --workspace WS run reward=reward_model threads=1 seed=S \\
        "reward.components=[{name: math_verify}, {name: reward_model, weight: 0.5, clip: 2.0}, $E]"
    laminar --workspace WS run reward=reward_model threads=1 seed=S \\
        "reward.components=[{name: math_verify}, {name: reward_model, weight: 0.0, clip: 2.0}, $E]"
    PYTHONPATH=$PWD .venv/bin/python benchmarks/reward_model_rl.py WS0 WS1 WS2 \\
        --out benchmarks/results/reward_models/NAME

Reads each run's summary.json, the RL checkpoint's per-step history and per-response reward terms, and
the eval stages' rows; writes NAME.json, NAME.md and NAME.png (per step, both arms: verifier accuracy,
reward-model score, the rubric's share).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

CLIP = 2.0
ARMS = ("verifier", "rm", "rm_noclip")


def _arm(run_dir: Path) -> str | None:
    """``rm``, ``rm_noclip`` (the reward model unclipped) or ``verifier`` from the run's reward
    components; None for runs of none of these arms."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    comps = {c["name"]: c for c in cfg["reward"]["components"]}
    if "ends_with" not in comps or "reward_model" not in comps:
        return None
    if comps["reward_model"]["weight"] <= 0:
        return "verifier"
    return "rm" if comps["reward_model"].get("clip") is not None else "rm_noclip"


def _eval(ws: Path, sha: str) -> dict:
    import polars as pl

    art = ws / "artifacts" / "eval" / sha
    s = json.loads((art / "summary.json").read_text())["arith_heldout"]
    rows = pl.read_parquet(art / "rows.parquet")
    n = s["n_samples"]
    return {
        "accuracy": s["accuracy"],
        "maj": s[f"maj@{n}"],
        "rm_best": s.get(f"rm_best@{n}"),
        "rm_score": s.get("reward/reward_model"),
        "rubric_share": float(rows["response"].str.strip_chars_end().str.ends_with(".").mean()),
        "n_problems": s["n_problems"],
        "n_samples": n,
    }


def read_run(ws: Path, run_dir: Path) -> dict:
    import polars as pl

    summary = json.loads((run_dir / "summary.json").read_text())
    st = summary["stages"]
    rl = ws / "artifacts" / "model" / st["rl"]["artifacts"]["model"]
    hist = [json.loads(line) for line in (rl / "history.jsonl").read_text().splitlines()]
    terms = pl.read_parquet(rl / "reward_terms.parquet").filter(pl.col("component") == "reward_model")
    at_clip = float((terms["value"].abs() >= CLIP - 1e-9).mean())
    last = terms.filter(pl.col("step") > terms["step"].max() - 10)
    return {
        "run_id": summary["run_id"],
        "rl_checkpoint": st["rl"]["artifacts"]["model"],
        "reward_model": st["reward_model"]["artifacts"]["model"],
        "rl_seconds": st["rl"]["seconds"],
        "rft": _eval(ws, st["eval_rft"]["artifacts"]["eval"]),
        "rl": _eval(ws, st["eval_rl"]["artifacts"]["eval"]),
        "steps": [
            {
                "step": int(h["step"]),
                "accuracy": h["accuracy"],
                "rm_score": h.get("reward/reward_model"),
                "rubric_share": h.get("reward/ends_with"),
            }
            for h in hist
        ],
        "rm_at_clip": at_clip,
        "rm_at_clip_last10": float((last["value"].abs() >= CLIP - 1e-9).mean()),
        "rm_metrics": {k: v for k, v in summary["metrics"].items() if k.startswith("reward_model_")},
    }


def read_workspace(ws: Path) -> dict:
    out: dict = {}
    for run_dir in sorted((ws / "runs").iterdir()):
        if not (run_dir / "summary.json").exists():
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        arm = _arm(run_dir)
        if arm is None or "rl" not in summary["stages"] or "eval_rl" not in summary["stages"]:
            continue
        out[arm] = read_run(ws, run_dir)  # the latest run of an arm wins
    return out


def _ms(xs) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) / len(xs) ** 0.5:.3f}"


def _plot(seeds: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    keys = (
        ("accuracy", "verifier accuracy (training batch)"),
        ("rm_score", "reward-model score (normalised, clipped at 2)"),
        ("rubric_share", "rubric share (answer ends with a full stop)"),
    )
    colors = {"rm": "tab:red", "verifier": "tab:blue", "rm_noclip": "tab:orange"}
    labels = {
        "rm": "verifier + RM (weight 0.5, clip 2)",
        "verifier": "verifier alone",
        "rm_noclip": "verifier + RM (weight 0.5, no clip)",
    }
    for ax, (key, title) in zip(axes, keys):
        for arm in ARMS:
            for i, (_seed, arms) in enumerate(sorted(seeds.items())):
                if arm not in arms:
                    continue
                steps = arms[arm]["steps"]
                ax.plot([s["step"] for s in steps], [s[key] for s in steps], color=colors[arm], alpha=0.7,
                        label=labels[arm] if i == 0 else None, lw=1)  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(seeds: dict) -> list[str]:
    lines = [
        "| seed | arm | RFT acc | RL acc | RL maj@n | RL rm_best@n | rubric RFT -> RL | RM score RFT -> RL "
        "| RM at clip (all, last 10 steps) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, arms in sorted(seeds.items()):
        for arm in ARMS:
            if arm not in arms:
                continue
            r = arms[arm]
            lines.append(
                f"| {seed} | {arm} | {r['rft']['accuracy']:.3f} | {r['rl']['accuracy']:.3f} | "
                f"{r['rl']['maj']:.3f} | {r['rl']['rm_best']:.3f} | {r['rft']['rubric_share']:.3f} -> "
                f"{r['rl']['rubric_share']:.3f} | {r['rft']['rm_score']:.3f} -> {r['rl']['rm_score']:.3f} | "
                f"{r['rm_at_clip']:.3f}, {r['rm_at_clip_last10']:.3f} |"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workspaces", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="path prefix of the .json, .md and .png")
    args = ap.parse_args()
    seeds = {}
    for ws in args.workspaces:
        cfg = yaml.safe_load(next(iter(sorted((ws / "runs").glob("*/config.yaml")))).read_text())
        seeds[int(cfg["seed"])] = read_workspace(ws)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(seeds, indent=1, sort_keys=True))
    _plot(seeds, args.out.with_suffix(".png"))
    agg = {}
    for arm in ARMS:
        runs = [a[arm] for a in seeds.values() if arm in a]
        if not runs:
            continue
        agg[arm] = {
            "n": len(runs),
            "rl_acc": _ms([r["rl"]["accuracy"] for r in runs]),
            "rl_rubric": _ms([r["rl"]["rubric_share"] for r in runs]),
            "rl_rm_best": _ms([r["rl"]["rm_best"] for r in runs]),
            "rl_maj": _ms([r["rl"]["maj"] for r in runs]),
        }
    text = [
        "| arm | seeds | RL held-out avg@n | maj@n | rm_best@n | rubric share |",
        "|---|---|---|---|---|---|",
    ]
    text += [
        f"| {arm} | {a['n']} | {a['rl_acc']} | {a['rl_maj']} | {a['rl_rm_best']} | {a['rl_rubric']} |"
        for arm, a in agg.items()
    ]
    args.out.with_suffix(".md").write_text("\n".join(text + [""] + _table(seeds)) + "\n")
    print("\n".join(text + [""] + _table(seeds)))


if __name__ == "__main__":
    main()
