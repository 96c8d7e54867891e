"""Trained tokens/s of the four RL modes on one long-tailed workload, side by side, equal resources.

The workload: the arithmetic task with a mix of short problems (2-4 operations) and, one prompt in
ten, 30-operation chains, so response lengths are long-tailed (the script prints the measured p50
and p99 of the trained responses; the target is p99 >= 5x p50). A warm-up model is trained once
through the pipeline (`laminar run --until warmup`, cached in the benchmark workspace); then every
mode runs the same number of updates from it on the Ray runtime with the same rollouts, capacity
and CPUs. Reports trained tokens/s per mode and the ratio to sync, staleness, repacks and publish
stall, and writes each mode's timeline plot (``--out``).

    .venv/bin/python benchmarks/rl_throughput.py [--updates 12] [--rollouts 2]
        [--modes sync laminar laminar@3 laminar:1x128] [--repeats 3] [--small-model] [--unbounded]
        [--chunk-steps 16] [overrides, e.g. rollout.static_cache=true]

The rollouts run with the config's engine (``rollout.*``) and CPU priority (``cluster.rollout_priority``).
A mode spec ``mode[@N][:RxC]`` runs ``mode`` with ``rl.admit_lag=N`` and/or R rollouts of capacity C
instead of ``--rollouts`` x ``--capacity`` (e.g. ``laminar:1x128``: the same 128 sequences in flight on
one rollout), so the shapes a mode runs best in can be compared on the same CPUs.

Where the pipeline cannot run (the lent GPU machine has no Prefect), ``--warm-start DIR`` builds the
warm-up without it: the same synthetic pool, base model and warm-up SFT (``training.sft.train_sft``
with the ``sft.*`` settings, on ``--warm-device``), cached in DIR. ``--device cuda`` runs the
rollouts and the trainer on the GPU (give them ``cluster.rollout_gpus``/``cluster.trainer_gpus``
fractions to share one); ``--time-budget`` starts no run that would end past it, and ``--json-out``
is rewritten after every run, so a stopped benchmark still leaves its finished runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from training.rl.sections import RLSections

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOAD = [
    "data.levels=[2,3,4,2,3,4,2,3,4,8]",
    "data.pool_size=1500",
    "data.heldout_size=50",
    "sft.levels=[2,3,4,8]",
    "model.max_seq_len=448",
    "rl.max_new_tokens=320",
    "eval.max_new_tokens=320",
]


# --small-model: a cheaper model whose decode step stays flatter in the batch on this CPU, nearer the
# regime of GPU decoding (memory-bound up to large batches) that Laminar targets
SMALL_MODEL = [
    "model.hidden_size=64",
    "model.intermediate_size=192",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
]


def warmup(ws: Path, seed: int) -> tuple[Path, Path]:
    from benchmarks.objectives import run

    summary = run(ws, [f"seed={seed}", *WORKLOAD, "--until", "warmup"])
    stages = summary["stages"]
    model = ws / "artifacts" / "model" / stages["warmup"]["artifacts"]["model"]
    data = ws / "artifacts" / "dataset" / stages["data"]["artifacts"]["dataset"]
    return model, data


def warm_start(ws: Path, args) -> tuple[Path, list]:
    """(model dir, prompts) of a warm-up built without the pipeline, cached in ``ws``: the synthetic
    pool of ``data.*``, the tiny base model of ``model.*`` and warm-up SFT on the pool's
    demonstrations of ``sft.levels`` with the ``sft.*`` settings (what the pipeline's data, base_model
    and warmup stages compute), on ``args.warm_device``."""
    import dataclasses as dc
    import hashlib

    from conf.loader import load_config
    from data_curation.synthetic import PROMPT_TEMPLATE, generate
    from generation.model import (
        build_char_tokenizer,
        build_tiny_model,
        encode_problem,
        encode_response,
        load_tokenizer,
        save_model,
    )
    from generation.records import PromptItem
    from training.sft import SFTExample, train_sft
    from training.warmup import target, tool_demonstrations

    cfg = load_config([f"seed={args.seed}", *WORKLOAD, *args.overrides])
    key = hashlib.sha256(
        json.dumps(
            [cfg.data.model_dump(), cfg.model.model_dump(), cfg.sft.model_dump(), cfg.seed]
            + ([] if cfg.env.is_default() else [cfg.env.target, cfg.env.demo_tool_share]),
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()[:12]
    model_dir, prompts_path = ws / key / "model", ws / key / "prompts.jsonl"
    if not (model_dir / "config.json").is_file() or not prompts_path.is_file():
        t0 = time.perf_counter()
        pool, _ = generate(
            cfg.seed,
            cfg.data.pool_size,
            cfg.data.heldout_size,
            list(cfg.data.levels),
            cfg.data.demo_error_rate,
        )
        tok = build_char_tokenizer()
        model = build_tiny_model(cfg.model, tok, cfg.seed)
        levels = set(cfg.sft.levels)
        demo = [p for p in pool if p.level in levels]
        examples = [
            SFTExample(
                encode_problem(tok, PROMPT_TEMPLATE, p.problem), encode_response(tok, target(dc.asdict(p)))
            )
            for p in demo
        ]
        if not cfg.env.is_default():  # the environment's tool demonstrations, as the warmup stage
            examples = tool_demonstrations(examples, [dc.asdict(p) for p in demo], cfg.env, tok)
        metrics = train_sft(
            model,
            examples,
            steps=cfg.sft.steps,
            batch_size=cfg.sft.batch_size,
            lr=cfg.sft.lr,
            warmup_steps=cfg.sft.warmup_steps,
            weight_decay=cfg.sft.weight_decay,
            max_grad_norm=cfg.sft.max_grad_norm,
            pad_id=tok.pad_token_id,
            seed=cfg.seed,
            device=args.warm_device,
            stage="warmup",
        )
        model_dir.mkdir(parents=True, exist_ok=True)
        save_model(model.to("cpu"), tok, model_dir)
        prompts_path.write_text(
            "".join(
                json.dumps(
                    {"prompt_id": p.prompt_id, "problem": p.problem, "answer": p.answer, "level": p.level}
                )
                + "\n"
                for p in pool
            )
        )
        print(
            f"warm start {key}: {cfg.sft.steps} SFT steps on {args.warm_device} in "
            f"{time.perf_counter() - t0:.1f} s, {metrics}",
            flush=True,
        )
    tok = load_tokenizer(model_dir)
    rows = [json.loads(line) for line in prompts_path.read_text().splitlines()]
    return model_dir, [
        PromptItem(
            r["prompt_id"],
            r["problem"],
            r["answer"],
            encode_problem(tok, PROMPT_TEMPLATE, r["problem"]),
            r["level"],
        )
        for r in rows
    ]


def percentile(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))]) if xs else float("nan")


def run_mode(spec: str, model_dir: Path, prompts, args, out: Path, tag: str = "") -> dict:
    """One run of ``spec``: ``mode[@N][:RxC]`` (``rl.admit_lag=N``; R rollouts of capacity C)."""
    from conf.loader import load_config
    from evaluation.timeline import plot_timeline, summarize_timeline
    from rewards.verifier import Verifier
    from training.rl.drivers.ray import LaminarRuntime
    from training.rl.stage import objective_params

    cfg = load_config([f"seed={args.seed}", *WORKLOAD, f"rl.algorithm={args.algorithm}", *args.overrides])
    head, _, shape = spec.partition(":")
    mode, _, lag = head.partition("@")
    rollouts, capacity = (int(x) for x in shape.split("x")) if shape else (args.rollouts, args.capacity)
    # the pipeline's config sections (cluster, trainer, rollout engine, priority), then this run's shape
    rl = cfg.rl.model_copy(
        update=dict(
            mode=mode,
            steps=args.updates,
            prompts_per_step=args.prompts_per_step,
            group_size=args.group_size,
            rollout_capacity=capacity,
            chunk_steps=args.chunk_steps,
            max_staleness=None if mode != "sync" and args.unbounded else cfg.rl.max_staleness,
            admit_lag=int(lag) if lag else cfg.rl.admit_lag,
            repack_interval_s=args.repack_interval or cfg.rl.repack_interval_s,
        )
    )
    cluster = cfg.cluster.model_copy(update=dict(rollouts=rollouts, num_cpus=args.cpus))
    with Verifier(timeout_s=cfg.eval.verifier_timeout_s) as verifier:
        rt = LaminarRuntime(
            model_dir,
            prompts,
            verifier,
            objective_params(rl),
            RLSections(
                rl, seed=args.seed, rollout=cfg.rollout, trainer=cfg.trainer, cluster=cluster, env=cfg.env
            ),
            device=args.device,
        )
        t0 = time.perf_counter()
        rt.run()
        total = time.perf_counter() - t0
    s = rt.summary
    tl = summarize_timeline(rt.timeline)
    occ = [r["mean_occupancy"] for r in tl["rollouts"].values()]
    name = spec.replace("@", "_lag").replace(":", "_")
    plot_timeline(
        rt.timeline, out / f"timeline_{name}{tag}.png", title=f"rl.mode={spec}: one row per rollout"
    )
    (out / f"timeline_{name}{tag}.json").write_text(json.dumps(rt.timeline))
    stalls = s["publish_stall_s"]
    steps = [m.as_dict() for m in rt.result.history]
    episode = {  # an environment's per-step episode metrics (turns, tool calls, agent faults), meaned
        k: statistics.fmean(h[k] for h in steps if k in h)
        for k in sorted({k for h in steps for k in h if k.startswith("episode/")})
    }
    return {
        "mode": spec,
        "rollouts": rollouts,
        "capacity": capacity,
        "tokens_per_s": s["tokens_per_s"],
        "wall_s": s["wall_seconds"],
        "with_startup_s": total,
        "trained_tokens": s["trained_tokens"],
        "updates": s["updates"],
        "p50_len": percentile(s["response_lengths"], 0.5),
        "p99_len": percentile(s["response_lengths"], 0.99),
        "staleness": s["staleness_histogram"],
        "repacks": s.get("repacks", 0),
        "pulls": s.get("pulls", 0),
        "interrupts": s.get("interrupts", 0),
        "occupancy": statistics.fmean(occ) if occ else float("nan"),
        "publish_stall_ms": 1000 * statistics.median(stalls) if stalls else float("nan"),
        "publish_cpu_ms": 1000 * statistics.median(s["publish_cpu_s"])
        if s["publish_cpu_s"]
        else float("nan"),
        # where the CPU went over the loop (per role) and how busy the machine was
        "cpu_s": s.get("cpu_seconds", {}),
        "machine_busy": s.get("machine_busy", float("nan")),
        "device": args.device,
        "episode": episode,
        **role_columns(s.get("cpu_seconds", {}), s["wall_seconds"]),
    }


ROLES = ("trainer", "rollout", "relay", "driver")


def role_columns(cpu: dict[str, float], wall_s: float) -> dict[str, float]:
    """Per role: CPU seconds over the loop (``cpu_<role>_s``) and the cores it kept busy on average
    (``cores_<role>``: CPU seconds / wall seconds): a role near its thread count is CPU-bound."""
    out = {}
    for role in ROLES:
        sec = sum(v for k, v in cpu.items() if k.startswith(role))
        out[f"cpu_{role}_s"] = sec
        out[f"cores_{role}"] = sec / wall_s if wall_s else float("nan")
    return out


def cpu_split(cpu: dict[str, float]) -> str:
    """Trainer ranks / rollouts / driver CPU seconds over the loop, from ``summary["cpu_seconds"]``."""
    part = {p: sum(v for k, v in cpu.items() if k.startswith(p)) for p in ("trainer", "rollout", "driver")}
    return f"{part['trainer']:.1f} / {part['rollout']:.1f} / {part['driver']:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["sync", "one_step", "partial", "laminar"],
        help="modes to compare: mode[@N][:RxC], e.g. laminar@3 (rl.admit_lag=3), laminar:1x128 "
        "(1 rollout of capacity 128)",
    )
    ap.add_argument("--updates", type=int, default=12)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument(
        "--unbounded",
        action="store_true",
        help="asynchronous modes without a staleness bound (as the Laminar paper); default rl.max_staleness",
    )
    ap.add_argument(
        "--repack-interval", type=float, default=None, help="seconds (default rl.repack_interval_s)"
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="rounds of every mode (this machine's speed drifts)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workspace", type=Path, default=ROOT / "workspace-bench-throughput")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument(
        "--stall-rollouts",
        type=int,
        nargs="*",
        default=[],
        help="also run laminar with each of these rollout counts and compare the publish stall",
    )
    ap.add_argument(
        "overrides", nargs="*", help="config overrides for the runs (e.g. rollout.static_cache=true)"
    )
    ap.add_argument("--device", default="cpu", help="rollouts' and trainer's device (cpu | cuda)")
    ap.add_argument(
        "--warm-start",
        type=Path,
        default=None,
        help="build the warm-up without the pipeline (no Prefect), cached in this folder",
    )
    ap.add_argument("--warm-device", default="cpu", help="device of --warm-start's SFT")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: start no run that would end past it (estimated from the longest run so far)",
    )
    ap.add_argument(
        "--run-estimate",
        type=float,
        default=0.0,
        help="seconds a run is assumed to take before one has been timed (with --time-budget)",
    )
    ap.add_argument(
        "--small-model",
        action="store_true",
        help="the smaller model (hidden 64, 2 layers): decode cost flat in the batch, as on a GPU",
    )
    args = ap.parse_args()
    if args.small_model:
        WORKLOAD.extend(SMALL_MODEL)
    out = args.out or args.workspace / "throughput"
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if args.warm_start:
        model_dir, prompts = warm_start(args.warm_start, args)
    else:
        model_dir, data_dir = warmup(args.workspace, args.seed)
        from data_curation.synthetic import PROMPT_TEMPLATE
        from generation.model import encode_problem, load_tokenizer
        from generation.records import PromptItem
        from generation.setup import read_table

        tok = load_tokenizer(model_dir)
        rows = read_table(data_dir / "pool.parquet")
        prompts = [
            PromptItem(
                r["prompt_id"],
                r["problem"],
                r["answer"],
                encode_problem(tok, PROMPT_TEMPLATE, r["problem"]),
                r["level"],
            )
            for r in rows
        ]
    modes = args.modes if args.modes != ["none"] else []
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    skipped: list[str] = []
    longest, runs_done = args.run_estimate, 0
    for rnd in range(args.repeats if modes else 0):
        # rounds rotate the order so a drift in the machine's speed does not favour one mode
        for mode in modes[rnd % len(modes) :] + modes[: rnd % len(modes)]:
            spent = time.perf_counter() - t_start
            if args.time_budget is not None and spent + longest > args.time_budget:
                skipped.append(f"round {rnd + 1} {mode}")
                print(
                    f"round {rnd + 1}/{args.repeats}: {mode} skipped (time budget: {spent:.0f} s spent, "
                    f"runs take up to {longest:.0f} s, budget {args.time_budget:.0f} s)",
                    flush=True,
                )
                continue
            print(f"round {rnd + 1}/{args.repeats}: running {mode} ...", flush=True)
            t_run = time.perf_counter()
            runs[mode].append(
                {
                    **run_mode(mode, model_dir, prompts, args, out, tag="" if rnd == 0 else f"_r{rnd + 1}"),
                    "round": rnd + 1,
                }
            )
            longest = max(longest if runs_done else 0.0, time.perf_counter() - t_run)
            runs_done += 1
            print(json.dumps(runs[mode][-1]), flush=True)
            if args.json_out:  # after every run: a benchmark stopped later keeps what it finished
                write_json(args, summarize(runs), [], skipped, partial=True)
    results = summarize(runs)
    base_mode = "sync" if runs.get("sync") else (modes[0] if modes else None)
    base = next((r for r in results if r["mode"] == base_mode), None)
    print(
        f"\n{args.rollouts} rollouts x capacity {args.capacity}, {args.updates} updates of "
        f"{args.prompts_per_step}x{args.group_size}, {args.cpus} CPUs, chunk {args.chunk_steps} steps, "
        f"{args.repeats} round(s) (median run per mode; ratio = median of the rounds' ratios); "
        f"timelines in {out}"
    )
    print(
        "| mode | trained tok/s | vs sync | vs sync, each round | wall s | p50/p99 len | occupancy | "
        "staleness | repacks | publish stall ms | CPU-s trainer / rollouts / driver | "
        "cores busy trainer / rollouts / driver | machine busy |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results if base else []:
        print(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['ratio']:.2f}x | "
            f"{' / '.join(f'{x:.2f}' for x in r['ratio_runs'])} | "
            f"{r['wall_s']:.1f} | {r['p50_len']:.0f}/{r['p99_len']:.0f} | {r['occupancy']:.2f} | "
            f"{r['staleness']} | {r['repacks']} | {r['publish_stall_ms']:.1f} | {cpu_split(r['cpu_s'])} | "
            f"{r['cores_trainer']:.1f} / {r['cores_rollout']:.1f} / {r['cores_driver']:.1f} | "
            f"{100 * r['machine_busy']:.0f}% |"
        )
    stalls = []
    for n in args.stall_rollouts:
        print(f"publish stall with {n} rollouts ...", flush=True)
        r = run_mode(
            "laminar",
            model_dir,
            prompts,
            argparse.Namespace(**{**vars(args), "rollouts": n}),
            out,
            tag=f"_rollouts{n}",
        )
        stalls.append({"rollouts": n, **r})
    if stalls:
        lo = min(r["publish_stall_ms"] for r in stalls)
        lo_cpu = min(r["publish_cpu_ms"] for r in stalls)
        print(
            "\n| rollouts | publish stall ms (median, wall) | vs lowest | trainer CPU ms in publish | "
            "vs lowest | trained tok/s |"
        )
        print("|---|---|---|---|---|---|")
        for r in stalls:
            print(
                f"| {r['rollouts']} | {r['publish_stall_ms']:.2f} | {r['publish_stall_ms'] / lo:.2f}x | "
                f"{r['publish_cpu_ms']:.2f} | {r['publish_cpu_ms'] / lo_cpu:.2f}x | {r['tokens_per_s']:.0f} |"
            )
    if args.json_out:
        write_json(args, results, stalls, skipped, partial=False)


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per mode with runs: its median run, every run's tok/s, and the ratio to sync's run of the same
    round (rounds where sync did not run give no ratio)."""
    base = runs.get("sync") or next((rs for rs in runs.values() if rs), [])
    by_round = {b.get("round"): b for b in base}
    results = []
    for rs in runs.values():
        if not rs:
            continue
        ratios = [
            r["tokens_per_s"] / by_round[r.get("round")]["tokens_per_s"]
            for r in rs
            if r.get("round") in by_round
        ]
        med = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
        results.append(
            {
                **med,
                "tokens_per_s_runs": [r["tokens_per_s"] for r in rs],
                "ratio_runs": ratios,
                "ratio": statistics.median(ratios) if ratios else float("nan"),
                "runs": len(rs),
            }
        )
    return results


def write_json(args, results: list[dict], stalls: list[dict], skipped: list[str], *, partial: bool) -> None:
    import os
    import platform

    shape = {
        k: getattr(args, k)
        for k in (
            "updates",
            "rollouts",
            "capacity",
            "chunk_steps",
            "prompts_per_step",
            "group_size",
            "cpus",
            "repeats",
            "device",
            "seed",
        )
    }
    env = {
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "machine": platform.machine(),
        "overrides": list(args.overrides),
        "small_model": args.small_model,
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(
        json.dumps(
            {
                "modes": results,
                "stall": stalls,
                "skipped": skipped,
                "partial": partial,
                "shape": shape,
                "env": env,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
