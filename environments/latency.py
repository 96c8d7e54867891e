"""Tool-call latency: seconds added to a tool call on top of its own time, drawn from the distribution
of ``conf.schema.ToolLatencyConfig`` (docs/environments.md). A draw is a pure function of the seed and
the call's key (episode and turn), so every RL mode, and the simulator, see the same latency for the
same call. Pure Python: no clock, no I/O."""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_right
from statistics import NormalDist

from conf.schema import CODEX_EXEC_LATENCY, ToolLatencyConfig

_NORMAL = NormalDist()


class LatencySampler:
    """``quantile(u)``: the latency at probability ``u``; ``sample(key)``: the draw of one call."""

    def __init__(self, cfg: ToolLatencyConfig):
        self.cfg = cfg
        if cfg.kind == "codex_exec":
            self.probs, self.seconds = (list(x) for x in CODEX_EXEC_LATENCY)
        else:
            self.probs, self.seconds = list(cfg.probs), list(cfg.seconds)
        if cfg.kind in ("quantiles", "codex_exec"):
            if len(self.probs) < 2 or self.probs[0] != 0 or self.probs[-1] != 1:
                raise ValueError("quantile latency needs probs from 0 to 1 (validated at compose time)")
            self._logs = [math.log(s) for s in self.seconds]
        elif cfg.kind == "fixed" and len(self.seconds) != 1:
            raise ValueError("fixed latency needs one value in seconds (validated at compose time)")
        elif cfg.kind not in ("off", "fixed", "lognormal"):
            raise ValueError(f"env.tool_latency.kind={cfg.kind!r} is not a latency distribution")
        self.median = self._base(0.5)

    @property
    def off(self) -> bool:
        return self.cfg.kind == "off"

    def _base(self, u: float) -> float:
        kind = self.cfg.kind
        if kind == "off":
            return 0.0
        if kind == "fixed":
            return float(self.seconds[0])
        if kind == "lognormal":
            u = min(max(u, 1e-12), 1 - 1e-12)
            return self.cfg.median_s * math.exp(self.cfg.sigma * _NORMAL.inv_cdf(u))
        i = min(max(bisect_right(self.probs, u) - 1, 0), len(self.probs) - 2)
        p0, p1 = self.probs[i], self.probs[i + 1]
        t = (u - p0) / (p1 - p0)
        return math.exp(self._logs[i] + t * (self._logs[i + 1] - self._logs[i]))

    def quantile(self, u: float) -> float:
        """The latency at probability ``u`` in [0, 1]; above the median, stretched by ``tail_scale``."""
        x = self._base(u)
        if x > self.median:
            x = self.median + self.cfg.tail_scale * (x - self.median)
        return x

    def sample(self, key: str) -> float:
        """The latency of the call named ``key`` (e.g. ``prompt id|sample|turn``), in seconds."""
        if self.off:
            return 0.0
        digest = hashlib.sha256(f"{self.cfg.seed}:{key}".encode()).digest()
        u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64
        return self.quantile(u)

    def mean(self, n: int = 20_000) -> float:
        """The distribution's mean, by the midpoint rule over ``n`` quantiles."""
        return sum(self.quantile((i + 0.5) / n) for i in range(n)) / n
