"""The Laminar paper's setting in the cluster simulator: speedups of laminar over every mode.

Setting (arXiv 2510.12633, as summarised in ../shared/ALGORITHMS.md): H800 GPUs, Qwen2.5 7B/32B/72B,
512 prompts x 16 responses per update, max output 16K tokens, p99 length about 10x the median,
generation about 83% of a synchronous step; 64 to 1,024 GPUs. The Laminar paper's averages of laminar's
speedup: 2.56x over verl sync, 1.98x over one-step staleness, 1.93x over stream generation, 1.39x over
AReaL-style partial rollout.

Assumptions (all in docs/simulator.md's model of the simulator; none tuned to the Laminar paper's speedups):

- **Hardware**: H800 = H100 SXM compute (989 dense bf16 TFLOP/s) and memory (80 GB HBM3, 3.35 TB/s;
  the H800 differs only in NVLink and export-limited interconnect), 70% of HBM bandwidth and 50% of
  peak FLOP/s reachable in decode/prefill, 4 ms per decode step of engine overhead, 20 us per layer of
  tensor-parallel all-reduce; host links 25 GB/s (PCIe 5 x16, effective), relay chain 100 GB/s (an
  800 Gb/s node NIC: a 72B version reaches 127 relays in ~1.5 s; the Laminar paper reports < 1.6 s).
- **Engines**: tensor parallel 1 / 4 / 8 GPUs for 7B / 32B / 72B; capacity from the KV memory left
  after the weights (85% of it) at the mean context, at most 512 sequences.
- **Lengths**: lognormal, median 1,500 tokens, p99 = 10x the median, half of the log-variance shared
  by a prompt's 16 responses, truncated at 16,384; prompts of 256 tokens.
- **Training cost**: the Laminar paper states generation is ~83% of a synchronous step; the FLOP model's
  MFU is *set from that statement* (``cost.train_gen_share = 0.83``, calibrated per model and scale
  in the colocated sync mode, then used by every mode of that model and scale; never above 60% MFU,
  where 83% is not reachable: 32B and 72B on 64-128 GPUs). The implied MFU (a
  few per cent of the 8N-FLOP count at 1,024 GPUs) is printed: with a physically typical 30-40% MFU
  generation would be ~98% of a sync step at 1,024 GPUs, not 83%, so the Laminar paper's updates must cost
  far more than their FLOPs (log-prob recomputation, FSDP communication with ~1 sequence per GPU...).
- **Back-pressure**: none by default (``--max-ahead-batches 0``), as the Laminar paper: the continuous modes
  keep generating while the trainer is busy (the experience buffer grows); ``--max-ahead-batches K``
  issues new prompts only while issued-but-untrained groups stay within K batches.
- **Modes**: ``sync`` is colocated (all GPUs generate, then all train, 2 s weight switch), as verl's
  hybrid engine; the others are disaggregated. Their trainer/rollout split is searched per mode over
  ``--shares`` and the best steady throughput is kept (each baseline tuned, as a practitioner would).
  No staleness bound (the Laminar paper's Laminar sets none; one_step/stream are bounded by construction).
- **Throughput**: trained tokens/s after ``warmup_updates`` updates (pipeline fill), over ``--steps``.

    .venv/bin/python benchmarks/simulate_laminar_paper.py [--scales 64 128 256 512 1024] [--jobs 2]
        [--tool-calls N --tool-latency codex_exec --tail-scale 1.0 --version-rule turn|episode]

With tools, ``--version-rule`` picks what one weight version spans in laminar mode
(``workload.version_rule``, docs/simulator.md "Tool latency"): ``turn`` (the runtime's default: an
episode waiting on its tool is parked out of the batch and pins no weights) or ``episode``.
``--calibrate-rule`` sets the training cost from the sync step under that rule (default: the same),
so that two rules can be compared at the same training cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conf.simulate import simulate_config  # noqa: E402 (after the sys.path line above)
from training.rl.drivers.sim import Simulator, calibrate_train_share  # noqa: E402 (after the sys.path line above)

PAPER = {"sync": 2.56, "one_step": 1.98, "stream": 1.93, "partial": 1.39}
MODEL_NAMES = ["qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b"]
MODES = ["sync", "one_step", "stream", "partial", "laminar"]
MAX_AHEAD = 0
VERSION_RULE = "turn"
TOOLS: list[dict] = []
LENGTHS = {"kind": "lognormal", "median": 1500, "p99_over_median": 10, "group_corr": 0.5}
"""``--tool-calls N``: every episode calls a tool N times, each waiting a latency of ``--tool-latency``
(``workload.tools``, the env's ``ToolLatencyConfig``): the agentic projection (docs/simulator.md)."""


def base_config(model: str, gpus: int, steps: int, seed: int):
    return simulate_config(
        {
            "cluster": {"nodes": gpus // 8, "gpus_per_node": 8, "colocate_sync": True},
            "model": {"preset": model},
            "workload": {
                "prompts_per_step": 512,
                "group_size": 16,
                "steps": steps,
                "max_output": 16384,
                "prompt_len": 256,
                "lengths": LENGTHS,
                "tools": TOOLS,
                "version_rule": VERSION_RULE,
            },
            "cost": {"train_gen_share": 0.83},
            "sched": {"max_staleness": None, "repack_interval_s": 5.0, "max_ahead_batches": MAX_AHEAD},
            "seed": seed,
            "warmup_updates": 2,
            "timeline_rollouts": 16,
        }
    )


def with_rule(cfg, rule: str):
    return cfg.model_copy(update={"workload": cfg.workload.model_copy(update={"version_rule": rule})})


def run_one(args):
    cfg, mode, share, keep_timeline, max_events = args
    if share is not None:
        cfg = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"trainer_share": share})})
    t0 = time.perf_counter()
    try:
        r = Simulator(cfg, mode).run(max_events=max_events)
    except RuntimeError as err:
        return {"mode": mode, "share": share, "error": str(err)}
    out = {
        "mode": mode,
        "share": share,
        "steady_tokens_per_s": r.steady_tokens_per_s,
        "tokens_per_s": r.tokens_per_s,
        "idle_share": r.idle_share,
        "mean_occupancy": r.mean_occupancy,
        "staleness": r.staleness_histogram,
        "repacks": r.repacks,
        "pulls": r.pulls,
        "interrupts": r.interrupts,
        "step_seconds": r.step_seconds,
        "generation_share": r.generation_share,
        "rollouts": r.rollouts,
        "trainer_gpus": r.trainer_gpus,
        "rollout_gpus": r.rollout_gpus,
        "capacity": r.capacity,
        "events": r.events,
        "sim_seconds": time.perf_counter() - t0,
    }
    if keep_timeline:
        out["timeline"] = r.timeline
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    ap.add_argument("--models", nargs="+", default=MODEL_NAMES)
    ap.add_argument(
        "--shares",
        type=float,
        nargs="+",
        default=[0.5, 0.75, 0.875],
        help="trainer shares of the GPUs searched for each disaggregated mode",
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "simulate_laminar_paper")
    ap.add_argument(
        "--max-ahead-batches",
        type=int,
        default=0,
        help="simulator back-pressure for the continuous modes (0: none, as the Laminar paper)",
    )
    ap.add_argument("--tool-calls", type=int, default=0, help="tool calls per episode (0: none)")
    ap.add_argument("--tool-latency", default="codex_exec", help="their latency (env.tool_latency.kind)")
    ap.add_argument("--tail-scale", type=float, default=1.0, help="the latency's tail_scale")
    ap.add_argument(
        "--version-rule",
        choices=["turn", "episode"],
        default="turn",
        help="with tools: what one weight version spans in laminar mode (workload.version_rule)",
    )
    ap.add_argument(
        "--calibrate-rule",
        choices=["turn", "episode"],
        default=None,
        help="the version rule of the sync run that sets the training cost (default: --version-rule)",
    )
    ap.add_argument("--max-events", type=int, default=6_000_000, help="per simulated mode")
    ap.add_argument("--length-median", type=float, default=1500, help="response length median, tokens")
    ap.add_argument("--length-p99", type=float, default=10, help="response length p99 / median")
    args = ap.parse_args()
    global MAX_AHEAD, VERSION_RULE
    MAX_AHEAD = args.max_ahead_batches
    VERSION_RULE = args.version_rule
    cal_rule = args.calibrate_rule or args.version_rule
    LENGTHS.update(median=args.length_median, p99_over_median=args.length_p99)
    if args.tool_calls:
        latency = {"kind": args.tool_latency, "tail_scale": args.tail_scale}
        TOOLS.append({"name": "tool", "calls": args.tool_calls, "latency": latency})
    from evaluation.timeline import plot_timeline

    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "paper_average_speedups": PAPER,
        "settings": {},
        "runs": {},
        "tools": TOOLS,
        "version_rule": VERSION_RULE,
        "calibrate_rule": cal_rule,
        "lengths": LENGTHS,
    }
    jobs = []
    for model in args.models:
        for gpus in args.scales:
            cfg, info = calibrate_train_share(
                with_rule(base_config(model, gpus, args.steps, args.seed), cal_rule)
            )
            cfg = with_rule(cfg, VERSION_RULE)
            info["calibrated_under_version_rule"] = cal_rule
            results["settings"][f"{model}@{gpus}"] = {
                "calibration": info,
                "gpus_per_engine": cfg.cluster.gpus_per_engine,
            }
            print(
                f"{model} @ {gpus} GPUs: sync generation {info['sync_generation_s']:.0f} s/step -> training "
                f"{info['train_s_per_update_all_gpus']:.0f} s/update on all GPUs (implied MFU "
                f"{info['implied_mfu_train'] * 100:.1f}% of the 8N-FLOP count"
                + (
                    "; capped at the physical ceiling: generation "
                    f"{info['generation_share'] * 100:.0f}% of a step)"
                    if info["capped"]
                    else ")"
                ),
                flush=True,
            )
            for mode in MODES:
                for share in [None] if mode == "sync" else args.shares:
                    jobs.append(((model, gpus), (cfg, mode, share, gpus == 1024, args.max_events)))
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        outs = list(pool.map(run_one, [j for _, j in jobs]))
    table = {}
    for (key, _), out in zip(jobs, outs):
        table.setdefault(key, {}).setdefault(out["mode"], []).append(out)
    speed_rows, fixed_rows = {}, {}
    fixed_share = 0.5 if 0.5 in args.shares else args.shares[0]
    for (model, gpus), by_mode in table.items():
        fixed = {
            m: next((o for o in outs_m if o["share"] in (None, fixed_share) and "error" not in o), None)
            for m, outs_m in by_mode.items()
        }
        if all(fixed.values()):
            lam_f = fixed["laminar"]["steady_tokens_per_s"]
            fixed_rows[(model, gpus)] = {m: lam_f / fixed[m]["steady_tokens_per_s"] for m in PAPER}
        best = {}
        for mode, outs_m in by_mode.items():
            ok = [o for o in outs_m if "error" not in o]
            best[mode] = max(ok, key=lambda o: o["steady_tokens_per_s"]) if ok else outs_m[0]
        lam = best["laminar"]["steady_tokens_per_s"]
        speed = {m: lam / best[m]["steady_tokens_per_s"] for m in PAPER if "steady_tokens_per_s" in best[m]}
        speed_rows[(model, gpus)] = speed
        results["runs"][f"{model}@{gpus}"] = {
            "best": {m: {k: v for k, v in o.items() if k != "timeline"} for m, o in best.items()},
            "all": {
                m: [{k: v for k, v in o.items() if k not in ("timeline", "step_seconds")} for o in outs_m]
                for m, outs_m in by_mode.items()
            },
            "laminar_speedup": speed,
        }
        if gpus == 1024:
            for mode in ("sync", "laminar"):
                tl = best[mode].get("timeline")
                if tl:
                    name = f"timeline_{model}_1024_{mode}.png"
                    share = best[mode]["share"]
                    plot_timeline(
                        tl,
                        args.out / name,
                        title=f"simulated {mode}, {model}, 1,024 GPUs"
                        + (f" (trainer {best[mode]['trainer_gpus']} GPUs)" if share else " (colocated)")
                        + f": {len(tl['rollouts'])} of {best[mode]['rollouts']} rollouts",
                    )
    # summary tables
    print("\nLaminar's simulated speedup (best split per mode) vs the Laminar paper's averages")
    print("| model | GPUs | over sync | over one_step | over stream | over partial |")
    print("|---|---|---|---|---|---|")
    for (model, gpus), sp in sorted(
        speed_rows.items(), key=lambda kv: (MODEL_NAMES.index(kv[0][0]), kv[0][1])
    ):
        print(f"| {model} | {gpus} | " + " | ".join(f"{sp.get(m, float('nan')):.2f}x" for m in PAPER) + " |")
    avg = {}
    for label, keys in [("1024", [k for k in speed_rows if k[1] == 1024]), ("all scales", list(speed_rows))]:
        avg[label] = {m: sum(speed_rows[k][m] for k in keys) / len(keys) for m in PAPER} if keys else {}
    print(
        "| **average, 1,024 GPUs** | | "
        + " | ".join(f"{avg['1024'].get(m, float('nan')):.2f}x" for m in PAPER)
        + " |"
    )
    print("| **average, all scales** | | " + " | ".join(f"{avg['all scales'][m]:.2f}x" for m in PAPER) + " |")
    print("| **paper (average)** | | " + " | ".join(f"{PAPER[m]:.2f}x" for m in PAPER) + " |")
    print("\nBest trainer share per mode at 1,024 GPUs, and what the modes do there:")
    for model in args.models:
        r = results["runs"].get(f"{model}@1024")
        if not r:
            continue
        for m, o in r["best"].items():
            if "error" in o:
                print(f"  {model} {m}: {o['error']}")
                continue
            later = o["step_seconds"][2:]
            print(
                f"  {model} {m}: trainer {o['trainer_gpus']} GPUs, {o['rollouts']} engines "
                f"x {o['capacity']}, "
                f"{o['steady_tokens_per_s']:,.0f} tok/s, idle {o['idle_share']:.2f}, occupancy "
                f"{o['mean_occupancy']:.2f}, max staleness {max(int(k) for k in o['staleness'])}, "
                f"repacks {o['repacks']}, mean step {sum(later) / max(1, len(later)):.0f} s"
            )
    if fixed_rows:
        print(f"\nThe same with one fixed split for every disaggregated mode (trainer share {fixed_share}):")
        print("| model | GPUs | over sync | over one_step | over stream | over partial |")
        print("|---|---|---|---|---|---|")
        for (model, gpus), sp in sorted(
            fixed_rows.items(), key=lambda kv: (MODEL_NAMES.index(kv[0][0]), kv[0][1])
        ):
            print(f"| {model} | {gpus} | " + " | ".join(f"{sp[m]:.2f}x" for m in PAPER) + " |")
        for label, keys in [
            ("1024", [k for k in fixed_rows if k[1] == 1024]),
            ("all scales", list(fixed_rows)),
        ]:
            avg[f"fixed {fixed_share}, {label}"] = (
                {m: sum(fixed_rows[k][m] for k in keys) / len(keys) for m in PAPER} if keys else {}
            )
            print(
                f"| **average, {'1,024 GPUs' if label == '1024' else label}** | | "
                + " | ".join(
                    f"{avg[f'fixed {fixed_share}, {label}'].get(m, float('nan')):.2f}x" for m in PAPER
                )
                + " |"
            )
        results["speedups_fixed_split"] = {f"{m}@{g}": sp for (m, g), sp in fixed_rows.items()}
    results["averages"] = avg
    results["speedups"] = {f"{m}@{g}": sp for (m, g), sp in speed_rows.items()}
    results["sim_wall_seconds"] = time.perf_counter() - t_start
    results["method"] = __doc__
    (args.out / "simulate_laminar_paper.json").write_text(json.dumps(results, indent=1))
    print(f"\n{time.perf_counter() - t_start:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
