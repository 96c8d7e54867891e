"""The relays on the clock: when each holds each published version (pipelined along the chain)."""

from __future__ import annotations

from collections.abc import Set

from training.rl.control import RelayChain
from training.rl.drivers.sim.costs import CostModel


class RelayModel:
    """``at[version][relay]``: the time ``relay`` holds ``version`` (colocated: at once)."""

    def __init__(self, chain: RelayChain, cost: CostModel, colocated: bool):
        self.chain = chain
        self.cost = cost
        self.colocated = colocated
        self.published = 0
        self.at: dict[int, dict[str, float]] = {0: {name: 0.0 for name in chain.order}}

    def publish(self, version: int, now: float) -> None:
        """The master relay has ``version`` now, the others along the chain."""
        self.published = version
        at = {}
        relay, hop = self.chain.master, 0
        while relay is not None:
            at[relay] = now + (0.0 if self.colocated else self.cost.relay_arrival_s(hop))
            relay = self.chain.next_of(relay)
            hop += 1
        self.at[version] = at

    def keep_only(self, keep: Set[int]) -> None:
        """Drop every version but ``keep`` and the newest published one."""
        for v in [v for v in self.at if v not in keep and v != self.published]:
            self.at.pop(v)

    def version_time(self, relay: str, min_version: int, now: float) -> tuple[int, float]:
        """(version, time it is at ``relay``): the newest published version, or ``min_version`` when
        that is newer than what the relay holds yet (the pull waits for it)."""
        v = max(self.published, min_version)
        return v, self.at[v].get(relay, now) if v in self.at else now
