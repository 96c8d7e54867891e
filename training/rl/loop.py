"""The synchronous RL loop, phase by phase: sample -> score -> update -> publish.

Each phase is a function with typed records in and out, so the asynchronous runtime can move the
phases onto separate workers without changing them.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from training.objectives import ObjectiveParams
from training.rl.engine import TorchEngine
from training.rl.records import GenRequest, PromptItem, ScoredGroup, Trajectory, UpdateStats
from training.rl.trainer import PolicyTrainer


@dataclass
class RLResult:
    """Per-step metrics (one dict per step) and how often each prompt was trained on."""

    history: list[dict[str, float]] = field(default_factory=list)
    consumed: Counter = field(default_factory=Counter)


class PromptCursor:
    """Walks a seeded shuffle of the prompt pool, epoch after epoch; ``position`` is the data cursor."""

    def __init__(self, prompts: Sequence[PromptItem], seed: int):
        self.prompts = list(prompts)
        self.seed = seed
        self.position = 0
        self._epoch_order: list[int] = []
        self._epoch = -1

    def take(self, n: int) -> list[PromptItem]:
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.position, len(self.prompts))
            if epoch != self._epoch:
                self._epoch_order = list(range(len(self.prompts)))
                random.Random(f"cursor:{self.seed}:{epoch}").shuffle(self._epoch_order)
                self._epoch = epoch
            out.append(self.prompts[self._epoch_order[offset]])
            self.position += 1
        return out


def sample_phase(engine: TorchEngine, prompts: Sequence[PromptItem], group_size: int, *, max_new_tokens: int,
                 temperature: float, generator: torch.Generator) -> list[Trajectory]:
    requests = [GenRequest(prompt=p, sample_idx=i) for p in prompts for i in range(group_size)]
    return engine.generate(requests, max_new_tokens, temperature, generator)


def score_phase(trajectories: Sequence[Trajectory], verifier) -> list[ScoredGroup]:
    """Group trajectories by prompt (in first-seen order) and score each with the shared verifier."""
    verdicts = verifier.verify_batch([t.text for t in trajectories], [t.prompt.answer for t in trajectories])
    by_prompt: dict[str, list[tuple[Trajectory, object]]] = {}
    for t, v in zip(trajectories, verdicts):
        by_prompt.setdefault(t.prompt.prompt_id, []).append((t, v))
    return [ScoredGroup(kind="scored_group", prompt_id=pid, trajectories=tuple(t for t, _ in items),
                        rewards=tuple(v.reward for _, v in items), correct=tuple(v.correct for _, v in items))
            for pid, items in by_prompt.items()]


def update_phase(trainer: PolicyTrainer, groups: Sequence[ScoredGroup]) -> UpdateStats:
    return trainer.update(groups)


def publish_phase(trainer: PolicyTrainer, engine: TorchEngine) -> int:
    engine.load_weights(trainer.publish())
    return engine.version


def step_metrics(step: int, groups: Sequence[ScoredGroup], stats: UpdateStats, gen_s: float, train_s: float) -> dict:
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [r for g in groups for r in g.rewards]
    n_tokens = sum(len(t.response_tokens) for t in trajs)
    constant = sum(1 for g in groups if len(set(g.rewards)) == 1)
    return {
        "step": float(step), "reward": sum(rewards) / len(rewards),
        "accuracy": sum(c for g in groups for c in g.correct) / len(rewards),
        "response_length": n_tokens / len(trajs),
        "truncated": sum(not t.finished for t in trajs) / len(trajs),
        "constant_groups": float(constant), "loss": stats.loss, "grad_norm": stats.grad_norm,
        "gen_seconds": gen_s, "train_seconds": train_s, "gen_tokens_per_s": n_tokens / max(gen_s, 1e-9),
        **{k: float(v) for k, v in stats.metrics.items()},
    }


def format_step(m: dict, total: int) -> str:
    """One fixed-format line per RL step."""
    return (f"step {int(m['step']):4d}/{total} | reward {m['reward']:.3f} | acc {m['accuracy']:.3f} | "
            f"len {m['response_length']:5.1f} | entropy {m['entropy']:.3f} | clipfrac {m['clipfrac']:.3f} | "
            f"const_groups {int(m['constant_groups']):3d} | gen {m['gen_seconds']:.2f}s | "
            f"train {m['train_seconds']:.2f}s | tok/s {m['gen_tokens_per_s']:.0f}")


def run_sync(model, tokenizer, prompts: Sequence[PromptItem], verifier, params: ObjectiveParams, *, steps: int,
             prompts_per_step: int, group_size: int, lr: float, weight_decay: float, max_grad_norm: float,
             max_new_tokens: int, temperature: float, seed: int, device: str,
             on_step: Callable[[dict], None] | None = None) -> RLResult:
    """Synchronous GRPO-family RL: generate a batch of groups with the current weights, score it,
    take one update and refresh the sampler's weights. Trains ``model`` in place."""
    import copy

    torch.manual_seed(seed)
    trainer = PolicyTrainer(model, params, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                            temperature=temperature, max_new_tokens=max_new_tokens,
                            pad_id=tokenizer.pad_token_id, device=device)
    engine = TorchEngine(copy.deepcopy(model), tokenizer, device=device)
    cursor = PromptCursor(prompts, seed)
    result = RLResult()
    for step in range(1, steps + 1):
        batch_prompts = cursor.take(prompts_per_step)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        t0 = time.perf_counter()
        trajectories = sample_phase(engine, batch_prompts, group_size, max_new_tokens=max_new_tokens,
                                    temperature=temperature, generator=generator)
        gen_s = time.perf_counter() - t0
        groups = score_phase(trajectories, verifier)
        t1 = time.perf_counter()
        stats = update_phase(trainer, groups)
        publish_phase(trainer, engine)
        metrics = step_metrics(step, groups, stats, gen_s, time.perf_counter() - t1)
        result.history.append(metrics)
        result.consumed.update(t.prompt.prompt_id for t in trajectories)
        if on_step is not None:
            on_step(metrics)
    trainer.model.eval()
    return result
