"""``laminar simulate``: run the cluster-scale simulator (``training.rl.drivers.sim``) for every mode of
a ``conf.simulate.SimulateConfig`` and write its summary JSON and timeline plots. No Prefect and no
catalog: the simulator reads nothing from the workspace and writes only its output folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conf.schema import ConfigError


def resolve(cfg):
    """The validated ``SimulateConfig`` as the simulator runs it: ``model.preset`` applied and
    ``workload.lengths.values_file`` read into ``values``; errors as ``ConfigError`` (raised before
    anything is written)."""
    from conf.simulate import apply_preset

    lengths = cfg.workload.lengths
    if lengths.values_file:
        lengths = lengths.model_copy(update={"values": read_lengths(Path(lengths.values_file))})
    return apply_preset(
        cfg.model_copy(update={"workload": cfg.workload.model_copy(update={"lengths": lengths})})
    )


def read_lengths(path: Path) -> list[int]:
    """Response lengths from a JSON list or a real run's ``runtime.json`` (``response_lengths``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"workload.lengths.values_file={path}: cannot read JSON ({err})") from None
    if isinstance(data, dict):
        data = data.get("response_lengths")
    if not isinstance(data, list) or not data or not all(isinstance(x, int) and x > 0 for x in data):
        raise ConfigError(
            f"workload.lengths.values_file={path}: expected a list of positive token counts "
            "(or a runtime.json with response_lengths)"
        )
    return data


def output_dir(cfg, workspace: str | Path) -> Path:
    if cfg.out:
        return Path(cfg.out)
    return Path(workspace) / "simulate" / time.strftime("%Y%m%d-%H%M%S")


def run_simulation(cfg, workspace: str | Path, progress=None) -> dict:
    """Simulate every mode of ``cfg.modes``; write ``simulate.json``, ``timeline_<mode>.json`` and
    ``timeline_<mode>.png`` under the output folder. Returns {"out", "table", "summary"}."""
    from evaluation.timeline import plot_timeline, summarize_timeline
    from training.rl.drivers.sim import Simulator, calibrate_train_share, format_table, speedups

    sim_cfg = resolve(cfg)
    out = output_dir(cfg, workspace)
    t0 = time.perf_counter()
    sim_cfg, calibration = calibrate_train_share(sim_cfg)
    results = {}
    for mode in cfg.modes:
        t = time.perf_counter()
        results[mode] = Simulator(sim_cfg, mode).run()
        if progress:
            progress(
                f"{mode}: {results[mode].steady_tokens_per_s:,.0f} trained tok/s "
                f"({time.perf_counter() - t:.1f} s to simulate)"
            )
    out.mkdir(parents=True, exist_ok=True)
    shape = (
        f"{sim_cfg.cluster.nodes * sim_cfg.cluster.gpus_per_node} GPUs, {sim_cfg.model.name}, "
        f"{sim_cfg.workload.prompts_per_step}x{sim_cfg.workload.group_size}"
    )
    plots = {}
    for mode, r in results.items():
        (out / f"timeline_{mode}.json").write_text(json.dumps(r.timeline))
        n = len(r.timeline["rollouts"])
        plots[mode] = str(
            plot_timeline(
                r.timeline,
                out / f"timeline_{mode}.png",
                title=f"simulated {mode}: {shape}; {n} of {r.rollouts} rollouts",
            )
        )
    summary = {
        "config": cfg.model_dump(),
        "resolved": sim_cfg.model_dump(),
        "calibration": calibration,
        "modes": {
            m: {**r.summary(), "timeline_summary": _timeline_brief(summarize_timeline(r.timeline))}
            for m, r in results.items()
        },
        "laminar_speedup": speedups(results) if "laminar" in results else {},
        "plots": plots,
        "simulate_seconds": time.perf_counter() - t0,
    }
    (out / "simulate.json").write_text(json.dumps(summary, indent=1))
    return {
        "out": out,
        "table": format_table(results, "sync" if "sync" in results else cfg.modes[0]),
        "summary": summary,
    }


def _timeline_brief(tl: dict) -> dict:
    rows = tl["rollouts"].values()
    n = max(1, len(rows))
    return {
        "duration": tl["duration"],
        "updates": tl["updates"],
        "traced_rollouts": len(rows),
        "mean_occupancy": sum(r["mean_occupancy"] for r in rows) / n,
        "idle_share": sum(r["idle_share"] for r in rows) / n,
        "pulls": sum(r["pulls"] for r in rows),
        "repacks": sum(r["repacks"] for r in rows),
    }
