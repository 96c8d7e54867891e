"""Collect one ``recipe=smollm2_arith`` run from its workspace: held-out accuracy per level of the model
as shipped (``eval_warmup``: no warm-up steps) and after RL (``eval_rl``), the in-run held-out curve, and
per RL step the reward, accuracy, format share, mean response length, truncation and (from the run's
log, which holds the timings ``history.jsonl`` leaves out) generation and training seconds.

    .venv/bin/python benchmarks/smollm2_rl.py --workspace WS --log run.log \\
        --out benchmarks/results/smollm2/x.json

``--summary OUT.md A.json B.json ...`` tabulates collected runs (one row pair per run, the mean gain)
and plots their per-step curves beside the ``.md`` (``.png``): training-batch accuracy with the
in-run held-out points, and mean response length.
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


def summary(out: Path, runs: list[Path]) -> None:
    """``out`` (markdown) and ``out.png`` for the collected ``runs`` (``collect``'s JSON files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        "| run | held-out | level 1 | level 2 | level 3 | mean length | truncated | most common answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    gains = []
    fig, (acc_ax, len_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for path in runs:
        d = json.loads(path.read_text())
        for key, label in (("as_shipped", "as shipped"), ("after_rl", "after RL")):
            e, top = d[key], d[f"answers_{key}"]["top_predictions"][0]
            lv = e["by_level"]
            rows.append(
                f"| {path.stem} {label} | {e['accuracy']:.3f} | {lv['1']:.3f} | {lv['2']:.3f} "
                f"| {lv['3']:.3f} | {e['mean_length']:.1f} | {e['truncation_rate']:.0%} "
                f"| {top[0] if top[0] is not None else 'none readable'} ({top[1]:.0%}) |"
            )
        gains.append(d["after_rl"]["accuracy"] - d["as_shipped"]["accuracy"])
        steps = [s["step"] for s in d["steps"]]
        line = acc_ax.plot(steps, [s["accuracy"] for s in d["steps"]], alpha=0.6, label=path.stem)[0]
        held = [(s["step"], v) for s in d["steps"] for k, v in s.items() if k.startswith("eval_")]
        held = [(0, d["as_shipped"]["accuracy"]), *held, (steps[-1], d["after_rl"]["accuracy"])]
        acc_ax.plot(*zip(*held), "o--", color=line.get_color())
        len_ax.plot(steps, [s["response_length"] for s in d["steps"]], color=line.get_color())
    acc_ax.set(xlabel="RL step", ylabel="accuracy", title="batch accuracy (line), held-out (dots)")
    len_ax.set(xlabel="RL step", ylabel="tokens", title="mean response length")
    acc_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=90)
    mean = sum(gains) / len(gains)
    rows.append("")
    rows.append(
        f"Mean held-out gain over {len(gains)} runs: {mean * 100:+.1f} points "
        f"({', '.join(f'{g * 100:+.1f}' for g in gains)})."
    )
    out.write_text("\n".join(rows) + "\n")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--summary":
        summary(Path(sys.argv[2]), [Path(x) for x in sys.argv[3:]])
        return
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
