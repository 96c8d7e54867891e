"""Length shaping on the default task: seeds x {verifier, cosine, cosine + repetition} with a longer
generation limit and rambling warm-up demonstrations (``data.demo_restate_rate``: after each step the
running total is restated a geometric number of times), so the model starts RL long and repetitive
for no gain. One workspace per seed, so every reward reuses the seed's curation and warm-up from
cache (the reward is in the RL stage's key only). ``--resume`` keeps the rows already in the JSON.

    nice -n 10 python benchmarks/reward_length.py --seeds 0 1 2 --threads 1 --resume

Per run it reads the RL artifact's ``history.jsonl`` (per step: mean length of correct and of wrong
responses, repeated 3-gram rate, truncation, accuracy, each reward term) and the held-out accuracy
of ``eval_rl``; writes ``benchmarks/results/rewards/<date>_length.json`` and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATE = "2026-12-03"
REWARDS = {
    "verifier": ["reward=verifier"],
    "cosine": ["reward.components=[{name: math_verify, weight: 0.0}, {name: cosine_length}]"],
    "cosine_repetition": ["reward=long_cot"],
}
STEP_KEYS = (
    "accuracy",
    "response_length",
    "response_length_correct",
    "response_length_wrong",
    "repeated_ngram_rate",
    "truncated",
    "reward",
)


def run_one(ws: Path, seed: int, name: str, args) -> dict:
    overrides = [
        f"seed={seed}",
        f"threads={args.threads}",
        f"rl.max_new_tokens={args.max_new_tokens}",
        f"data.demo_restate_rate={args.restate_rate}",
        f"eval.max_new_tokens={args.max_new_tokens}",
        *REWARDS[name],
    ]
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", *overrides, "--workspace", str(ws)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed:\n{proc.stderr[-3000:]}")
    run_dir = max((ws / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    summary = json.loads((run_dir / "summary.json").read_text())
    sha = summary["stages"]["rl"]["artifacts"]["model"]
    (art,) = (ws / "artifacts" / "model").glob(f"{sha}*")
    history = [json.loads(line) for line in (art / "history.jsonl").read_text().splitlines()]
    return {
        "seed": seed,
        "reward": name,
        "overrides": overrides,
        "wall_s": round(time.time() - t0, 1),
        "heldout_accuracy_rl": summary["metrics"].get("heldout_accuracy_rl"),
        "heldout_accuracy_rft": summary["metrics"].get("heldout_accuracy_rft"),
        "steps": [{k: m.get(k) for k in ("step", *STEP_KEYS)} | _terms(m) for m in history],
    }


def _terms(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith("reward/")}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("response_length_correct", "response_length_wrong", "repeated_ngram_rate", "truncated")
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    colours = {"verifier": "tab:blue", "cosine": "tab:orange", "cosine_repetition": "tab:green"}
    for ax, key in zip(axes, keys):
        for r in rows:
            xs = [s["step"] for s in r["steps"]]
            ys = [s.get(key) if s.get(key) is not None else float("nan") for s in r["steps"]]
            ax.plot(xs, ys, color=colours[r["reward"]], alpha=0.6, label=f"{r['reward']} s{r['seed']}")
        ax.set_title(key)
        ax.set_xlabel("RL step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rewards", nargs="+", default=list(REWARDS), choices=list(REWARDS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--restate-rate", type=float, default=0.3)
    ap.add_argument("--tag", default="length", help="results file name: <date>_<tag>.json / .png")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--workspaces", type=Path, default=Path("/tmp/reward-layer-length"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rewards")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{DATE}_{args.tag}.json"
    rows = json.loads(out.read_text())["rows"] if args.resume and out.exists() else []
    done = {(r["seed"], r["reward"]) for r in rows}
    for seed in args.seeds:
        for name in args.rewards:
            if (seed, name) in done:
                continue
            rows.append(run_one(args.workspaces / f"seed{seed}", seed, name, args))
            print(f"seed {seed} {name}: held-out {rows[-1]['heldout_accuracy_rl']} ({rows[-1]['wall_s']} s)")
            out.write_text(json.dumps({"date": DATE, "machine": "2-core CPU", "rows": rows}, indent=1))
    plot(rows, args.out / f"{DATE}_{args.tag}.png")


if __name__ == "__main__":
    main()
