"""LoRA against full fine-tuning on the default task, per seed, from the same warm-up and curation.

For every seed, one fresh workspace: first the default pipeline (full fine-tuning, ``seed=S
threads=T``), then the same command with the LoRA overrides (``model.lora.*`` and the adapters'
learning rates). Warm-up, difficulty, DART and everything upstream of RFT are cached from the first
run, so the two arms differ only in how RFT and RL train. Writes one JSON with both arms' rows
(held-out avg@4 after warm-up, RFT and RL, overall and per level; stage seconds; warnings) and a
markdown table next to it, and checks on every seed: LoRA RL > LoRA RFT.

    .venv/bin/python benchmarks/lora_accuracy.py --seeds 0 1 2 [--threads 1] [--label NAME]
        [--out benchmarks/results/lora] [lora overrides...]

Without overrides the LoRA arm is ``model.lora.enabled=true model.lora.rank=16
model.lora.stages=[rft,rl] curation.rft.lr=3e-3`` (docs/lora.md: the tiny model's warm-up starts
from random weights, so it trains every weight).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_run import laminar, row_of

ROOT = Path(__file__).resolve().parent.parent

LORA_DEFAULT = [
    "model.lora.enabled=true",
    "model.lora.rank=16",
    "model.lora.stages=[rft,rl]",
    "curation.rft.lr=3e-3",
]


def checks(pairs: list[dict]) -> dict[str, bool]:
    out = {}
    for p in pairs:
        a = p["lora"]["accuracy"]
        out[f"seed={p['seed']}: LoRA RL > LoRA RFT ({a['rl']:.3f} vs {a['rft']:.3f})"] = a["rl"] > a["rft"]
    return out


def markdown(pairs: list[dict], verdicts: dict[str, bool], header: str) -> str:
    lines = [
        header,
        "",
        "| seed | arm | warm-up | RFT | RL | RL - RFT | RL by level | RFT s | RL s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        for arm in ("full", "lora"):
            r = p[arm]
            a, s = r["accuracy"], r["stage_seconds"]
            lv = " ".join(f"L{k} {v:.2f}" for k, v in r["by_level"]["rl"].items())
            lines.append(
                f"| {p['seed']} | {arm} | {a['warmup']:.3f} | {a['rft']:.3f} | {a['rl']:.3f} | "
                f"{a['rl'] - a['rft']:+.3f} | {lv} | {s.get('rft', 0):.0f} | {s.get('rl', 0):.0f} |"
            )
    for arm in ("full", "lora"):
        m = {k: statistics.fmean(p[arm]["accuracy"][k] for p in pairs) for k in ("warmup", "rft", "rl")}
        lines.append(
            f"| mean | {arm} | {m['warmup']:.3f} | {m['rft']:.3f} | {m['rl']:.3f} | "
            f"{m['rl'] - m['rft']:+.3f} | | | |"
        )
    lines += ["", "Checks:"] + [f"- {'PASS' if ok else 'FAIL'} {name}" for name, ok in verdicts.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workspaces", type=Path, default=ROOT / "workspace-bench-lora")
    ap.add_argument(
        "--keep", action="store_true", help="keep the workspaces (default: delete each after use)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora")
    ap.add_argument("--label", default="")
    ap.add_argument(
        "--full-overrides", nargs="*", default=[], help="overrides of both arms (before the LoRA ones)"
    )
    ap.add_argument(
        "overrides", nargs="*", help=f"the LoRA arm's overrides (default: {' '.join(LORA_DEFAULT)})"
    )
    args = ap.parse_args()
    lora = args.overrides or LORA_DEFAULT
    pairs = []
    for seed in args.seeds:
        ws = args.workspaces / f"s{seed}"
        shutil.rmtree(ws, ignore_errors=True)
        base = [f"seed={seed}", f"threads={args.threads}", "tracking.backends=[]", *args.full_overrides]
        pair = {"seed": seed}
        for arm, extra in (("full", []), ("lora", lora)):
            summary, wall = laminar(ws, [*base, *extra])
            pair[arm] = row_of(summary, seed=seed, threads=args.threads, wall=wall)
            print(json.dumps({"seed": seed, "arm": arm, "accuracy": pair[arm]["accuracy"]}), flush=True)
        pairs.append(pair)
        if not args.keep:
            shutil.rmtree(ws, ignore_errors=True)
    verdicts = checks(pairs)
    stamp = dt.date.today().isoformat()
    name = f"lora_accuracy_{stamp}{'_' + args.label if args.label else ''}"
    header = (
        f"# LoRA vs full fine-tuning on the default task, {stamp}: "
        f"{platform.processor() or platform.machine()}, "
        f"threads={args.threads}; LoRA arm: {' '.join(lora)}"
        + (f"; both arms: {' '.join(args.full_overrides)}" if args.full_overrides else "")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(
        json.dumps(
            {
                "date": stamp,
                "threads": args.threads,
                "lora_overrides": lora,
                "full_overrides": args.full_overrides,
                "pairs": pairs,
                "checks": verdicts,
            },
            indent=1,
        )
    )
    table = markdown(pairs, verdicts, header)
    (args.out / f"{name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
