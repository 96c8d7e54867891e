"""ReLIFT against RL alone on the default task, from the same RFT checkpoint (issue 54, part 4).

Reads a finished default run's workspace (read-only, copied): its RFT checkpoint is the student, its
RL checkpoint the teacher that ReLIFT samples solutions from, its selected prompts, DART data and
held-out set the data. Per seed it runs the RL stage's library call (``training.rl.stage.rl``, the
local sync driver, as the ``rl`` stage does) twice with equal RL updates: ``rl`` (the default GRPO)
and ``relift`` (the same plus ``rl.relift.enabled=true``, its solutions from the teacher, or from
``--source``), evaluating the held-out set every ``--eval-every`` updates and after the last, and
reporting accuracy on all levels and on the hardest level (``--level``, default the highest), and the
RL wall-clock seconds (model loading, ReLIFT's teacher sampling and fine-tuning and the in-run
evaluations included, the same evaluations for both). The JSON (and a markdown table) are rewritten
after every run, so a cut run leaves its finished seeds.

    nice -n 5 .venv/bin/python benchmarks/relift.py --base-ws /work/tmp-base-ws --seeds 0 1 2 \\
        [--steps 60] [--eval-every 20] [--threads 1] [--json-out F.json] [--md-out F.md] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.opd import BASE_INPUTS, base_run, copy_inputs, rl_from_base  # noqa: E402


def level_evaluator(cfg, paths: dict[str, Path], verifier, level: str):
    """``model -> {"heldout": avg@n, "heldout_L<level>": avg@n on that level}`` on the held-out set,
    sampled as the eval stages sample it."""
    from evaluation.evaluate import evaluate_items, summarize_rows
    from evaluation.stages import benchmark_items
    from generation.model import load_tokenizer
    from tasks.stages.evaluate import eval_templates

    tokenizer = load_tokenizer(paths["rft"])
    items, _ = benchmark_items(cfg.eval, paths["dataset"], cfg.seed)
    items = [i for i in items if i.benchmark == "arith_heldout"]

    def evaluate(model) -> dict[str, float]:
        was = model.training
        model.eval()
        rows = evaluate_items(
            model,
            tokenizer,
            items,
            templates=eval_templates(cfg),
            n_samples=cfg.eval.n_samples,
            temperature=cfg.eval.temperature,
            max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=cfg.eval.batch_size,
            seed=cfg.seed,
            device="cpu",
            verifier=verifier,
        )
        model.train(was)
        s = summarize_rows(rows, cfg.eval.n_samples)["arith_heldout"]
        return {
            "heldout": s["accuracy"],
            f"heldout_L{level}": s["by_level"][level][f"avg@{cfg.eval.n_samples}"],
        }

    return evaluate


def run_rl(cfg, paths: dict[str, Path], out: Path, level: str) -> dict:
    """One RL run: its held-out curves, the final accuracies, its seconds and ReLIFT's counters."""
    from generation.model import load_model
    from generation.setup import setup_torch
    from rewards.verdicts import open_verdict

    setup_torch(cfg.threads, cfg.seed)
    clock: list[float] = []
    start = time.perf_counter()
    with open_verdict(cfg.reward, cfg.eval.verifier_timeout_s, cfg.sandbox) as verifier:
        evaluate = level_evaluator(cfg, paths, verifier, level)
        result = rl_from_base(
            cfg,
            paths,
            out,
            verifier,
            evaluate,
            on_metrics=lambda m: clock.append(time.perf_counter() - start),
            dart_data=paths["rft_data"] / "rft.parquet",
        )
        rl_seconds = clock[-1]
        model, _ = load_model(out, "cpu")
        final = evaluate(model)
    history = [m.as_dict() for m in result.history]
    curve = [(i + 1, m["heldout"], m[f"heldout_L{level}"]) for i, m in enumerate(history) if "heldout" in m]
    curve.append((len(history), final["heldout"], final[f"heldout_L{level}"]))
    return {
        "heldout": final["heldout"],
        f"heldout_L{level}": final[f"heldout_L{level}"],
        "rl_seconds": round(rl_seconds, 1),
        "curve": curve,
        "train_reward_last10": statistics.mean(m["reward"] for m in history[-10:]),
        "relift_collected": sum(m.get("relift/collected", 0.0) for m in history),
        "relift_sft_steps": sum(m.get("relift/steps", 0.0) for m in history),
        "relift_buffer_last": history[-1].get("relift/buffer"),
        "relift_sft_loss": [round(m["relift/sft_loss"], 4) for m in history if "relift/sft_loss" in m],
    }


def aggregate(out: dict, level: str) -> None:
    """Per arm: the mean and the per-seed values of the final accuracies and seconds."""
    agg = {}
    for arm in ("rl", "relift"):
        runs = [s[arm] for s in out["seeds"].values() if arm in s]
        if runs:
            agg[arm] = {
                k: {"mean": round(statistics.mean(r[k] for r in runs), 4), "values": [r[k] for r in runs]}
                for k in ("heldout", f"heldout_L{level}", "rl_seconds")
            }
    out["aggregate"] = agg


def write(out: dict, json_out: Path | None, md_out: Path | None, level: str) -> None:
    aggregate(out, level)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(out, indent=1))
    if md_out:
        md_out.parent.mkdir(parents=True, exist_ok=True)
        md_out.write_text(markdown(out, level))


def markdown(out: dict, level: str) -> str:
    lines = [
        f"# ReLIFT against RL alone ({out['date']}, {out['steps']} RL updates, base run {out['base_run']})",
        "",
        f"Student: the base run's RFT checkpoint (held-out {out['student_heldout']:.3f}); teacher: its RL "
        f"checkpoint (held-out {out['teacher_heldout']:.3f}). Hardest level: {level}. Settings: "
        f"`{' '.join(out['relift_overrides'])}`; threads {out['threads']}.",
        "",
        f"| seed | arm | held-out (all) | held-out L{level} | RL seconds | solutions collected | SFT steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for seed, arms in out["seeds"].items():
        for arm, r in arms.items():
            lines.append(
                f"| {seed} | {arm} | {r['heldout']:.3f} | {r[f'heldout_L{level}']:.3f} | "
                f"{r['rl_seconds']:.0f} | {r['relift_collected']:.0f} | {r['relift_sft_steps']:.0f} |"
            )
    for arm, a in out.get("aggregate", {}).items():
        lines.append(
            f"| mean | {arm} | {a['heldout']['mean']:.3f} | {a[f'heldout_L{level}']['mean']:.3f} | "
            f"{a['rl_seconds']['mean']:.0f} | | |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-ws", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--level", default="5")
    ap.add_argument("--source", default="teacher", help="rl.relift.source")
    ap.add_argument("--set", nargs="*", default=[], help="more rl.relift overrides for the relift arm")
    ap.add_argument("--arms", nargs="+", default=["rl", "relift"])
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--md-out", type=Path)
    args = ap.parse_args(argv)

    from conf.loader import load_config

    with tempfile.TemporaryDirectory(prefix="laminar-relift-bench-") as tmp:
        summary = base_run(args.base_ws)
        paths = copy_inputs(args.base_ws, summary, Path(tmp), (*BASE_INPUTS,))
        relift = ["rl.relift.enabled=true", f"rl.relift.source={args.source}", *args.set]
        relift += [f"teacher.path={paths['teacher']}"] if args.source != "dart" else []
        out: dict = {
            "date": time.strftime("%Y-%m-%d"),
            "base_run": summary["run_id"],
            "threads": args.threads,
            "steps": args.steps,
            "eval_every": args.eval_every,
            "level": args.level,
            "teacher": summary["stages"]["rl"]["artifacts"]["model"],
            "teacher_heldout": summary["metrics"]["heldout_accuracy_rl"],
            "student_heldout": summary["metrics"]["heldout_accuracy_rft"],
            "relift_overrides": [o for o in relift if not o.startswith("teacher.path")],
            "seeds": {},
        }
        for seed in args.seeds:
            for arm in args.arms:
                over = [f"seed={seed}", f"threads={args.threads}", f"rl.steps={args.steps}"]
                over += [f"rl.eval_every={args.eval_every}", "rl.runtime=local"]
                over += relift if arm == "relift" else []
                cfg = load_config(over)
                r = run_rl(cfg, paths, Path(tmp) / f"out_{arm}_{seed}", args.level)
                out["seeds"].setdefault(str(seed), {})[arm] = r
                print(seed, arm, json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
                write(out, args.json_out, args.md_out, args.level)
    return out


if __name__ == "__main__":
    main()
