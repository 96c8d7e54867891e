"""The simulated clock: a heap of ``(time, seq, kind, obj, epoch)`` events; ``seq`` breaks ties in
push order, ``epoch`` lets a re-timed segment void the event pushed for it before."""

from __future__ import annotations

import heapq
from typing import Any


class Clock:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, str, Any, int]] = []
        self.seq = 0
        self.now = 0.0

    def push(self, t: float, kind: str, obj: Any = None, epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, epoch))

    def pop(self) -> tuple[str, Any, int]:
        """The next event; the clock moves to its time."""
        t, _, kind, obj, epoch = heapq.heappop(self.heap)
        self.now = t
        return kind, obj, epoch
