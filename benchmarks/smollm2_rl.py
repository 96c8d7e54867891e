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
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEP = re.compile(r"step\s+(\d+)/\d+ \|.*?gen ([\d.]+)s \| train ([\d.]+)s")


def _run(ws: Path, run_id: str | None) -> dict:
    """The summary of ``run_id``, else of the latest finished run."""
    runs = sorted((ws / "runs").glob(f"{run_id or '*'}/summary.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"no finished run {run_id or ''} in {ws}")
    return json.loads(runs[-1].read_text())


def answer_prior(ws: Path, summary: dict, stage: str) -> dict:
    """What the answers concentrate on: the shares of the three most common predictions, and the
    held-out accuracy of the best constant answer (a policy that learnt only the answers' prior)."""
    import polars as pl

    rows = pl.read_parquet(_artifact(ws, summary, stage, "eval") / "rows.parquet")
    preds = Counter(rows["pred"].to_list())
    gold = Counter(pl.read_parquet(_artifact(ws, summary, "data", "dataset") / "heldout.parquet")["answer"])
    top = [(p, n / rows.height) for p, n in preds.most_common(3)]
    return {"top_predictions": top, "best_constant_accuracy": gold.most_common(1)[0][1] / sum(gold.values())}


def _artifact(ws: Path, summary: dict, stage: str, kind: str) -> Path:
    return ws / "artifacts" / kind / summary["stages"][stage]["artifacts"][kind]


def _eval(ws: Path, summary: dict, stage: str) -> dict:
    s = json.loads((_artifact(ws, summary, stage, "eval") / "summary.json").read_text())["arith_heldout"]
    keep = ("accuracy", "mean_length", "truncation_rate", "n_problems", "n_samples")
    return {**{k: s[k] for k in keep}, "by_level": {lv: v["avg@2"] for lv, v in s["by_level"].items()}}


def collect(ws: Path, log: Path | None, run_id: str | None = None) -> dict:
    summary = _run(ws, run_id)
    rl_dir = _artifact(ws, summary, "rl", "model")
    steps = [json.loads(line) for line in (rl_dir / "history.jsonl").read_text().splitlines() if line]
    timings = {}
    if log is not None and log.is_file():
        for m in STEP.finditer(log.read_text(errors="replace")):
            timings[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    curve = []
    for s in steps:
        row = {k: s.get(k) for k in ("step", "reward", "accuracy", "response_length", "truncated", "entropy")}
        row["format"] = s.get("reward/format")
        row.update({k: v for k, v in s.items() if k.startswith("eval")})
        if s["step"] in timings:
            row["gen_s"], row["train_s"] = timings[s["step"]]
        curve.append(row)
    return {
        "run_id": summary.get("run_id"),
        "as_shipped": _eval(ws, summary, "eval_warmup"),
        "after_rl": _eval(ws, summary, "eval_rl"),
        "answers_as_shipped": answer_prior(ws, summary, "eval_warmup"),
        "answers_after_rl": answer_prior(ws, summary, "eval_rl"),
        "steps": curve,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--run", default=None, help="run id (default: the latest finished run)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = collect(Path(args.workspace), Path(args.log) if args.log else None, args.run)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    a, b = result["as_shipped"], result["after_rl"]
    print(f"held-out as shipped {a['accuracy']:.3f} {a['by_level']}")
    print(f"after RL {b['accuracy']:.3f} {b['by_level']}")
    print(f"answers after RL {result['answers_after_rl']}")


if __name__ == "__main__":
    main()
