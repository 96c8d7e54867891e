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
        [--seed 0] [--threads 1] [--algorithms opd grpo opd_self] [--set KEY=VALUE ...] [--label NAME] \\
        [--json-out F.json] [--plot F.png]

The JSON is rewritten after each algorithm, so a run cut short keeps the finished ones. ``--set``
adds config overrides to every algorithm's run (e.g. ``teacher.reward_weight=1``) and ``--label``
names the runs in the JSON (``opd_self`` -> ``opd_self+LABEL``).

``--aggregate F.json ...`` reads such files (several seeds, a seed's algorithms possibly in several
files) and writes the multi-seed summary (``--json-out``, ``--md-out``, ``--plot``): per algorithm
each seed's and the mean updates and seconds to the target, seconds per update, the held-out
accuracy at each evaluation (mean, min, max over seeds) and every algorithm against ``grpo`` at equal
updates; the plot shows each algorithm's mean curve with its min-max band over the seeds.
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


BASE_INPUTS = {  # name -> (the base run's stage, its artifact kind)
    "rft": ("rft", "model"),  # the student
    "teacher": ("rl", "model"),
    "selection": ("select", "selection"),
    "dataset": ("data", "dataset"),
    "rft_data": ("dart", "rft_data"),
}


def copy_inputs(ws: Path, summary: dict, tmp: Path, names=("rft", "teacher", "selection", "dataset")):
    """Copies of the ``names`` artifacts of the base run (``summary``, ``base_run(ws)``) under ``tmp``,
    by name: the base workspace stays untouched."""
    paths = {}
    for name in names:
        stage, kind = BASE_INPUTS[name]
        paths[name] = tmp / name
        shutil.copytree(ws / "artifacts" / kind / summary["stages"][stage]["artifacts"][kind], paths[name])
    return paths


def run_rl(cfg, paths: dict[str, Path], out: Path) -> tuple[list[dict], list[float], list[float]]:
    """One RL run; (its per-step metrics, the wall-clock seconds from its start to the end of each
    step, this process's CPU seconds over the same spans: on a shared machine the load moves the
    first, much less the second)."""
    from evaluation.stages import in_run_evaluator
    from generation.model import load_tokenizer
    from generation.setup import setup_torch
    from rewards.verdicts import open_verdict
    from tasks.stages.common import file_benchmarks
    from tasks.stages.evaluate import eval_templates, open_judges

    setup_torch(cfg.threads, cfg.seed)
    clock: list[float] = []
    cpu: list[float] = []
    start, cpu0 = time.perf_counter(), time.process_time()
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
        result = rl_from_base(
            cfg,
            paths,
            out,
            verifier,
            evaluate,
            on_metrics=lambda m: (
                clock.append(time.perf_counter() - start),
                cpu.append(time.process_time() - cpu0),
            ),
        )
    return [m.as_dict() for m in result.history], clock, cpu


def rl_from_base(cfg, paths: dict[str, Path], out: Path, verifier, evaluate, on_metrics, **extra):
    """``training.rl.stage.rl`` in process from the base run's inputs (``copy_inputs``): its RFT
    checkpoint on its selected prompts and HIVE history, rewarded by ``cfg.reward`` through
    ``verifier`` (``RLSections.of(cfg)``: the config's teacher section included); ``extra``: more of
    ``rl``'s keywords."""
    from rewards.compose import Reward
    from tasks.stages.common import template
    from training.rl.sections import RLSections
    from training.rl.stage import rl

    return rl(
        paths["rft"],
        paths["selection"] / "prompts.parquet",
        RLSections.of(cfg),
        template=template(cfg),
        device="cpu",
        out_dir=out,
        reward=Reward.of(verifier, cfg.reward, None, template(cfg), sandbox=cfg.sandbox),
        history_path=paths["selection"] / "history.parquet",
        evaluate=evaluate,
        on_metrics=on_metrics,
        **extra,
    )


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
    ap.add_argument("--base-ws", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--share", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--algorithms", nargs="+", default=["opd", "grpo"], help="opd, opd_self, grpo, ...")
    ap.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE", help="config overrides for every run"
    )
    ap.add_argument("--label", default="", help="runs are named ALGO+LABEL")
    ap.add_argument("--aggregate", nargs="+", type=Path, metavar="F.json", help="summarise these results")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--md-out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    if args.aggregate:
        return write_aggregate(args)
    if args.base_ws is None:
        ap.error("--base-ws is required (or --aggregate)")
    return measure(args)


def measure(args) -> dict:
    """Each of ``args.algorithms`` from the base workspace's RFT checkpoint; the JSON after each."""
    from conf.loader import load_config

    summary = base_run(args.base_ws)
    art = {k: v["artifacts"] for k, v in summary["stages"].items()}
    teacher_acc = summary["metrics"]["heldout_accuracy_rl"]
    target = args.share * teacher_acc
    out: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "base_run": summary["run_id"],
        "seed": args.seed,
        "threads": args.threads,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "overrides": args.set,
        "teacher": art["rl"]["model"],
        "teacher_heldout_accuracy": teacher_acc,
        "student_start_heldout_accuracy": summary["metrics"]["heldout_accuracy_rft"],
        "target": target,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="laminar-opd-bench-") as tmp:
        paths = copy_inputs(args.base_ws, summary, Path(tmp))
        for algo in args.algorithms:
            over = [f"seed={args.seed}", f"threads={args.threads}", f"rl.steps={args.steps}"]
            teacher_path = {"opd": str(paths["teacher"]), "opd_self": "self"}.get(algo)
            over += [f"rl.eval_every={args.eval_every}", f"rl.algorithm={algo.removesuffix('_self')}"]
            over += [f"teacher.path={teacher_path}"] if teacher_path else []
            cfg = load_config(over + list(args.set))
            history, clock, cpu = run_rl(cfg, paths, Path(tmp) / f"out_{algo}")
            key = next(k for k in history[args.eval_every - 1] if k.startswith("eval_") and "heldout" in k)
            updates, seconds = reach(history, clock, key, target)
            name = f"{algo}+{args.label}" if args.label else algo
            out["runs"][name] = {
                "updates_to_target": updates,
                "seconds_to_target": seconds,
                "rl_seconds": round(clock[-1], 1),
                "cpu_seconds_to_target": reach(history, cpu, key, target)[1],
                "rl_cpu_seconds": round(cpu[-1], 1),
                "curve": [(i + 1, m[key]) for i, m in enumerate(history) if key in m],
                "teacher_kl": [round(m["teacher_kl"], 4) for m in history if "teacher_kl" in m],
                "train_accuracy": [round(m["accuracy"], 4) for m in history],
            }
            print(name, json.dumps({k: v for k, v in out["runs"][name].items() if k != "train_accuracy"}))
            if args.json_out:  # after each algorithm: a run cut short keeps the finished ones
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                args.json_out.write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, args.plot)
    return out


# ---------------------------------------------------------------------------------------- several seeds
def merge_seeds(files: list[Path]) -> tuple[dict, dict[int, dict]]:
    """The files' shared setting (teacher, target, steps, evaluation interval) and each seed's runs
    (a seed's algorithms may come from several files). Files of different settings fail."""
    shared_keys = ("base_run", "teacher", "teacher_heldout_accuracy", "target", "steps", "eval_every")
    shared: dict = {}
    seeds: dict[int, dict] = {}
    for f in files:
        d = json.loads(Path(f).read_text())
        for k in shared_keys:
            if shared.setdefault(k, d[k]) != d[k]:
                raise SystemExit(f"{f}: {k}={d[k]!r}, other files have {shared[k]!r}: not one setting")
        shared.setdefault("student_start_heldout_accuracy", d["student_start_heldout_accuracy"])
        for algo, run in d["runs"].items():
            if algo in seeds.setdefault(d["seed"], {}):
                raise SystemExit(f"{f}: seed {d['seed']} {algo} is in two files")
            seeds[d["seed"]][algo] = run
    return shared, seeds


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


def aggregate(files: list[Path]) -> dict:
    """The multi-seed summary of ``files`` (``benchmarks/opd.py`` results)."""
    shared, seeds = merge_seeds(files)
    algos = sorted({a for runs in seeds.values() for a in runs}, key=lambda a: (a != "grpo", a))
    out: dict = {"date": time.strftime("%Y-%m-%d"), "files": [str(f) for f in files], **shared}
    out["seeds"] = sorted(seeds)
    out["algorithms"] = {}
    for algo in algos:
        have = {s: runs[algo] for s, runs in sorted(seeds.items()) if algo in runs}
        by_update: dict[int, list[float]] = {}
        for run in have.values():
            for u, acc in run["curve"]:
                by_update.setdefault(u, []).append(acc)
        updates = [r["updates_to_target"] for r in have.values()]
        out["algorithms"][algo] = {
            "seeds": list(have),
            "updates_to_target": updates,
            "seconds_to_target": [r["seconds_to_target"] for r in have.values()],
            "reached": sum(u is not None for u in updates),
            "mean_updates_to_target": _mean(updates),
            "mean_seconds_to_target": _mean([r["seconds_to_target"] for r in have.values()]),
            "seconds_per_update": [round(r["rl_seconds"] / shared["steps"], 3) for r in have.values()],
            # this process's CPU seconds (recorded since 2026-12-06 16:40; None in older files)
            "cpu_seconds_to_target": [r.get("cpu_seconds_to_target") for r in have.values()],
            "cpu_seconds_per_update": [
                round(r["rl_cpu_seconds"] / shared["steps"], 3) if "rl_cpu_seconds" in r else None
                for r in have.values()
            ],
            "curve": [
                {"updates": u, "mean": _mean(v), "min": min(v), "max": max(v), "n": len(v)}
                for u, v in sorted(by_update.items())
            ],
        }
        kls = [r["teacher_kl"] for r in have.values() if r["teacher_kl"]]
        if kls:
            out["algorithms"][algo]["teacher_kl_first_last"] = [
                _mean([k[0] for k in kls]),
                _mean([k[-1] for k in kls]),
            ]
    out["vs_grpo"] = {a: vs_grpo(seeds, a) for a in algos if a != "grpo" and "grpo" in algos}
    return out


def vs_grpo(seeds: dict[int, dict], algo: str) -> list[dict]:
    """``algo`` against ``grpo`` at equal updates, over the seeds that ran both: at each evaluation
    the mean held-out accuracy of each and the mean of the per-seed differences."""
    both = [runs for runs in seeds.values() if algo in runs and "grpo" in runs]
    rows = []
    for u, _ in both[0]["grpo"]["curve"] if both else []:
        a = [dict(map(tuple, r[algo]["curve"])).get(u) for r in both]
        g = [dict(map(tuple, r["grpo"]["curve"])).get(u) for r in both]
        pairs = [(x, y) for x, y in zip(a, g) if x is not None and y is not None]
        if pairs:
            rows.append(
                {
                    "updates": u,
                    algo: _mean([x for x, _ in pairs]),
                    "grpo": _mean([y for _, y in pairs]),
                    "diff": _mean([x - y for x, y in pairs]),
                    "diff_min": round(min(x - y for x, y in pairs), 4),
                    "diff_max": round(max(x - y for x, y in pairs), 4),
                    "n": len(pairs),
                }
            )
    return rows


def markdown(agg: dict) -> str:
    """The summary as a Markdown page."""
    lines = [
        f"# On-policy distillation vs GRPO, seeds {', '.join(map(str, agg['seeds']))} ({agg['date']})",
        "",
        f"From the RFT checkpoint of run `{agg['base_run']}`"
        f" (held-out {agg['student_start_heldout_accuracy']:.3f});"
        f" teacher: its RL checkpoint (held-out {agg['teacher_heldout_accuracy']:.3f}); target 95% of it ="
        f" {agg['target']:.3f}; {agg['steps']} updates, held-out evaluation every {agg['eval_every']}."
        " Seconds: RL start to the end of the update, model loading and in-run evaluations included"
        " (2 shared cores, other jobs running: noisy).",
        "",
        "| algorithm | updates to target (per seed) | mean | seconds to target (per seed) | mean |"
        " s/update (per seed) |",
        "|---|---|---|---|---|---|",
    ]
    for algo, a in agg["algorithms"].items():
        ups = " / ".join("-" if u is None else str(u) for u in a["updates_to_target"])
        secs = " / ".join("-" if s is None else f"{s:g}" for s in a["seconds_to_target"])
        mu = a["mean_updates_to_target"]
        mean_u = f"{'-' if mu is None else f'{mu:.1f}'} ({a['reached']}/{len(a['seeds'])} reached)"
        mean_s = "-" if a["mean_seconds_to_target"] is None else f"{a['mean_seconds_to_target']:.1f}"
        spu = " / ".join(f"{x:.2f}" for x in a["seconds_per_update"])
        lines.append(f"| `{algo}` | {ups} | {mean_u} | {secs} | {mean_s} | {spu} |")
    lines += ["", "Mean over seeds ('-': not reached in the run; means over the seeds that reached).", ""]
    evals = [c["updates"] for c in next(iter(agg["algorithms"].values()))["curve"]]
    lines += ["Held-out accuracy, mean [min, max] over seeds:", ""]
    lines += ["| updates | " + " | ".join(f"`{a}`" for a in agg["algorithms"]) + " |"]
    lines += ["|---" * (len(agg["algorithms"]) + 1) + "|"]
    for u in evals:
        cells = []
        for a in agg["algorithms"].values():
            c = next((c for c in a["curve"] if c["updates"] == u), None)
            cells.append("-" if c is None else f"{c['mean']:.3f} [{c['min']:.3f}, {c['max']:.3f}]")
        lines.append(f"| {u} | " + " | ".join(cells) + " |")
    for algo, rows in agg["vs_grpo"].items():
        lines += [
            "",
            f"`{algo}` minus `grpo` at equal updates (mean of per-seed differences [min, max]):",
            "",
        ]
        lines += ["| updates | " + " | ".join(f"{r['updates']}" for r in rows) + " |"]
        lines += ["|---" * (len(rows) + 1) + "|"]
        lines += [
            "| diff | "
            + " | ".join(f"{r['diff']:+.3f} [{r['diff_min']:+.3f}, {r['diff_max']:+.3f}]" for r in rows)
            + " |"
        ]
    return "\n".join(lines) + "\n"


def write_aggregate(args) -> dict:
    agg = aggregate(args.aggregate)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(agg, indent=1))
    if args.md_out:
        args.md_out.parent.mkdir(parents=True, exist_ok=True)
        args.md_out.write_text(markdown(agg))
    if args.plot:
        plot_seeds(agg, args.plot)
    print(markdown(agg))
    return agg


def plot_seeds(agg: dict, path: Path) -> None:
    """Each algorithm's mean held-out curve over the seeds with its min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo, a in agg["algorithms"].items():
        xs = [c["updates"] for c in a["curve"]]
        (line,) = ax.plot(
            xs, [c["mean"] for c in a["curve"]], marker="o", label=f"{algo} (mean of {len(a['seeds'])})"
        )
        ax.fill_between(
            xs,
            [c["min"] for c in a["curve"]],
            [c["max"] for c in a["curve"]],
            color=line.get_color(),
            alpha=0.2,
        )
    ax.axhline(agg["teacher_heldout_accuracy"], color="gray", ls="--", label="teacher")
    ax.axhline(agg["target"], color="gray", ls=":", label="95% of teacher")
    ax.set_xlabel("updates")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"from the RFT checkpoint, seeds {', '.join(map(str, agg['seeds']))}: mean, min-max band")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


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
