"""What curation buys on the default task, through the real pipeline (`laminar run`).

Two experiments, each a set of runs sharing one workspace (so data, warm-up and difficulty are
computed once per seed and reused from cache):

* ``dart``: DART Prop2Diff vs Uniform vs vanilla rejection sampling at the same trial budget. Prints
  each level's share of the RFT data and the RFT model's held-out accuracy per level (RL is
  skipped with ``rl.steps=0``).
* ``hive``: HIVE selection (learning-edge prompts from the difficulty history, then GRESO skips and
  prompt-entropy pruning online) vs uniform prompt sampling, both with DAPO's dynamic sampling
  (zero-variance groups are dropped and resampled until the batch is full). Prints held-out accuracy
  after RL and the rollouts each generated for the same number of updates.

    .venv/bin/python benchmarks/curation_quality.py dart [--seeds 0] [overrides...]
    .venv/bin/python benchmarks/curation_quality.py hive [--seeds 0 1 2] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from objectives import run  # (the same `laminar run` driver; benchmarks/ is the script's path)

ROOT = Path(__file__).resolve().parent.parent


def query(ws: Path, sql: str, params: list) -> list[tuple]:
    import duckdb

    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def dart(args) -> list[dict]:
    results = []
    for seed in args.seeds:
        for strategy in ("prop2diff", "uniform", "vanilla"):
            s = run(
                args.workspace,
                [f"seed={seed}", f"curation.dart.strategy={strategy}", "rl.steps=0", *args.overrides],
            )
            sha = s["stages"]["dart"]["artifacts"]["rft_data"]
            path = query(args.workspace, "SELECT path FROM artifacts WHERE sha256 = ?", [sha])[0][0]
            import polars as pl

            data = pl.read_parquet(Path(path) / "rft.parquet")
            shares = {
                int(r["level"]): r["len"] / max(1, data.height)
                for r in data.group_by("level").len().to_dicts()
                if r["level"] is not None
            }
            acc = s["stages"]["eval_rft"]["metrics"]["arith_heldout"]["by_level"]
            warm = s["stages"]["eval_warmup"]["metrics"]["arith_heldout"]["by_level"]
            results.append(
                {
                    "seed": seed,
                    "strategy": strategy,
                    "examples": data.height,
                    "trials": s["stages"]["dart"]["metrics"].get("trials"),
                    "shares": shares,
                    "acc_rft": {int(k): v for k, v in acc.items()},
                    "acc_warmup": {int(k): v for k, v in warm.items()},
                    "acc_rft_all": s["stages"]["eval_rft"]["metrics"]["arith_heldout"]["accuracy"],
                }
            )
            r = results[-1]
            print(
                f"seed {seed} {strategy:<9} examples {r['examples']:5d}  L5 share {shares.get(5, 0):.3f}  "
                f"RFT acc {r['acc_rft_all']:.3f}  L4+L5 {(r['acc_rft'][4] + r['acc_rft'][5]) / 2:.3f}",
                flush=True,
            )
    print(
        "\n| seed | strategy | trials | RFT examples | share L1..L5 | held-out acc L1..L5 (RFT model) "
        "| L4+L5 | all |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        sh = " / ".join(f"{r['shares'].get(lv, 0):.2f}" for lv in range(1, 6))
        ac = " / ".join(f"{r['acc_rft'].get(lv, 0):.2f}" for lv in range(1, 6))
        print(
            f"| {r['seed']} | {r['strategy']} | {r['trials']:.0f} | {r['examples']} | {sh} | {ac} | "
            f"{(r['acc_rft'][4] + r['acc_rft'][5]) / 2:.3f} | {r['acc_rft_all']:.3f} |"
        )
    return results


def hive(args) -> list[dict]:
    results = []
    for seed in args.seeds:
        for strategy in ("uniform", "hive"):
            s = run(
                args.workspace,
                [
                    f"seed={seed}",
                    "rl.algorithm=dapo",
                    f"curation.select.strategy={strategy}",
                    *args.overrides,
                ],
            )
            key = s["stages"]["rl"]["cache_key"]
            hist: dict[str, list[float]] = {}
            for name, value in query(
                args.workspace,
                "SELECT name, value FROM metrics WHERE cache_key = ? AND stage = 'rl' ORDER BY step",
                [key],
            ):
                hist.setdefault(name, []).append(value)
            results.append(
                {
                    "seed": seed,
                    "strategy": strategy,
                    "acc_start": s["metrics"].get("heldout_accuracy_rft"),
                    "acc_rl": s["metrics"]["heldout_accuracy_rl"],
                    "generated": sum(hist.get("generated_trajectories", [])),
                    "trained": sum(hist.get("trained_trajectories", [])),
                    "dropped_groups": sum(hist.get("dropped_groups", [])),
                    "selected": s["stages"]["select"]["metrics"]["selected"],
                    # samples of the RL starting model behind HIVE's history (stage difficulty_rft);
                    # uniform selection does not read them
                    "history_samples": s["stages"]["difficulty_rft"]["metrics"].get("samples", 0.0),
                    "rl_seconds": s["stages"]["rl"]["seconds"],
                }
            )
            r = results[-1]
            print(
                f"seed {seed} {strategy:<8} acc {r['acc_rl']:.3f}  generated {r['generated']:.0f}  "
                f"trained {r['trained']:.0f}  dropped groups {r['dropped_groups']:.0f}",
                flush=True,
            )
    print(
        "\n| seed | selection | prompts | held-out acc after RL | rollouts generated | trained "
        "| groups dropped | RL s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['seed']} | {r['strategy']} | {r['selected']:.0f} | {r['acc_rl']:.3f} | "
            f"{r['generated']:.0f} | {r['trained']:.0f} | {r['dropped_groups']:.0f} | {r['rl_seconds']:.0f} |"
        )

    def by(st: str, k: str) -> list:
        return [r[k] for r in results if r["strategy"] == st]

    gu, gh = sum(by("uniform", "generated")), sum(by("hive", "generated"))
    au, ah = by("uniform", "acc_rl"), by("hive", "acc_rl")

    def sd(xs: list) -> float:
        return statistics.stdev(xs) if len(xs) > 1 else float("nan")

    print(
        f"\nuniform acc {statistics.fmean(au):.3f} ± {sd(au):.3f}   "
        f"hive acc {statistics.fmean(ah):.3f} ± {sd(ah):.3f}"
        f"   rollouts uniform/hive = {gu / max(gh, 1):.2f}x"
    )
    hs = sum(by("hive", "history_samples"))
    print(
        f"HIVE's history also sampled the RL starting model {hs:.0f} times (difficulty_rft); counting those, "
        f"uniform/hive = {gu / max(gh + hs, 1):.2f}x"
    )
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("experiment", choices=["dart", "hive"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--workspace", type=Path, default=ROOT / "workspace-bench-curation")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    results = dart(args) if args.experiment == "dart" else hive(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
