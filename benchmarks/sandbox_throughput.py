"""Sandbox throughput: executions per second and the start-up cost (p50/p99 wall time of a trivial
program) of ``environments.sandbox.run`` with 1, 2 and 8 concurrent calls, per backend.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sandbox_throughput.py --runs 200

Writes ``benchmarks/results/sandbox/<date>_throughput[_<label>].{json,md}`` with the machine described.
To compare two versions of the sandbox in one session, copy this script into the other checkout and
run it there with ``--label`` and ``--out`` pointing back here (the sandbox imported is the checkout's
the script sits in).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from environments import sandbox  # noqa: E402 - after the path setup above
from environments.sandbox import BubblewrapBackend, UnsafeSubprocessBackend  # noqa: E402 - same
from environments.sandbox.process import cgroup_parents  # noqa: E402 - same

TRIVIAL = "print(1)"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(backend, concurrency: int, runs: int) -> dict:
    """``runs`` trivial programs through ``concurrency`` threads: executions/s and per-call wall times."""
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: sandbox.run(TRIVIAL, backend=backend), range(concurrency)))  # warm
        start = time.perf_counter()
        results = list(pool.map(lambda _: sandbox.run(TRIVIAL, backend=backend), range(runs)))
        elapsed = time.perf_counter() - start
    bad = [r for r in results if not (r.ok and r.stdout == "1\n")]
    if bad:
        raise RuntimeError(f"{len(bad)} of {runs} trivial runs failed, e.g. {bad[0]}")
    return row(backend.name, concurrency, [r.wall_s * 1000 for r in results], elapsed)


def row(backend: str, concurrency: int, walls: list[float], elapsed: float) -> dict:
    return {
        "backend": backend,
        "concurrency": concurrency,
        "runs": len(walls),
        "executions_per_s": len(walls) / elapsed,
        "p50_ms": statistics.median(walls),
        "p99_ms": percentile(walls, 0.99),
        "mean_ms": statistics.fmean(walls),
        "elapsed_s": elapsed,
        "walls_ms": walls,
    }


def combine(paths: list[Path]) -> dict:
    """Pool the rows of several result files (rounds of one version, interleaved with another's on a
    shared machine): per (backend, concurrency), every wall time and the summed elapsed time."""
    parts = [json.loads(p.read_text()) for p in paths]
    pooled: dict[tuple[str, int], tuple[list[float], float]] = {}
    for part in parts:
        for r in part["rows"]:
            walls, elapsed = pooled.get((r["backend"], r["concurrency"]), ([], 0.0))
            pooled[r["backend"], r["concurrency"]] = (walls + r["walls_ms"], elapsed + r["elapsed_s"])
    out = {**parts[0], "rows": [row(b, c, w, e) for (b, c), (w, e) in pooled.items()]}
    out["machine"] = {**parts[0]["machine"], "loadavg_after": parts[-1]["machine"]["loadavg_after"]}
    out["runs"] = sum(p["runs"] for p in parts)
    out["combined"] = [p.name for p in paths]
    return out


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uid": os.getuid(),
        "cgroups": sorted(cgroup_parents()),
    }


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [
        f"# Sandbox throughput ({out['date']})",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} cores, kernel {m['kernel']}, Python {m['python']}, "
        f"uid {m['uid']}, per-run cgroups: {', '.join(m['cgroups']) or 'none'}; load average before "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg_before'])}, after "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg_after'])} (a machine shared with other jobs).",
        "",
        f"Program: `{TRIVIAL}`, {out['runs']} runs per row after a warm-up"
        + (f" (pooled from {', '.join(out['combined'])})" if out.get("combined") else "")
        + "; wall time per call from spawn "
        "to reaped (the start-up cost: bwrap, namespaces, cgroups, interpreter start).",
        "",
        f"Command: `{out['command']}`",
        "",
        *([f"Code: {out['note']}", ""] if out.get("note") else []),
        "| backend | concurrent calls | executions/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['backend']} | {r['concurrency']} | {r['executions_per_s']:.1f} | {r['p50_ms']:.1f} "
            f"| {r['p99_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="trivial programs per (backend, concurrency)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--no-unsafe", action="store_true", help="measure bubblewrap only")
    p.add_argument("--date", default="2026-12-06")
    p.add_argument("--label", default="", help="suffix of the results files (before, after, ...)")
    p.add_argument("--note", default="", help="which code was measured, for the results file")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sandbox")
    p.add_argument("--combine", type=Path, nargs="+", help="pool these result files instead of measuring")
    args = p.parse_args(argv)
    command = "PYTHONPATH=$PWD .venv/bin/python benchmarks/sandbox_throughput.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    if args.combine:
        out = {**combine(args.combine), "command": command, "note": args.note}
        return write(out, args.out, args.date, args.label)
    bwrap = BubblewrapBackend()
    reason = bwrap.unavailable()
    if reason is not None:
        raise SystemExit(f"bubblewrap cannot run here: {reason}")
    backends = [bwrap] if args.no_unsafe else [bwrap, UnsafeSubprocessBackend(why="benchmark baseline")]
    logging_off()
    out = {"date": args.date, "machine": machine(), "runs": args.runs, "rows": [], "note": args.note}
    out["command"] = command
    for backend in backends:
        for c in args.concurrency:
            row = measure(backend, c, args.runs)
            out["rows"].append(row)
            print(
                f"{row['backend']:10s} x{c}: {row['executions_per_s']:.1f}/s  p50 {row['p50_ms']:.1f} ms  "
                f"p99 {row['p99_ms']:.1f} ms",
                flush=True,
            )
    out["machine"]["loadavg_after"] = os.getloadavg()
    write(out, args.out, args.date, args.label)


def write(out: dict, folder: Path, date: str, label: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{date}_throughput" + (f"_{label}" if label else "")
    (folder / f"{stem}.json").write_text(json.dumps(out, indent=2) + "\n")
    (folder / f"{stem}.md").write_text(markdown(out))


def logging_off() -> None:
    """The unsafe baseline warns on every run by design; a benchmark of thousands of runs mutes it."""
    import logging

    logging.getLogger("environments.sandbox.backends").setLevel(logging.ERROR)


if __name__ == "__main__":
    main()
