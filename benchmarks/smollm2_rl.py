"""Collect one ``recipe=smollm2_arith`` run from its workspace: held-out accuracy per level of the model
as shipped (``eval_warmup``: no warm-up steps) and after RL (``eval_rl``), the in-run held-out curve, and
per RL step the reward, accuracy, format share, mean response length, truncation and (from the run's
log, which holds the timings ``history.jsonl`` leaves out) generation and training seconds.

    .venv/bin/python benchmarks/smollm2_rl.py --workspace WS --log run.log \\
        --out benchmarks/results/smollm2/x.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEP = re.compile(r"step\s+(\d+)/\d+ \|.*?gen ([\d.]+)s \| train ([\d.]+)s")


def _latest_run(ws: Path) -> dict:
    runs = sorted((ws / "runs").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"no finished run in {ws}")
    return json.loads(runs[-1].read_text())


def _artifact(ws: Path, summary: dict, stage: str, kind: str) -> Path:
    return ws / "artifacts" / kind / summary["stages"][stage]["artifacts"][kind]


def _eval(ws: Path, summary: dict, stage: str) -> dict:
    s = json.loads((_artifact(ws, summary, stage, "eval") / "summary.json").read_text())["arith_heldout"]
    keep = ("accuracy", "mean_length", "truncation_rate", "n_problems", "n_samples")
    return {**{k: s[k] for k in keep}, "by_level": {lv: v["avg@2"] for lv, v in s["by_level"].items()}}


def collect(ws: Path, log: Path | None) -> dict:
    summary = _latest_run(ws)
    rl_dir = _artifact(ws, summary, "rl", "model")
    steps = [json.loads(line) for line in (rl_dir / "history.jsonl").read_text().splitlines() if line]
    timings = {}
    if log is not None and log.is_file():
        for m in STEP.finditer(log.read_text(errors="replace")):
            timings[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    curve = []
    for s in steps:
        row = {k: s.get(k) for k in ("step", "reward", "accuracy", "response_length", "truncated", "entropy")}
        row["format"] = s.get("format", s.get("extra", {}).get("format"))
        row.update({k: v for k, v in s.items() if k.startswith("eval")})
        if s["step"] in timings:
            row["gen_s"], row["train_s"] = timings[s["step"]]
        curve.append(row)
    return {
        "run_id": summary.get("run_id"),
        "as_shipped": _eval(ws, summary, "eval_warmup"),
        "after_rl": _eval(ws, summary, "eval_rl"),
        "steps": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = collect(Path(args.workspace), Path(args.log) if args.log else None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    a, b = result["as_shipped"], result["after_rl"]
    print(f"held-out as shipped {a['accuracy']:.3f} {a['by_level']}")
    print(f"after RL {b['accuracy']:.3f} {b['by_level']}")


if __name__ == "__main__":
    main()
