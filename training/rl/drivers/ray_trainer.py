"""The trainer of a Ray run: its ranks as Ray actors, started together and driven as one handle."""

from __future__ import annotations

from conf.schema import ClusterConfig, TrainerConfig
from training.rl.drivers.ray_relays import pin


class TrainerGroup:
    """The trainer's ranks as one handle. ``call`` invokes a method on every rank and returns rank
    0's ref (the other ranks' refs wait in ``pending`` until ``settle``); ``get`` calls every rank
    and returns rank 0's value; ``lead`` is rank 0 alone (it talks to the relays)."""

    def __init__(self, handles: list, pg=None):
        self.handles = handles
        self.lead = handles[0]
        self.pg = pg
        self.pending: list = []

    def call(self, method: str, *args):
        refs = [getattr(h, method).remote(*args) for h in self.handles]
        self.pending = refs[1:]
        return refs[0]

    def settle(self, ray) -> None:
        if self.pending:
            ray.get(self.pending)
        self.pending = []

    def get(self, ray, method: str, *args):
        return ray.get([getattr(h, method).remote(*args) for h in self.handles])[0]


def start_trainers(
    ray, cluster: ClusterConfig, cfg: TrainerConfig, nodes: list[str], device: str, args: tuple, kwargs: dict
) -> tuple[TrainerGroup, list[str]]:
    """One ``TrainerWorker`` actor per rank (``args`` and ``kwargs`` are its own, the rank's added) and
    the nodes they run on. One rank is pinned to ``cluster.trainer_node`` (an index into ``nodes``);
    several form a placement group (``cluster.trainer_strategy``: PACK, SPREAD, STRICT_PACK,
    STRICT_SPREAD) and meet in a ``torch.distributed`` rendezvous at rank 0's address."""
    from training.rl.actors import TrainerWorker

    c, ranks = cluster, cfg.ranks
    Trainer = ray.remote(num_cpus=c.trainer_cpus, num_gpus=c.trainer_gpus)(TrainerWorker)
    pg = _placement_group(ray, c, ranks) if ranks > 1 else None
    dist_backend = cfg.dist_backend
    if dist_backend == "auto":
        dist_backend = "nccl" if str(device).startswith("cuda") else "gloo"
    handles = []
    for rank in range(ranks):
        strategy = _rank_strategy(pg, rank) if pg is not None else pin(nodes[c.trainer_node % len(nodes)])
        handles.append(
            Trainer.options(scheduling_strategy=strategy).remote(
                *args, **kwargs, rank=rank, world_size=ranks, dist_backend=dist_backend
            )
        )
    if ranks > 1 or cfg.backend != "torch":
        addr, port = ray.get(handles[0].address.remote())
        infos = ray.get([h.start.remote(addr, port) for h in handles])
    else:
        infos = [ray.get(handles[0].ping.remote())]
    return TrainerGroup(handles, pg), [i.node for i in infos]


def _placement_group(ray, c: ClusterConfig, ranks: int):
    from ray.util.placement_group import placement_group

    bundle = {"CPU": c.trainer_cpus, **({"GPU": c.trainer_gpus} if c.trainer_gpus else {})}
    pg = placement_group([bundle] * ranks, strategy=c.trainer_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=120)
    if not ready:
        raise RuntimeError(
            f"the trainer's placement group ({ranks} x {c.trainer_cpus:g} CPU, "
            f"{c.trainer_strategy}) could not be placed on this cluster within 120 s"
        )
    return pg


def _rank_strategy(pg, rank: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)


def release_placement_group(group: TrainerGroup | None) -> None:
    """Remove the trainer's placement group, if it has one (its actors are killed with the others)."""
    if group is not None and group.pg is not None:
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group.pg)
        except Exception:  # noqa: BLE001
            pass
