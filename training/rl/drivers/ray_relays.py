"""The relays of a Ray run: the path every new version takes from the trainer to the rollouts.

One relay actor per node at the start, chained master first (``control.RelayChain``): the trainer
pushes to the master, each relay forwards to the next, and a node's rollouts pull from their node's
relay. A relay that dies is cut out of the chain (its node's rollouts bypass to a live relay) and
rebuilt on the same node at the tail. The Ray driver (``training.rl.drivers.ray``) checks their
health and tells the manager where each rollout now pulls from.
"""

from __future__ import annotations

import logging

from training.rl.control import RelayChain

LOG = logging.getLogger("laminar.training")

KEEP_VERSIONS = 2
"""Versions a relay keeps besides those in-flight responses use (``control.retained_versions``)."""


def pin(node: str):
    """Ray's scheduling strategy that places an actor on ``node`` and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node, soft=False)


class RelayFleet:
    """The run's relay actors (``relays``: name -> handle) and their chain (``chain``), each taking
    ``cpus`` Ray CPUs; ``start`` puts one on each node."""

    def __init__(self, ray, cpus: float):
        from training.rl.actors import RelayWorker

        self.ray = ray
        self._Relay = ray.remote(num_cpus=cpus, max_concurrency=8)(RelayWorker)
        self.relays: dict[str, object] = {}
        self.chain = RelayChain([])
        self._seq = 0

    def start(self, nodes: list[str]) -> None:
        """One relay per node of ``nodes``, chained in that order (the master on the first)."""
        for node in nodes:
            self._start(node)
        self.wire()

    @property
    def master(self):
        """The master relay's handle: the trainer pushes to it."""
        return self.relays[self.chain.master]

    def _start(self, node: str) -> str:
        name = f"relay-{self._seq}"
        self._seq += 1
        self.relays[name] = self._Relay.options(scheduling_strategy=pin(node)).remote(name, KEEP_VERSIONS)
        self.chain.add(name, node)
        return name

    def wire(self) -> None:
        """Point every relay at its successor in the chain (the last at none)."""
        self.ray.get(
            [self.relays[a].set_next.remote(self.relays[b] if b else None) for a, b in self.chain.links()]
        )

    def dead(self) -> list[str]:
        """The relays of the chain that do not answer a ping within 2 s."""
        dead = []
        for name in list(self.chain.order):
            try:
                self.ray.get(self.relays[name].ping.remote(), timeout=2.0)
            except Exception:  # noqa: BLE001
                dead.append(name)
        return dead

    def heal(self, trainer_lead, manager) -> list[str]:
        """Replace every relay that stopped answering (``replace``), count it in the manager's
        ``relay_failures`` and point each of its rollouts at its node's relay in the new chain.
        Returns the dead relays' names."""
        dead = self.dead()
        for name in dead:
            new = self.replace(name, trainer_lead)
            manager.counts["relay_failures"] += 1
            for r in manager.rollouts.values():
                r.relay = self.chain.relay_for(r.node)
            LOG.warning("relay %s died: cut out of the chain, rebuilt as %s", name, new)
        return dead

    def replace(self, name: str, trainer_lead) -> str:
        """Cut the dead relay ``name`` out of the chain, start a new one on its node at the tail, and
        feed it the latest version: republished by the trainer (``trainer_lead``) if ``name`` was the
        master, else forwarded down the chain. Returns the new relay's name."""
        was_master = name == self.chain.master
        new = self._start(self.chain.node_of[name])
        self.chain.remove(name)
        self.wire()
        if was_master:
            self.ray.get(trainer_lead.set_master.remote(self.master))
            self.ray.get(trainer_lead.republish.remote())
        else:
            self.ray.get(self.master.forward_latest.remote())
            self.forward_chain()
        return new

    def forward_chain(self) -> None:
        """Each relay with a successor forwards its latest version to it, master first."""
        for a, b in self.chain.links():
            if b is not None:
                self.ray.get(self.relays[a].forward_latest.remote())

    def retain(self, keep: list[int]) -> None:
        """Every relay keeps the versions ``keep`` (fire and forget: a dead relay is the health check's)."""
        for relay in self.relays.values():
            relay.retain.remote(keep)

    def latest(self):
        """The master's latest published version (``None`` before the first)."""
        return self.ray.get(self.master.latest.remote())
