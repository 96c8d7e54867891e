"""Trained tokens/s of the four RL modes on a tool workload with long-tailed tool latency, equal resources.

The workload: the arithmetic task under ``env=calculator_sandbox``: every calculator call is a real
sandboxed execution (``environments.sandbox.run`` of the calculator's source), plus a tool latency per
call drawn from ``env.tool_latency`` (default ``codex_exec``: the published residual latency of Codex's
``exec_command`` calls, P50 0.16 s / P90 0.27 s / P99 8.6 s; see ``conf.schema.CODEX_EXEC_LATENCY``).
The warm-up (built once without the pipeline, ``rl_throughput.warm_start``) imitates tool demonstrations
for every problem (``env.demo_tool_share=1``), so nearly every episode calls the tool. Each tail scale
(``--tails``: 1 = the cited distribution, 0.5 = the tail halved, 2 = doubled) runs every mode
``--repeats`` rounds on the Ray runtime through ``rl_throughput.run_mode``, in rotated order; ratios
are to sync in the same round. The load average is recorded beside every run. ``--through in_process
endpoint`` runs every mode both ways: in-process, and the same episodes played by an agent written
against ``openai`` through the agent endpoint (``benchmarks/tool_agent.py``), each path's ratio to its
own sync in the same round.

    .venv/bin/python benchmarks/tool_throughput.py [--tails 1 0.5 2] [--repeats 3] [--updates 6]
        [--through in_process endpoint] [--json-out F] [--md-out F] [--out DIR] [overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import rl_throughput as rt  # noqa: E402
from benchmarks.tool_agent import endpoint_overrides  # noqa: E402

TOOL_WORKLOAD = [
    "data.levels=[2,3,4,5]",
    "data.pool_size=1500",
    "data.heldout_size=50",
    "sft.levels=[2,3,4,5]",
    "sft.steps=250",
    "rl.max_new_tokens=48",
    "env.demo_tool_share=1.0",
    "env.max_turns=3",
    "env.tool_workers=8",
]
WARM_ENV = ["env=calculator"]
"""The warm-up's demonstrations call the in-process calculator (the same results as the sandboxed one,
without 1,500 sandbox runs); RL runs ``env=calculator_sandbox``."""


def latency_overrides(kind: str, tail: float, timeout_s: float) -> list[str]:
    return [
        "env=calculator_sandbox",
        f"env.tool_latency.kind={kind}",
        f"env.tool_latency.tail_scale={tail}",
        f"env.tool_timeout_s={timeout_s}",
    ]


def latency_stats(kind: str, tail: float, batch: int) -> dict:
    """The distribution's quantiles and mean, and the expected slowest of ``batch`` calls (the wait a
    synchronous step pays), from the sampler itself."""
    from conf.schema import ToolLatencyConfig
    from environments.latency import LatencySampler

    s = LatencySampler(ToolLatencyConfig(kind=kind, tail_scale=tail))
    slowest = [max(s.sample(f"stats|{j}|{i}") for i in range(batch)) for j in range(400)]
    return {
        "p50_s": s.quantile(0.5),
        "p90_s": s.quantile(0.9),
        "p99_s": s.quantile(0.99),
        "max_s": s.quantile(1.0),
        "mean_s": s.mean(),
        f"expected_max_of_{batch}_s": statistics.fmean(slowest),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["sync", "one_step", "partial", "laminar"])
    ap.add_argument("--tails", type=float, nargs="+", default=[1.0, 0.5, 2.0])
    ap.add_argument("--latency", default="codex_exec", help="env.tool_latency.kind")
    ap.add_argument("--updates", type=int, default=6)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--chunk-steps", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument("--unbounded", action="store_true")
    ap.add_argument("--repack-interval", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warm-device", default="cpu")
    ap.add_argument("--warm-start", type=Path, default=ROOT / "workspace-bench-tools" / "warm")
    ap.add_argument("--out", type=Path, default=ROOT / "workspace-bench-tools" / "timelines")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--md-out", type=Path, help="also write the tables as markdown")
    ap.add_argument(
        "--tail-repeats",
        type=int,
        default=None,
        help="rounds for tail scales other than 1 (default --repeats)",
    )
    ap.add_argument(
        "--through",
        nargs="+",
        choices=["in_process", "endpoint"],
        default=["in_process"],
        help="in_process: env=calculator_sandbox; endpoint: the same episodes by an agent written against "
        "openai through the agent endpoint (benchmarks/tool_agent.py); ratios are to sync on the same path",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rt.WORKLOAD.extend(TOOL_WORKLOAD)
    args.out.mkdir(parents=True, exist_ok=True)
    timeout_s = 2 * 30.0 * max(args.tails) + 10
    warm = argparse.Namespace(**{**vars(args), "overrides": [*WARM_ENV, *args.overrides]})
    model_dir, prompts = rt.warm_start(args.warm_start, warm)
    batch = args.prompts_per_step * args.group_size
    report = {"tails": [], "shape": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}}
    report["shape"]["workload"] = list(rt.WORKLOAD)
    for tail in args.tails:
        lat = latency_overrides(args.latency, tail, timeout_s)
        paths = {"in_process": lat, "endpoint": [*lat, *endpoint_overrides()]}
        runs: dict[str, dict[str, list[dict]]] = {p: {m: [] for m in args.modes} for p in args.through}
        rounds = args.repeats if tail == 1.0 or args.tail_repeats is None else args.tail_repeats
        for rnd in range(rounds):
            order = args.modes[rnd % len(args.modes) :] + args.modes[: rnd % len(args.modes)]
            for mode in order:
                for path in args.through if rnd % 2 == 0 else args.through[::-1]:
                    targs = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, *paths[path]]})
                    load_before = os.getloadavg()
                    print(
                        f"tail x{tail} round {rnd + 1}/{rounds}: {mode} {path} (load {load_before})",
                        flush=True,
                    )
                    tag = f"_tail{tail}_r{rnd + 1}" + ("" if path == "in_process" else f"_{path}")
                    try:
                        r = rt.run_mode(mode, model_dir, prompts, targs, args.out, tag=tag)
                    except Exception as e:  # noqa: BLE001 - one failed run is recorded, the others go on
                        report.setdefault("failed", []).append(
                            {
                                "tail": tail,
                                "round": rnd + 1,
                                "mode": mode,
                                "path": path,
                                "error": repr(e)[:2000],
                            }
                        )
                        print(f"FAILED: {e!r}"[:2000], flush=True)
                        continue
                    r.update(round=rnd + 1, path=path, load_before=load_before, load_after=os.getloadavg())
                    runs[path][mode].append(r)
                    print(
                        json.dumps({k: r[k] for k in ("mode", "path", "tokens_per_s", "wall_s", "repacks")}),
                        flush=True,
                    )
                    if args.json_out:
                        write(args.json_out, report, tail, runs, args, batch)
        if args.json_out:
            write(args.json_out, report, tail, runs, args, batch, final=True)
        for path in args.through:
            print_table(f"{tail} ({path})", rt.summarize(runs[path]))


def write(path: Path, report: dict, tail: float, runs, args, batch: int, final: bool = False) -> None:
    """``runs``: per path (``in_process``, ``endpoint``), per mode; the in-process tables stay under
    ``modes``/``runs`` (the earlier reports' shape), the endpoint's under ``endpoint_modes`` and
    ``endpoint_runs``."""
    entry = {
        "tail_scale": tail,
        "latency": {"kind": args.latency, **latency_stats(args.latency, tail, batch)},
        "complete": final,
    }
    for p, by_mode in runs.items():
        modes = rt.summarize(by_mode)
        for m in modes:
            m["loads"] = [r["load_before"][0] for r in by_mode[m["mode"]]]
        prefix = "" if p == "in_process" else f"{p}_"
        entry[prefix + "modes"], entry[prefix + "runs"] = modes, by_mode
    report["tails"] = [t for t in report["tails"] if t["tail_scale"] != tail] + [entry]
    report["env"] = {"cpu_count": os.cpu_count(), "loadavg_now": os.getloadavg()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    if args.md_out:
        args.md_out.write_text(markdown(report))


HEADER = (
    "| mode | trained tok/s | vs sync (median) | vs sync, each round | wall s | occupancy | staleness | "
    "repacks | p50/p99 len | load avg (1 min) before each run |\n|---|---|---|---|---|---|---|---|---|---|"
)


def rows(results: list[dict]) -> list[str]:
    return [
        f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['ratio']:.2f}x | "
        f"{' / '.join(f'{x:.2f}' for x in r['ratio_runs'])} | {r['wall_s']:.1f} | "
        f"{r['occupancy']:.2f} | {r['staleness']} | {r['repacks']} | {r['p50_len']:.0f}/{r['p99_len']:.0f} | "
        f"{' / '.join(f'{x:.1f}' for x in r.get('loads', []))} |"
        for r in results
    ]


def print_table(tail, results: list[dict]) -> None:
    print(f"\ntail x{tail}\n{HEADER}")
    print("\n".join(rows(results)))


def markdown(report: dict) -> str:
    """The report's tables: one per tail scale, with the latency each one drew from."""
    out = []
    for t in report["tails"]:
        lat = t["latency"]
        slow = next(v for k, v in lat.items() if k.startswith("expected_max"))
        out.append(
            f"### Tail x{t['tail_scale']} ({lat['kind']}: P50 {lat['p50_s']:.2f} s, "
            f"P90 {lat['p90_s']:.2f} s, "
            f"P99 {lat['p99_s']:.2f} s, max {lat['max_s']:.1f} s, mean {lat['mean_s']:.2f} s; expected "
            f"slowest of a step's calls {slow:.1f} s){'' if t['complete'] else ' (incomplete)'}\n"
        )
        for key, what in (("modes", "in-process"), ("endpoint_modes", "through the agent endpoint")):
            if t.get(key):
                out += [f"{what}:\n", HEADER, *rows(t[key]), ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
