"""The entropy bonus against none on the same seed: `laminar run seed=S rl.algorithm=A` twice in one
workspace (only RL and its evaluation rerun), with and without `rl.entropy_coef=C`; writes the token
entropy per RL step of both runs as JSON and a plot, and the held-out accuracy after RL of each.

    .venv/bin/python benchmarks/entropy_bonus.py [--seed 0] [--algorithm grpo] [--coef 0.01] \\
        [--threads 1] --out benchmarks/results/objectives/DATE_entropy_bonus [overrides...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from objectives import ROOT, held, last_tenth, rl_history, run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument("--coef", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workspace", type=Path, default=ROOT / "workspace-bench-objectives")
    ap.add_argument("--out", type=Path, required=True, help="path stem: writes STEM.json and STEM.png")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    base = [f"seed={args.seed}", f"threads={args.threads}", f"rl.algorithm={args.algorithm}", *args.overrides]
    arms = {}
    for name, extra in (("no bonus", []), (f"entropy_coef={args.coef}", [f"rl.entropy_coef={args.coef}"])):
        s = run(args.workspace, base + extra)
        ent = rl_history(args.workspace, s["stages"]["rl"]["cache_key"]).get("entropy", [])
        arms[name] = {
            "entropy": ent,
            "entropy_end": last_tenth(ent),
            "acc_rl": held(s, "eval_rl").get("accuracy"),
            "run_id": s["run_id"],
        }
        print(
            f"{name}: entropy last 10% {arms[name]['entropy_end']:.4f}, held-out {arms[name]['acc_rl']:.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"args": vars(args) | {"out": str(args.out), "workspace": str(args.workspace)}, "arms": arms},
            indent=1,
        )
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, arm in arms.items():
        ax.plot(
            range(1, len(arm["entropy"]) + 1), arm["entropy"], label=f"{name} (held-out {arm['acc_rl']:.3f})"
        )
    ax.set_xlabel("RL update")
    ax.set_ylabel("mean token entropy (nats)")
    ax.set_title(f"{args.algorithm}, seed {args.seed}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
