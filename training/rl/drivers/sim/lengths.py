"""Response lengths and the synthetic prompt source the manager's queue draws from."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from conf.simulate import SimLengthConfig
from generation.records import PromptItem, ScoredGroup, Trajectory


class LengthSampler:
    """Deterministic per (seed, prompt index): a list of ``group_size`` response lengths."""

    def __init__(self, spec: SimLengthConfig, max_output: int, group_size: int, seed: int):
        self.s = spec
        self.max = max_output
        self.g = group_size
        self.seed = seed
        if spec.kind not in ("lognormal", "mixture", "values"):
            raise ValueError(f"workload.lengths.kind={spec.kind!r}: expected lognormal, mixture or values")
        if spec.kind == "mixture" and not (len(spec.weights) == len(spec.medians) == len(spec.sigmas) > 0):
            raise ValueError("workload.lengths mixture needs weights, medians and sigmas of one length")
        if spec.kind == "values" and not spec.values:
            raise ValueError(
                "workload.lengths.kind=values needs workload.lengths.values "
                "(values_file is read into it by tasks.simulate.resolve)"
            )

    def group(self, index: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + index)
        s = self.s
        if s.kind == "values":
            return [self._clip(rng.choice(s.values)) for _ in range(self.g)]
        if s.kind == "mixture":
            u, acc, k = rng.random() * sum(s.weights), 0.0, len(s.weights) - 1
            for i, w in enumerate(s.weights):
                acc += w
                if u <= acc:
                    k = i
                    break
            mu, sig = math.log(s.medians[k]), float(s.sigmas[k])
            return [self._clip(math.exp(mu + sig * rng.gauss(0, 1))) for _ in range(self.g)]
        sigma = math.log(max(s.p99_over_median, 1.0)) / 2.3263
        rho = min(max(s.group_corr, 0.0), 1.0)
        z0 = rng.gauss(0, 1)
        mu = math.log(s.median)
        return [
            self._clip(math.exp(mu + sigma * (math.sqrt(rho) * z0 + math.sqrt(1 - rho) * rng.gauss(0, 1))))
            for _ in range(self.g)
        ]

    def _clip(self, x: float) -> int:
        return int(min(self.max, max(1, round(x))))

    def mean(self, n: int = 2000) -> float:
        xs = [x for i in range(n // self.g + 1) for x in self.group(10_000_000 + i)]
        return sum(xs) / len(xs)


class PromptSource:
    """The prompt source the manager's queue draws from: synthetic prompts, one length list each and,
    with ``pass_rates``, which of its responses are right (deterministic per seed and prompt)."""

    def __init__(
        self, sampler: LengthSampler, prompt_len: int, pass_rates: Sequence[float] = (), seed: int = 0
    ):
        self.sampler = sampler
        self.prompt_len = prompt_len
        self.pass_rates = list(pass_rates)
        self.seed = seed
        self.position = 0
        self.lengths: dict[str, list[int]] = {}
        self.correct: dict[str, list[bool]] = {}

    def take(self, n: int) -> list[PromptItem]:
        out = []
        for _ in range(n):
            pid = f"p{self.position}"
            self.lengths[pid] = self.sampler.group(self.position)
            if self.pass_rates:
                rng = random.Random(f"correct:{self.seed}:{self.position}")
                p = rng.choice(self.pass_rates)
                self.correct[pid] = [rng.random() < p for _ in range(self.sampler.g)]
            out.append(PromptItem(pid, "", "", (), None))
            self.position += 1
        return out

    def score(self, trajs: list[Trajectory]) -> ScoredGroup:
        pid = trajs[0].prompt.prompt_id
        right = self.correct.get(pid)
        correct = tuple(right[t.sample_idx] for t in trajs) if right else (False,) * len(trajs)
        return ScoredGroup("scored_group", pid, tuple(trajs), tuple(float(c) for c in correct), correct)

    def observe(self, groups) -> None:
        """Selection does not learn from rewards here."""

    def round_size(self, remaining: int, zero_var_ratio: float, batch: int) -> int:
        return remaining

    def step_counts(self) -> dict[str, float]:
        return {}
