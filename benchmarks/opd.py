"""On-policy distillation against GRPO on the default task, from the same RFT checkpoint (issue 54).

Reads a finished default run's workspace (read-only): its RFT checkpoint is the student, its RL
checkpoint the teacher, its selected prompts and held-out set the data. Runs the RL stage's library
call (``training.rl.stage.rl``, the local driver, as the ``rl`` stage does) once per algorithm,
``grpo`` (the default objective), ``opd`` (``teacher.path`` = that RL checkpoint) and, when asked,
``opd_self`` (``teacher.path=self``: the privileged self-teacher), with the in-run
held-out evaluation every ``--eval-every`` updates, and reports the updates and the wall-clock
seconds (RL start to the end of that update, model loading and in-run evaluations included, the same
for both) until held-out accuracy first reaches ``--share`` (0.95) of the teacher's, and the curves.

    .venv/bin/python benchmarks/opd.py --base-ws /work/tmp-base-ws [--steps 40] [--eval-every 4] \\
        [--seed 0] [--threads 1] [--json-out F.json] [--plot F.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def base_run(ws: Path) -> dict:
    """The base workspace's latest run summary."""
    latest = max((ws / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    return json.loads((latest / "summary.json").read_text())


def run_rl(cfg, paths: dict[str, Path], out: Path) -> tuple[list[dict], list[float]]:
    """One RL run; (its per-step metrics, the seconds from its start to the end of each step)."""
    from evaluation.stages import in_run_evaluator
    from generation.model import load_tokenizer
    from generation.setup import setup_torch
    from rewards.compose import Reward
    from rewards.verdicts import open_verdict
    from tasks.stages.common import file_benchmarks, template
    from tasks.stages.evaluate import eval_templates, open_judges
    from training.rl.sections import RLSections
    from training.rl.stage import rl

    setup_torch(cfg.threads, cfg.seed)
    clock: list[float] = []
    start = time.perf_counter()
    with open_verdict(cfg.reward, cfg.eval.verifier_timeout_s, cfg.sandbox) as verifier, ExitStack() as stack:
        evaluate = in_run_evaluator(
            load_tokenizer(paths["rft"]),
            paths["dataset"],
            cfg.eval,
            templates=eval_templates(cfg),
            seed=cfg.seed,
            device="cpu",
            verifier=verifier,
            files=file_benchmarks(cfg),
            env=cfg.env,
            judges=open_judges(cfg, stack, verifier),
            sandbox=cfg.sandbox,
        )
        result = rl(
            paths["rft"],
            paths["selection"] / "prompts.parquet",
            RLSections.of(cfg),  # the config's teacher section included
            template=template(cfg),
            device="cpu",
            out_dir=out,
            reward=Reward.of(verifier, cfg.reward, None, template(cfg), sandbox=cfg.sandbox),
            history_path=paths["selection"] / "history.parquet",
            evaluate=evaluate,
            on_metrics=lambda m: clock.append(time.perf_counter() - start),
        )
    return [m.as_dict() for m in result.history], clock


def reach(
    history: list[dict], clock: list[float], key: str, target: float
) -> tuple[int | None, float | None]:
    """The first update whose in-run held-out accuracy is >= ``target``, and its seconds."""
    for i, m in enumerate(history):
        if key in m and m[key] >= target:
            return i + 1, round(clock[i], 1)
    return None, None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-ws", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--share", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--algorithms", nargs="+", default=["opd", "grpo"], help="opd, opd_self, grpo, ...")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)

    from conf.loader import load_config

    summary = base_run(args.base_ws)
    art = {k: v["artifacts"] for k, v in summary["stages"].items()}
    store = args.base_ws / "artifacts"
    teacher_acc = summary["metrics"]["heldout_accuracy_rl"]
    target = args.share * teacher_acc
    out: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "base_run": summary["run_id"],
        "seed": args.seed,
        "threads": args.threads,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "teacher": art["rl"]["model"],
        "teacher_heldout_accuracy": teacher_acc,
        "student_start_heldout_accuracy": summary["metrics"]["heldout_accuracy_rft"],
        "target": target,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="laminar-opd-bench-") as tmp:
        paths = {}
        for name, kind, sha in (
            ("rft", "model", art["rft"]["model"]),
            ("teacher", "model", art["rl"]["model"]),
            ("selection", "selection", art["select"]["selection"]),
            ("dataset", "dataset", art["data"]["dataset"]),
        ):
            paths[name] = Path(tmp) / name
            shutil.copytree(store / kind / sha, paths[name])  # the base workspace stays untouched
        for algo in args.algorithms:
            over = [f"seed={args.seed}", f"threads={args.threads}", f"rl.steps={args.steps}"]
            teacher_path = {"opd": str(paths["teacher"]), "opd_self": "self"}.get(algo)
            over += [f"rl.eval_every={args.eval_every}", f"rl.algorithm={algo.removesuffix('_self')}"]
            over += [f"teacher.path={teacher_path}"] if teacher_path else []
            cfg = load_config(over)
            history, clock = run_rl(cfg, paths, Path(tmp) / f"out_{algo}")
            key = next(k for k in history[args.eval_every - 1] if k.startswith("eval_") and "heldout" in k)
            updates, seconds = reach(history, clock, key, target)
            out["runs"][algo] = {
                "updates_to_target": updates,
                "seconds_to_target": seconds,
                "rl_seconds": round(clock[-1], 1),
                "curve": [(i + 1, m[key]) for i, m in enumerate(history) if key in m],
                "teacher_kl": [round(m["teacher_kl"], 4) for m in history if "teacher_kl" in m],
                "train_accuracy": [round(m["accuracy"], 4) for m in history],
            }
            print(algo, json.dumps({k: v for k, v in out["runs"][algo].items() if k != "train_accuracy"}))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, args.plot)
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, r in out["runs"].items():
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, marker="o", label=algo)
    ax.axhline(out["teacher_heldout_accuracy"], color="gray", ls="--", label="teacher")
    ax.axhline(out["target"], color="gray", ls=":", label="95% of teacher")
    ax.set_xlabel("updates")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"{' vs '.join(out['runs'])} from the RFT checkpoint, seed {out['seed']}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
