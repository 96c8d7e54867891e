"""Rounds 1 -> 2 -> 3 (``rounds=3``, docs/rounds.md): held-out accuracy of each round's RL model per seed.

For every seed: ``laminar run seed=S rounds=R [overrides]`` in a fresh workspace; the run's summary.json
gives held-out accuracy after warm-up, RFT, RL (round 1) and each later round's RL model
(``heldout_accuracy_rl@k``). With ``--control``, afterwards and in the same workspace (warm-up and
round-1 curation from cache), ``rounds=1 rl.steps=R*S`` trains RL alone for as many updates as the R
rounds took together: whether the rounds gain more than more RL steps would. Results (JSON, markdown
and a plot) are rewritten after every run, so an interrupted measurement still leaves its numbers.

    .venv/bin/python benchmarks/rounds.py --seeds 0 1 2 --rounds 3 [--control] \\
        [--out benchmarks/results/rounds] [--label rounds_3seeds_2026-12-06] [overrides...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def laminar(ws: Path, overrides: list[str]) -> tuple[dict, float]:
    """(summary.json of the run, wall seconds of the command)."""
    cmd = [sys.executable, "-m", "flows.cli", "run", "--workspace", str(ws), *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    latest = max((ws / "runs").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(latest.read_text()), wall


def round_row(seed: int, summary: dict, wall: float, rounds: int) -> dict:
    m = summary["metrics"]
    acc = {"warmup": m.get("heldout_accuracy_warmup"), "rft": m.get("heldout_accuracy_rft")}
    acc |= {
        f"round{k}": m.get("heldout_accuracy_rl" + ("" if k == 1 else f"@{k}")) for k in range(1, rounds + 1)
    }
    stages = summary["stages"]
    return {
        "seed": seed,
        "accuracy": acc,
        "checkpoints": {k: v for k, v in summary["checkpoints"].items() if k.startswith("rl")},
        "rl_reward_last5": {
            n: s["metrics"].get("reward_last5") for n, s in stages.items() if n.split("@")[0] == "rl"
        },
        "rft_examples": {
            n: s["metrics"].get("rft_examples") for n, s in stages.items() if n.split("@")[0] == "rft"
        },
        "selected": {
            n: s["metrics"].get("selected") for n, s in stages.items() if n.split("@")[0] == "select"
        },
        "stage_seconds": {n: round(s["seconds"], 1) for n, s in stages.items()},
        "wall_s": round(wall, 1),
        "run_id": summary["run_id"],
    }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def write(out: Path, label: str, meta: dict, rows: list[dict], controls: list[dict], rounds: int) -> None:
    cols = ["warmup", "rft", *(f"round{k}" for k in range(1, rounds + 1))]
    means = {c: _mean([r["accuracy"][c] for r in rows]) for c in cols}
    data = {**meta, "rows": rows, "controls": controls, "mean": means}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}.json").write_text(json.dumps(data, indent=1))
    head = ["seed", "warm-up", "RFT", *(f"RL round {k}" for k in range(1, rounds + 1)), "wall s"]
    lines = [
        f"# Rounds 1 -> {rounds}, {meta['date']}: {meta['machine']}",
        "",
        "Command per seed (fresh workspace): "
        f"`laminar run seed=S rounds={rounds} {' '.join(meta['overrides'])}`.",
        "Held-out accuracy (arith_heldout, avg@n of the eval settings) of each round's RL model.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join([str(r["seed"]), *(_fmt(r["accuracy"][c]) for c in cols), f"{r['wall_s']:.0f}"])
            + " |"
        )
    lines.append("| mean | " + " | ".join(_fmt(means[c]) for c in cols) + " | |")
    if controls:
        lines += [
            "",
            f"Control: RL alone for as many updates as the {rounds} rounds (`rounds=1 rl.steps=N`), same "
            "warm-up and round-1 curation (from cache):",
            "",
            "| seed | rl.steps | RL alone | rounds (last round) |",
            "|---|---|---|---|",
        ]
        by_seed = {r["seed"]: r for r in rows}
        for c in controls:
            last = by_seed[c["seed"]]["accuracy"][f"round{rounds}"]
            lines.append(f"| {c['seed']} | {c['rl_steps']} | {_fmt(c['accuracy'])} | {_fmt(last)} |")
        lines.append(
            f"| mean | | {_fmt(_mean([c['accuracy'] for c in controls]))} | "
            f"{_fmt(_mean([by_seed[c['seed']]['accuracy'][f'round{rounds}'] for c in controls]))} |"
        )
    (out / f"{label}.md").write_text("\n".join(lines) + "\n")
    plot(out / f"{label}.png", rows, controls, rounds, meta)


def plot(path: Path, rows: list[dict], controls: list[dict], rounds: int, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["warmup", "rft", *(f"round{k}" for k in range(1, rounds + 1))]
    names = ["warm-up", "RFT", *(f"RL r{k}" for k in range(1, rounds + 1))]
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        xs = [(i, r["accuracy"][c]) for i, c in enumerate(cols) if r["accuracy"][c] is not None]
        ax.plot([x for x, _ in xs], [y for _, y in xs], marker="o", alpha=0.6, label=f"seed {r['seed']}")
    means = [_mean([r["accuracy"][c] for r in rows]) for c in cols]
    ax.plot(range(len(cols)), means, color="black", linewidth=2.5, marker="s", label="mean")
    for c in controls:
        ax.scatter([len(cols) - 1], [c["accuracy"]], marker="x", color="red", zorder=5)
    if controls:
        ax.scatter([], [], marker="x", color="red", label=f"RL alone, {controls[0]['rl_steps']} steps")
    ax.set_xticks(range(len(cols)), names)
    ax.set_ylabel("held-out accuracy")
    title = f"rounds={rounds}: held-out accuracy per round ({' '.join(meta['overrides'])})"
    ax.set_title(textwrap.fill(title, 90), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--control", action="store_true", help="also RL alone for the rounds' total updates")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rounds")
    ap.add_argument("--label", default=f"rounds_3seeds_{dt.date.today().isoformat()}")
    ap.add_argument("--work", type=Path, default=Path("/tmp/laminar_rounds_bench"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    meta = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores (shared)",
        "rounds": args.rounds,
        "overrides": args.overrides,
    }
    rows: list[dict] = []
    controls: list[dict] = []
    for seed in args.seeds:
        ws = args.work / f"seed{seed}"
        summary, wall = laminar(ws, [f"seed={seed}", f"rounds={args.rounds}", *args.overrides])
        rows.append(round_row(seed, summary, wall, args.rounds))
        write(args.out, args.label, meta, rows, controls, args.rounds)
        print(json.dumps(rows[-1]["accuracy"]), flush=True)
    if args.control:
        steps = _rl_steps(args.overrides) * args.rounds
        for seed in args.seeds:
            ws = args.work / f"seed{seed}"
            rest = [o for o in args.overrides if not o.startswith("rl.steps=")]
            summary, wall = laminar(ws, [f"seed={seed}", *rest, f"rl.steps={steps}"])
            acc = summary["metrics"].get("heldout_accuracy_rl")
            controls.append({"seed": seed, "rl_steps": steps, "accuracy": acc, "wall_s": round(wall, 1)})
            write(args.out, args.label, meta, rows, controls, args.rounds)
            print(json.dumps(controls[-1]), flush=True)
    return 0


def _rl_steps(overrides: list[str]) -> int:
    given = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("rl.steps=")]
    if given:
        return given[-1]
    from conf.loader import load_config

    return load_config([]).rl.steps


if __name__ == "__main__":
    sys.exit(main())
