"""What experiment tracking costs a run: the logging calls themselves, per backend, timed in process.

For each backend set (``[]``, each backend alone, all three) on a fresh tracking folder:

* ``import_s``: importing the backend's library (torch, which the pipeline loads anyway, first);
* ``open_s``: opening the tracker run (``tasks.tracking.start_run``'s backends: SummaryWriter,
  MLflow's SQLite store and run, ``wandb.init`` offline) plus the config as parameters and the tags;
* ``step_ms``: one RL step's metrics through ``Tracker.step_logger`` (a dict with the keys and
  magnitudes of the Laminar runtime's per-step metrics, 40 values), flushed as the pipeline does:
  median, mean and p95 over ``--steps`` steps;
* ``stage_ms``: one finished stage's metrics (``Tracker.log_metrics`` of an evaluation's nested
  summary, ~60 values);
* ``close_s``: closing the run.

``per_default_run_s`` adds them up for the default pipeline (``rl.steps`` RL steps, 14 stages, one
open and close), to set beside a default run's wall time. Nothing here trains.

    .venv/bin/python benchmarks/tracking_overhead.py [--steps 300]

Writes ``benchmarks/results/tracking/tracking_overhead_<UTC date>.json`` (or ``--json-out``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, UTC
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOAD = os.getloadavg()[0]  # other work on the machine inflates every timing here
sys.path.insert(0, str(ROOT))

STEP_KEYS = (
    "reward",
    "accuracy",
    "response_length",
    "truncated",
    "constant_groups",
    "dropped_groups",
    "resampled_groups",
    "sampling_rounds",
    "trained_trajectories",
    "generated_trajectories",
    "loss",
    "grad_norm",
    "gen_seconds",
    "train_seconds",
    "gen_tokens_per_s",
    "entropy",
    "clipfrac",
    "ratio",
    "behaviour_weight",
    "kl",
    "staleness_mean",
    "staleness_max",
    "sampler_logprob_gap",
    "trained_tokens",
    "tokens_per_s",
    "occupancy",
    "repacks",
    "publish_stall_s",
    "publish_cpu_s",
    "wall_seconds",
    "eval_seconds",
    "heldout_acc",
    "hive_skipped",
    "hive_selected",
    "version",
    "queue",
    "in_flight",
    "active_rollouts",
    "buffer",
    "admitted",
)


IMPORTS = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow.tracking", "wandb": "wandb"}


def step_metrics(step: int, rng: random.Random) -> dict:
    return {"step": step, **{k: rng.random() * 100 for k in STEP_KEYS}}


def stage_metrics(rng: random.Random) -> dict:
    def level() -> dict:
        return {"avg_at_4": rng.random(), "pass_at_4": rng.random(), "maj_at_4": rng.random(), "count": 40}

    return {
        "arith_heldout": {
            "accuracy": rng.random(),
            "mean_length": 30.0,
            "pass_at_4": rng.random(),
            "maj_at_4": rng.random(),
            "by_level": {str(i): level() for i in range(1, 9)},
        },
        "seconds": 12.5,
        "cached": False,
    }


def measure(backends: list[str], steps: int, work: Path) -> dict:
    from conf.loader import load_config, to_dict
    from tasks.tracking import Tracker, flat_params, open_backends

    cfg = load_config([f"tracking.backends=[{','.join(backends)}]"])
    t0 = time.perf_counter()
    for name in backends:  # a process imports each library once; the pipeline has torch loaded already
        importlib.import_module(IMPORTS[name])
    import_s = time.perf_counter() - t0
    rng = random.Random(0)
    run_id = "bench-" + ("-".join(backends) or "none")
    t0 = time.perf_counter()
    config = to_dict(cfg)
    tracker = Tracker(run_id, open_backends(cfg.tracking, work, run_id, config))
    tracker.log_params(flat_params(config))
    tracker.set_tags({"laminar.run_id": run_id, "git.revision": "0" * 40})
    open_s = time.perf_counter() - t0
    log = tracker.step_logger("rl")
    step_times = []
    for step in range(1, steps + 1):
        m = step_metrics(step, rng)
        t = time.perf_counter()
        log(m)
        step_times.append((time.perf_counter() - t) * 1000)
    stage_times = []
    for i in range(14):
        m = stage_metrics(rng)
        t = time.perf_counter()
        tracker.log_metrics(f"stage{i}", m)
        stage_times.append((time.perf_counter() - t) * 1000)
    t = time.perf_counter()
    tracker.close("completed")
    close_s = time.perf_counter() - t
    assert len(tracker.backends) == 0
    ordered = sorted(step_times)
    rl_steps = cfg.rl.steps
    return {
        "backends": backends,
        "steps": steps,
        "import_s": round(import_s, 4),
        "open_s": round(open_s, 4),
        "close_s": round(close_s, 4),
        "step_ms": {
            "median": round(statistics.median(step_times), 3),
            "mean": round(statistics.fmean(step_times), 3),
            "p95": round(ordered[int(0.95 * (len(ordered) - 1))], 3),
            "max": round(ordered[-1], 3),
        },
        "stage_ms": {
            "median": round(statistics.median(stage_times), 3),
            "mean": round(statistics.fmean(stage_times), 3),
        },
        "default_rl_steps": rl_steps,
        "per_default_run_s": round(
            import_s
            + open_s
            + close_s
            + rl_steps * statistics.fmean(step_times) / 1000
            + 14 * statistics.fmean(stage_times) / 1000,
            3,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch  # noqa: F401 - loaded in every pipeline process before RL; not tracking's cost

    os.environ.pop("WANDB_API_KEY", None)  # offline: the network is not what is measured
    sets = [[], ["tensorboard"], ["mlflow"]]
    if importlib.util.find_spec("wandb") is not None:
        sets += [["wandb"], ["tensorboard", "mlflow", "wandb"]]
    else:
        sets += [["tensorboard", "mlflow"]]
    results = []
    for backends in sets:
        with tempfile.TemporaryDirectory(prefix="tracking-bench-") as tmp:
            r = measure(backends, args.steps, Path(tmp))
        results.append(r)
        print(
            f"{'+'.join(backends) or '(none)':<28} import {r['import_s']:5.2f}s  open {r['open_s']:6.2f}s"
            f"  step median {r['step_ms']['median']:7.3f} ms  p95 {r['step_ms']['p95']:7.3f} ms"
            f"  stage {r['stage_ms']['mean']:7.2f} ms  close {r['close_s']:5.2f}s"
            f"  per default run {r['per_default_run_s']:6.2f}s",
            flush=True,
        )
    now = datetime.now(UTC)
    out = (
        args.json_out
        or ROOT / "benchmarks" / "results" / "tracking" / f"tracking_overhead_{now:%Y-%m-%d}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": now.isoformat(timespec="seconds"),
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "load_avg_1m_before": LOAD,
                "load_avg_1m_after": os.getloadavg()[0],
                "command": " ".join(["benchmarks/tracking_overhead.py", *(argv or sys.argv[1:])]),
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
