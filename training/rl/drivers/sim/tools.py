"""The workload's tool calls as the simulator's engines see them (``workload.tools``).

Every episode makes the same calls in order, each with a latency drawn per prompt, sample, tool and
call, so every mode and both version rules see the same waits. Under the turn rule
(``workload.version_rule=turn``) a call ends the episode's policy turn and waits on the wall clock,
out of the batch; under the episode rule it waits inside the batch, as decode steps.
"""

from __future__ import annotations

from conf.simulate import SimulateConfig
from environments.latency import LatencySampler
from generation.records import GenRequest
from training.rl.drivers.sim.costs import CostModel


class ToolCalls:
    """``calls``: every episode's tool calls in order, as (draw key suffix, latency sampler);
    ``turn_rule``: tool waits on the wall clock, out of the batch (else ``pause_steps``)."""

    def __init__(self, cfg: SimulateConfig, cost: CostModel, capacity: int):
        tools = [(t, LatencySampler(t.latency)) for t in cfg.workload.tools if t.calls > 0]
        self.calls = [(f"{t.name}|{i}", lat) for t, lat in tools for i in range(t.calls)]
        self.turn_rule = bool(self.calls) and cfg.workload.version_rule == "turn"
        self.pause_step_s = (
            cost.decode_step_s(capacity, cfg.workload.prompt_len)
            if self.calls and not self.turn_rule
            else 0.0
        )
        """A tool wait in decode steps: the step cost of a full batch at the prompt's context."""

    def __len__(self) -> int:
        return len(self.calls)

    def latency(self, req: GenRequest, i: int) -> float:
        """The latency of episode ``req``'s ``i``-th tool call (``self.calls``), drawn per prompt,
        sample, tool and call, so every mode and both version rules see the same."""
        name, lat = self.calls[i]
        return lat.sample(f"{req.prompt.prompt_id}|{req.sample_idx}|{name}")

    def pause_steps(self, req: GenRequest) -> int:
        """The decode steps an episode's tool calls wait: each call's latency over ``pause_step_s``;
        0 without tools (or under the turn rule)."""
        if not self.calls or self.turn_rule:
            return 0
        wait = sum(self.latency(req, i) for i in range(len(self.calls)))
        return round(wait / self.pause_step_s)

    def turn_end(self, length: int, turn: int) -> int:
        """Turn rule: the response tokens an episode has at the end of policy turn ``turn``; its
        ``length`` is split evenly over its ``len(self.calls) + 1`` turns."""
        n = len(self.calls) + 1
        return length if turn >= n - 1 else length * (turn + 1) // n
