"""What the timeline plot shows: occupancy samples and events of a spread sample of rollouts."""

from __future__ import annotations


class Timeline:
    """``data`` is the dict ``evaluation.timeline.plot_timeline`` reads (the runtime writes the same)."""

    def __init__(self, names: list[str], k: int):
        n = len(names)
        if k and k < n:
            idx = sorted({round(i * (n - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]
            self.traced = {names[i] for i in idx}
        else:
            self.traced = set(names)
        self.data: dict = {
            "rollouts": [name for name in names if name in self.traced],
            "samples": [],
            "events": [],
            "updates": [],
        }

    def event(self, t: float, rollout: str, kind: str, version: int) -> None:
        if rollout in self.traced:
            self.data["events"].append({"t": t, "rollout": rollout, "kind": kind, "version": version})

    def sample(self, t: float, rollout: str, active: int, capacity: int) -> None:
        if rollout in self.traced:
            self.data["samples"].append(
                {"t": t, "rollout": rollout, "occupancy": active / capacity, "active": active}
            )

    def update(self, t: float, version: int) -> None:
        self.data["updates"].append({"t": t, "version": version})
