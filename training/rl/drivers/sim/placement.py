"""Where things run: the trainer/rollout split of the GPUs, each rollout's node and relay."""

from __future__ import annotations

import math
from dataclasses import dataclass

from conf.simulate import SimulateConfig
from training.rl.control import RelayChain
from training.rl.drivers.sim.costs import CostModel
from training.rl.drivers.sim.lengths import LengthSampler


@dataclass(frozen=True)
class Layout:
    """``placed``: ``(rollout, node, relay)`` per rollout engine, in index order. Colocated (``sync``
    with ``cluster.colocate_sync``): trainer and rollouts each use every GPU, in turn."""

    colocated: bool
    trainer_gpus: int
    rollout_gpus: int
    chain: RelayChain
    placed: list[tuple[str, str, str]]


def layout(cfg: SimulateConfig, mode: str) -> Layout:
    """The split of ``cfg``'s cluster for ``mode``; refuses one that leaves no room for an engine."""
    cl = cfg.cluster
    total = cl.nodes * cl.gpus_per_node
    if total < 2 or cl.gpus_per_engine < 1 or total % cl.gpus_per_engine:
        raise ValueError(f"{total} GPUs cannot hold engines of {cl.gpus_per_engine} GPUs")
    colocated = mode == "sync" and cl.colocate_sync
    if colocated:
        trainer_gpus, rollout_gpus = total, total
    else:
        trainer_gpus = cl.trainer_gpus or auto_trainer_gpus(cfg, total)
        rollout_gpus = total - trainer_gpus
    if rollout_gpus < cl.gpus_per_engine or trainer_gpus < 1:
        raise ValueError(
            f"trainer {trainer_gpus} GPUs leaves {rollout_gpus} for rollouts of "
            f"{cl.gpus_per_engine} GPUs each"
        )
    n_rollouts = rollout_gpus // cl.gpus_per_engine
    per_node = max(1, cl.gpus_per_node // cl.gpus_per_engine)
    first_node = 0 if colocated else math.ceil(trainer_gpus / cl.gpus_per_node) if cl.nodes > 1 else 0
    nodes = [f"node-{(first_node + i // per_node) % cl.nodes}" for i in range(n_rollouts)]
    chain = RelayChain(
        [
            (f"relay-{i}", node)
            for i, node in enumerate(sorted(set(nodes), key=lambda s: int(s.split("-")[1])))
        ]
    )
    placed = [(f"rollout-{i}", node, chain.relay_for(node)) for i, node in enumerate(nodes)]
    return Layout(colocated, trainer_gpus, rollout_gpus, chain, placed)


def auto_trainer_gpus(cfg: SimulateConfig, total: int) -> int:
    """``cluster.trainer_share`` of the GPUs (0: balanced), in whole nodes when there are several."""
    cl = cfg.cluster
    if cl.trainer_share > 0:
        want = max(1, round(total * cl.trainer_share))
    else:
        want = balanced_trainer_gpus(cfg)
    if cl.nodes > 1 and want >= cl.gpus_per_node:
        want = max(cl.gpus_per_node, round(want / cl.gpus_per_node) * cl.gpus_per_node)
    return max(1, min(want, total - cl.gpus_per_engine))


def balanced_trainer_gpus(cfg: SimulateConfig) -> int:
    """Trainer GPUs where one update (``prompts_per_step x group_size`` responses of the mean length)
    trains in the time the other GPUs' engines generate its tokens at full occupancy: a split that
    neither starves the trainer nor lets generation run far ahead. The same for every asynchronous mode."""
    cl, wl = cfg.cluster, cfg.workload
    total = cl.nodes * cl.gpus_per_node
    one = CostModel(cfg, cl.gpus_per_engine, 1)
    mean_len = LengthSampler(wl.lengths, wl.max_output, wl.group_size, cfg.seed).mean()
    cap = cfg.sched.capacity or one.auto_capacity(wl.prompt_len + mean_len, cfg.sched.max_capacity)
    tokens = wl.prompts_per_step * wl.group_size * mean_len
    train_1 = one.train_s(int(tokens), wl.prompt_len + mean_len) - cfg.cost.train_step_overhead_s
    rate = cap / one.decode_step_s(cap, wl.prompt_len + mean_len / 2) / cl.gpus_per_engine  # tokens/s per GPU
    gen_1 = tokens / rate
    return max(1, min(total - cl.gpus_per_engine, round(total * train_1 / (train_1 + gen_1))))
