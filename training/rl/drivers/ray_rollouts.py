"""The rollout actors of a Ray run: starting them, and the transport of the manager's orders to them.

The fleet keeps at most one call in flight per rollout actor (``run`` with a ``StepOrder`` or an
``ExtractOrder`` from the manager), hands each reply back to the manager (``step_done``,
``extract_done``), and tells it when an actor died, was restarted by Ray, or is back. Every
scheduling decision stays in the manager (``training.rl.manager``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from training.rl.drivers.ray_relays import pin
from training.rl.records import ExtractOrder, ExtractReply, StepReply

LOG = logging.getLogger("laminar.training")

WAKE_GROUP = "wake"
"""The rollout actors' concurrency group for ``wake``: a thread of its own, so it runs while ``run`` waits."""


def rollout_actor_class(ray, cluster):
    """``RolloutWorker`` as a Ray actor class with ``cluster``'s resources and restarts: ``run`` in the
    default group (one call at a time), ``wake`` in ``WAKE_GROUP`` beside it."""
    from training.rl.actors import RolloutWorker

    return ray.remote(
        num_cpus=cluster.rollout_cpus,
        num_gpus=cluster.rollout_gpus,
        max_restarts=cluster.max_restarts,
        concurrency_groups={WAKE_GROUP: 1},
    )(RolloutWorker)


def rollout_node(cluster, nodes: list[str], i: int) -> str:
    """The node of rollout ``i``: ``cluster.rollout_nodes`` (indices into ``nodes``, cycled) if set,
    else round robin over ``nodes``."""
    picks = cluster.rollout_nodes
    return nodes[picks[i % len(picks)] % len(nodes)] if picks else nodes[i % len(nodes)]


@dataclass
class RolloutActor:
    """The runtime's handle on one rollout actor (the manager holds its scheduling state)."""

    name: str
    handle: object
    pid: int = 0
    future: object = None
    op: str = ""
    node: str = ""


class RolloutFleet:
    """The run's rollout actors (``actors``: name -> ``RolloutActor``), started by ``start``."""

    def __init__(self):
        self.actors: dict[str, RolloutActor] = {}

    def start(self, ray, cluster, nodes: list[str], args: tuple, kwargs: dict) -> None:
        """One rollout actor per node of ``nodes`` (``rollout-0`` on the first), with the worker's
        arguments ``args`` and ``kwargs`` after its name; returns once each answers a ping."""
        Rollout = rollout_actor_class(ray, cluster)
        for i, node in enumerate(nodes):
            name = f"rollout-{i}"
            handle = Rollout.options(scheduling_strategy=pin(node)).remote(name, *args, **kwargs)
            self.actors[name] = RolloutActor(name, handle, node=node)
        for a in self.actors.values():
            a.pid = ray.get(a.handle.ping.remote()).pid

    def poke(self, name: str) -> None:
        """An idle rollout: nothing to do, the loop dispatches it this turn. A busy one is back within a
        chunk of decode steps, unless its call waits on its episodes' tools: that wait is cut short
        (``RolloutWorker.wake``, in its own concurrency group), so a new version or handed-over work
        does not wait for a slow tool."""
        a = self.actors.get(name)
        if a is not None and a.future is not None and a.op == "step":
            a.handle.wake.options(concurrency_group=WAKE_GROUP).remote()

    def dispatch_idle(self, manager, relays: dict, chunk_steps: int) -> None:
        """Give every live rollout without a call in flight the manager's next order for it (if any);
        an order that pulls weights carries the handle of the rollout's relay."""
        for a in self.actors.values():
            if a.future is not None or not manager.rollouts[a.name].alive:
                continue
            order = manager.dispatch(a.name)
            if order is None:
                continue  # idle
            relay = relays[manager.rollouts[a.name].relay] if getattr(order, "pull", False) else None
            a.future = a.handle.run.remote(order, chunk_steps, relay)
            a.op = "extract" if isinstance(order, ExtractOrder) else "step"

    def futures(self) -> list:
        return [a.future for a in self.actors.values() if a.future is not None]

    def owner(self, fut) -> RolloutActor:
        return next(a for a in self.actors.values() if a.future is fut)

    def collect(self, ray, a: RolloutActor, fut, manager, ledger) -> dict | None:
        """Hand ``a``'s finished call ``fut`` to the manager (its CPU time to ``ledger``); returns its
        occupancy sample for the timeline, or ``None`` if the actor died (its in-flight requests go back
        to the queue while Ray restarts it). A new pid means Ray restarted it between two calls: what it
        held is gone too."""
        from ray.exceptions import RayActorError

        op, a.future, a.op = a.op, None, ""
        try:
            out: StepReply | ExtractReply = ray.get(fut)
        except RayActorError:
            lost = manager.died(a.name)
            LOG.warning(
                "%s died: %d in-flight requests re-queued; waiting for Ray to restart it", a.name, lost
            )
            return None
        ledger.see(a.name, out.pid, out.cpu_s)
        if out.pid != a.pid:
            lost = manager.restarted(a.name, after_step=op == "step")
            a.pid = out.pid
            LOG.warning("%s was restarted (pid %d): %d requests re-queued", a.name, a.pid, lost)
        if op == "extract":
            dst = manager.extract_done(a.name, out.partials, out.queued, out.status)
            if dst is not None:
                self.poke(dst)  # the handed-over work rides the receiver's next call
        else:
            manager.step_done(a.name, out.finished, out.status, out.pulled)
        status = out.status
        return {
            "rollout": a.name,
            "occupancy": status.active / max(1, status.capacity),
            "active": status.active,
        }

    def revive(self, ray, manager) -> None:
        """Tell the manager of each dead rollout that answers a ping again (it pulls from its relay on
        its next dispatch)."""
        for a in self.actors.values():
            if manager.rollouts[a.name].alive:
                continue
            try:
                info = ray.get(a.handle.ping.remote(), timeout=0.5)
            except Exception:  # noqa: BLE001 - still restarting (or gone for good)
                continue
            manager.revived(a.name)
            a.pid = info.pid
            LOG.warning("%s is back (pid %d)", a.name, a.pid)

    def alive_handles(self, manager) -> dict:
        return {n: a.handle for n, a in self.actors.items() if manager.rollouts[n].alive}
