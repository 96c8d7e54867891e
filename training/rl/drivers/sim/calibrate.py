"""Running modes on one config, with the training cost set from generation's share of a sync step."""

from __future__ import annotations

from collections.abc import Iterable

from conf.simulate import SimulateConfig, apply_preset
from training.rl.drivers.sim.costs import CostModel
from training.rl.drivers.sim.results import ModeResult
from training.rl.drivers.sim.simulator import Simulator

MAX_TRAIN_MFU = 0.6
"""``calibrate_train_share`` never implies a training MFU above this (a physical ceiling)."""


def calibrate_train_share(cfg: SimulateConfig) -> tuple[SimulateConfig, dict]:
    """With ``cost.train_gen_share = s > 0``: simulate the colocated synchronous mode without training
    cost to get its generation time per step ``G``, then set ``mfu_train`` so that one update on all
    GPUs takes ``G * (1 - s) / s``, but never above ``MAX_TRAIN_MFU`` of the FLOP count (then
    generation is less than ``s`` of a step: ``capped``). Returns the new config (presets applied)
    and what was derived."""
    cfg = apply_preset(cfg)
    s = cfg.cost.train_gen_share
    if s <= 0:
        return cfg, {}
    if not 0 < s < 1:
        raise ValueError("cost.train_gen_share must be in (0, 1)")
    probe = cfg.model_copy(
        update={
            "cluster": cfg.cluster.model_copy(update={"colocate_sync": True}),
            "cost": cfg.cost.model_copy(
                update={"train_s_per_token": 1e-12, "train_step_overhead_s": 0.0, "train_gen_share": 0.0}
            ),
            "workload": cfg.workload.model_copy(update={"steps": min(cfg.workload.steps, 3)}),
        }
    )
    sim = Simulator(probe, "sync")
    res = sim.run()
    gen = sum(res.step_seconds) / len(res.step_seconds)
    target = gen * (1 - s) / s
    tokens = res.trained_tokens / res.updates
    # the trainer's time per update on all GPUs at mfu 1, from the same FLOP model
    total = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    unit = cfg.model_copy(
        update={
            "cost": cfg.cost.model_copy(
                update={"mfu_train": 1.0, "train_step_overhead_s": 0.0, "train_s_per_token": 0.0}
            )
        }
    )
    mean_ctx = cfg.workload.prompt_len + sim.mean_len
    at_peak = CostModel(unit, cfg.cluster.gpus_per_engine, total).train_s(int(tokens), mean_ctx)
    busy = max(1e-9, target - cfg.cost.train_step_overhead_s)
    mfu = at_peak / busy
    capped = mfu > MAX_TRAIN_MFU
    if capped:
        mfu = MAX_TRAIN_MFU
        target = at_peak / mfu + cfg.cost.train_step_overhead_s
    new = cfg.model_copy(
        update={"cost": cfg.cost.model_copy(update={"mfu_train": mfu, "train_gen_share": 0.0})}
    )
    return new, {
        "sync_generation_s": gen,
        "train_s_per_update_all_gpus": target,
        "implied_mfu_train": mfu,
        "train_gen_share": s,
        "capped": capped,
        "generation_share": gen / (gen + target),
    }


def simulate(cfg: SimulateConfig, modes: Iterable[str] | None = None) -> dict[str, ModeResult]:
    """Every mode of ``cfg.modes`` (or ``modes``) on the same config and seed (after
    ``calibrate_train_share`` when ``cost.train_gen_share`` is set)."""
    cfg, _ = calibrate_train_share(cfg)
    return {m: Simulator(cfg, m).run() for m in (list(modes) if modes is not None else list(cfg.modes))}
