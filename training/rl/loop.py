"""The synchronous RL loop, phase by phase: sample -> score -> update -> publish.

Each phase is a function with typed records in and out, so the asynchronous runtime can move the
phases onto separate workers without changing them.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence

import torch

from training.objectives import ObjectiveParams, overlong_penalty
from generation.engine import Engine as TorchEngine
from generation.records import GenRequest, PromptItem, ScoredGroup, Trajectory
from training.rl.records import UpdateStats
from training.rl.trainer import PolicyTrainer


@dataclass
class RLResult:
    """Per-step metrics (one dict per step) and how often each prompt was trained on."""

    history: list[dict[str, float]] = field(default_factory=list)
    consumed: Counter = field(default_factory=Counter)
    rewards: list[tuple[int, str, float, int]] = field(default_factory=list)
    """(step, prompt_id, mean correctness, responses) of every rolled-out group: the reward history."""


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

    def observe(self, groups: Sequence[ScoredGroup]) -> None:
        """Uniform sampling learns nothing from rewards."""

    def round_size(self, remaining: int, zero_var_ratio: float, batch: int) -> int:
        """A further dynamic-sampling round of the Ray runtime's batched modes: the groups still missing."""
        return remaining

    def state(self) -> dict:
        """The data cursor, for a checkpoint (the epoch orders follow from the seed)."""
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        self.position = int(state["position"])

    def step_counts(self) -> dict[str, float]:
        return {}


class HiveSource:
    """HIVE's online selection in front of the cursor (arXiv 2603.25184; stage 1 after GRESO).

    Raw batches drawn from the cursor first meet GRESO's filter, which skips a prompt with a
    probability that grows with its recent run of all-correct or all-wrong groups; the survivors
    are scored by prompt entropy under the current policy (one forward pass) and only those at or
    above the pool's median (``rule``) are kept. Every rolled-out group's mean correctness goes back
    into the history, and GRESO's skip bases adapt to the observed zero-variance ratios."""

    def __init__(
        self,
        cursor: PromptCursor,
        engine: TorchEngine,
        *,
        greso=None,
        entropy_rule: str = "median",
        seed: int = 0,
        min_raw_batch: int = 32,
        round_headroom: float = 1.0,
        min_round: float = 0.0,
    ):
        self.cursor = cursor
        self.round_headroom = round_headroom
        self.min_round = min_round
        self.engine = engine
        self.greso = greso
        self.entropy_rule = entropy_rule
        self.rng = random.Random(f"hive:{seed}")
        self.min_raw_batch = min_raw_batch
        self.buffer: list[PromptItem] = []
        self._counts = Counter()

    @property
    def position(self) -> int:
        return self.cursor.position

    def take(self, n: int) -> list[PromptItem]:
        from data_curation.hive import prompt_entropy_keep

        for _ in range(1000):  # GRESO never skips with certainty (keep prob >= 0.01): this ends
            if len(self.buffer) >= n:
                break
            raw = self.cursor.take(max(self.min_raw_batch, 2 * n))
            self._counts["drawn_prompts"] += len(raw)
            if self.greso is not None:
                by_id = {p.prompt_id: p for p in raw}
                kept_ids, skipped = self.greso.filter([p.prompt_id for p in raw], self.rng)
                raw = [by_id[i] for i in kept_ids]
                self._counts["skipped_prompts"] += len(skipped)
            if self.entropy_rule != "off" and len(raw) > 1:
                keep = prompt_entropy_keep(self.engine.prompt_entropy(raw), self.entropy_rule)
                self._counts["pruned_prompts"] += sum(1 for k in keep if not k)
                raw = [p for p, k in zip(raw, keep) if k]
            self.buffer.extend(raw)
        out: list[PromptItem] = []
        rest: list[PromptItem] = []
        for p in self.buffer:  # one group per prompt in a batch; a repeat waits for the next batch
            (rest if len(out) >= n or any(q.prompt_id == p.prompt_id for q in out) else out).append(p)
        self.buffer = rest
        return out

    def round_size(self, remaining: int, zero_var_ratio: float, batch: int) -> int:
        """GRESO's size of a further sampling round: enough prompts for the ``remaining`` groups at
        the zero-variance ratio seen so far (times ``round_headroom``), within [``min_round`` x batch,
        1.5 batch], instead of dynamic sampling's full batch per round. GRESO's code uses headroom
        1.25 and a floor of batch/4 (64..384 for a batch of 256); at a batch of 16 that floor and
        headroom leave about 2 valid groups unused per extra round, so the defaults here are the
        expected need (1.0) and no floor (``curation.select.round_headroom`` / ``min_round``)."""
        need = math.ceil(self.round_headroom * remaining / max(1.0 - zero_var_ratio, 0.05) - 1e-9)
        return max(max(1, math.ceil(self.min_round * batch)), min(need, batch + batch // 2))

    def observe(self, groups: Sequence[ScoredGroup]) -> None:
        if self.greso is None or not groups:
            return
        easy = hard = 0
        for g in groups:
            mean = sum(g.correct) / len(g.correct)
            self.greso.observe(g.prompt_id, mean)
            easy += mean == 1.0
            hard += mean == 0.0
        self.greso.end_step(easy / len(groups), hard / len(groups))

    def state(self) -> dict:
        """Everything HIVE's online selection holds, for a checkpoint (JSON): the cursor, the prompts
        that passed the filters and wait for a batch, the RNG of GRESO's skips, GRESO's own state and
        the counters since the last step."""
        from training.rl.control import prompt_to_json

        version, internal, gauss = self.rng.getstate()
        return {
            "cursor": self.cursor.state(),
            "buffer": [prompt_to_json(p) for p in self.buffer],
            "rng": [version, list(internal), gauss],
            "counts": dict(self._counts),
            "greso": self.greso.state() if self.greso is not None else None,
        }

    def load_state(self, state: dict) -> None:
        from training.rl.control import prompt_from_json

        self.cursor.load_state(state["cursor"])
        self.buffer = [prompt_from_json(p) for p in state["buffer"]]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._counts = Counter(state["counts"])
        if self.greso is not None and state["greso"] is not None:
            self.greso.load_state(state["greso"])

    def step_counts(self) -> dict[str, float]:
        """Prompts drawn from the cursor, skipped by GRESO and pruned by entropy since the last call."""
        out = {k: float(self._counts[k]) for k in ("drawn_prompts", "skipped_prompts", "pruned_prompts")}
        self._counts.clear()
        return out


def sample_phase(
    engine: TorchEngine,
    prompts: Sequence[PromptItem],
    group_size: int,
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> list[Trajectory]:
    requests = [GenRequest(prompt=p, sample_idx=i) for p in prompts for i in range(group_size)]
    return engine.generate(requests, max_new_tokens, temperature, generator)


def score_phase(
    trajectories: Sequence[Trajectory], verifier, shaping: Callable[[Trajectory], float] | None = None
) -> list[ScoredGroup]:
    """Group trajectories by prompt (in first-seen order) and score each with the shared verifier;
    ``shaping`` adds a term to the reward (DAPO's overlong punishment), never to ``correct``."""
    verdicts = verifier.verify_batch([t.text for t in trajectories], [t.prompt.answer for t in trajectories])
    by_prompt: dict[str, list[tuple[Trajectory, object]]] = {}
    for t, v in zip(trajectories, verdicts):
        by_prompt.setdefault(t.prompt.prompt_id, []).append((t, v))
    extra = shaping or (lambda _t: 0.0)
    return [
        ScoredGroup(
            kind="scored_group",
            prompt_id=pid,
            trajectories=tuple(t for t, _ in items),
            rewards=tuple(v.reward + extra(t) for t, v in items),
            correct=tuple(v.correct for _, v in items),
        )
        for pid, items in by_prompt.items()
    ]


def overlong_shaping(params: ObjectiveParams, max_new_tokens: int) -> Callable[[Trajectory], float] | None:
    """DAPO's soft overlong punishment as a reward term, or None when the objective does not use it."""
    if not params.overlong_shaping:
        return None

    def shape(t: Trajectory) -> float:
        length = torch.tensor([len(t.response_tokens)])
        return float(overlong_penalty(length, max_new_tokens, params.overlong_cache_len)[0])

    return shape


@dataclass
class Collected:
    """The groups one step trains on, and what dynamic sampling discarded to get them."""

    groups: list[ScoredGroup]
    rounds: int
    dropped_groups: int
    generated: int
    rolled_out: list[ScoredGroup] = field(default_factory=list)
    """Every group sampled this step, kept or dropped (the reward history records them all)."""


def collect_phase(
    engine: TorchEngine,
    cursor: PromptCursor | HiveSource,
    verifier,
    params: ObjectiveParams,
    *,
    prompts_per_step: int,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
) -> Collected:
    """Sample and score groups for one step. With dynamic sampling (DAPO), groups whose rewards are
    all equal carry no signal and are dropped; sampling continues, ``prompts_per_step`` prompts a
    round, until the batch is full or ``max_sampling_rounds`` rounds have run."""
    shaping = overlong_shaping(params, max_new_tokens)
    kept: list[ScoredGroup] = []
    all_groups: list[ScoredGroup] = []
    dropped = generated = rounds = 0
    max_rounds = params.max_sampling_rounds if params.dynamic_sampling else 1
    while len(kept) < prompts_per_step and rounds < max_rounds:
        rounds += 1
        n = prompts_per_step
        if rounds > 1 and isinstance(cursor, HiveSource):
            n = cursor.round_size(
                prompts_per_step - len(kept), dropped / max(1, len(all_groups)), prompts_per_step
            )
        trajectories = sample_phase(
            engine,
            cursor.take(n),
            group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            generator=generator,
        )
        generated += len(trajectories)
        scored = score_phase(trajectories, verifier, shaping)
        cursor.observe(scored)
        all_groups.extend(scored)
        for group in scored:
            if params.dynamic_sampling and len(set(group.correct)) == 1:
                dropped += 1
            else:
                kept.append(group)
    return Collected(kept[:prompts_per_step], rounds, dropped, generated, all_groups)


def update_phase(trainer: PolicyTrainer, groups: Sequence[ScoredGroup]) -> UpdateStats:
    return trainer.update(groups)


def publish_phase(trainer: PolicyTrainer, engine: TorchEngine) -> int:
    engine.load_weights(trainer.publish())
    return engine.version


def step_metrics(
    step: int, collected: Collected, stats: UpdateStats | None, gen_s: float, train_s: float
) -> dict:
    groups = collected.groups
    trajs = [t for g in groups for t in g.trajectories]
    n = max(1, len(trajs))
    n_tokens = sum(len(t.response_tokens) for t in trajs)
    return {
        "step": float(step),
        "reward": sum(r for g in groups for r in g.rewards) / n,
        "accuracy": sum(c for g in groups for c in g.correct) / n,
        "response_length": n_tokens / n,
        "truncated": sum(not t.finished for t in trajs) / n,
        "constant_groups": float(sum(1 for g in groups if len(set(g.correct)) == 1)),
        "dropped_groups": float(collected.dropped_groups),
        "sampling_rounds": float(collected.rounds),
        "trained_trajectories": float(len(trajs)),
        "generated_trajectories": float(collected.generated),
        "loss": stats.loss if stats else float("nan"),
        "grad_norm": stats.grad_norm if stats else float("nan"),
        "gen_seconds": gen_s,
        "train_seconds": train_s,
        "gen_tokens_per_s": n_tokens / max(gen_s, 1e-9),
        "entropy": sum(t.mean_entropy for t in trajs) / n if trajs else float("nan"),
        "clipfrac": float("nan"),
        **({k: float(v) for k, v in stats.metrics.items()} if stats else {}),
    }


def format_step(m: dict, total: int) -> str:
    """One fixed-format line per RL step."""
    return (
        f"step {int(m['step']):4d}/{total} | reward {m['reward']:.3f} | acc {m['accuracy']:.3f} | "
        f"len {m['response_length']:5.1f} | entropy {m['entropy']:.3f} | clipfrac {m['clipfrac']:.3f} | "
        f"dropped {int(m['dropped_groups']):3d} | gen {m['gen_seconds']:.2f}s | "
        f"train {m['train_seconds']:.2f}s | tok/s {m['gen_tokens_per_s']:.0f}"
    )


def run_sync(
    model,
    tokenizer,
    prompts: Sequence[PromptItem],
    verifier,
    params: ObjectiveParams,
    rl,
    *,
    seed: int,
    device: str,
    on_step: Callable[[dict], None] | None = None,
    source: Callable[[PromptCursor, TorchEngine], PromptCursor | HiveSource] | None = None,
    evaluate: Callable[[object], dict[str, float]] | None = None,
    checkpoint_dir: Path | None = None,
) -> RLResult:
    """Synchronous GRPO-family RL: generate a batch of groups with the current weights, score it,
    take one update and refresh the sampler's weights. Trains ``model`` in place. ``rl``:
    ``conf.schema.RLConfig`` (steps, batch, lengths, optimizer, ``eval_every``, ``checkpoint_every``).
    With ``checkpoint_dir`` it writes an atomic checkpoint every ``rl.checkpoint_every`` steps
    (weights, optimizer, RNGs, the prompt source's state, the history) and starts from the last one
    there: every step samples with its own seeded generator, so a resumed run goes on exactly as
    the uninterrupted one would."""
    from training.lora import is_peft, sampling_copy

    torch.manual_seed(seed)
    steps, eval_every = rl.steps, rl.eval_every
    trainer = PolicyTrainer.from_config(model, params, rl, pad_id=tokenizer.pad_token_id, device=device)
    engine = TorchEngine(sampling_copy(model), tokenizer, device=device)
    if is_peft(model):  # the sampler holds the bare base: the adapter arrives as version 0
        publish_phase(trainer, engine)
    cursor = PromptCursor(prompts, seed)
    prompt_source = source(cursor, engine) if source is not None else cursor
    result = RLResult()
    start = (
        _resume_sync(Path(checkpoint_dir), trainer, engine, prompt_source, result) if checkpoint_dir else 1
    )
    for step in range(start, steps + 1):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        t0 = time.perf_counter()
        collected = collect_phase(
            engine,
            prompt_source,
            verifier,
            params,
            prompts_per_step=rl.prompts_per_step,
            group_size=rl.group_size,
            max_new_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            generator=generator,
        )
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        stats = None
        if collected.groups:  # all groups dropped after the last round: no signal, no update
            stats = update_phase(trainer, collected.groups)
            publish_phase(trainer, engine)
        metrics = step_metrics(step, collected, stats, gen_s, time.perf_counter() - t1)
        metrics.update(prompt_source.step_counts())
        if evaluate is not None and eval_every > 0 and step % eval_every == 0 and step < steps:
            metrics.update(evaluate(engine.model))
        result.history.append(metrics)
        result.rewards.extend(
            (step, g.prompt_id, sum(g.correct) / len(g.correct), len(g.correct)) for g in collected.rolled_out
        )
        result.consumed.update(t.prompt.prompt_id for g in collected.groups for t in g.trajectories)
        if checkpoint_dir and rl.checkpoint_every and step % rl.checkpoint_every == 0 and step < steps:
            _checkpoint_sync(Path(checkpoint_dir), step, trainer, prompt_source, result)
        if on_step is not None:
            on_step(metrics)
    trainer.model.eval()
    return result


SYNC_STATE = "sync.json"


def _checkpoint_sync(root: Path, step: int, trainer: PolicyTrainer, source, result: RLResult) -> None:
    from training.rl.checkpoint import save_json, save_trainer_state, write_checkpoint

    def writer(tmp: Path) -> None:
        save_trainer_state(tmp, trainer.model, trainer.opt, version=trainer.version)
        save_json(
            tmp,
            SYNC_STATE,
            {
                "step": step,
                "source": source.state(),
                "history": result.history,
                "consumed": dict(result.consumed),
                "rewards": [list(x) for x in result.rewards],
            },
        )

    write_checkpoint(root, step, writer)


def _resume_sync(root: Path, trainer: PolicyTrainer, engine: TorchEngine, source, result: RLResult) -> int:
    """Restore the last complete checkpoint under ``root`` (if any) into the trainer, the sampler's
    weights, the prompt source and ``result``; returns the step to run next (1 without one)."""
    from training.rl.checkpoint import latest_checkpoint, load_json, load_trainer_state

    ckpt = latest_checkpoint(root) if root.exists() else None
    if ckpt is None:
        return 1
    info = load_trainer_state(ckpt, trainer.model, trainer.opt)
    trainer.version = int(info["version"])
    publish_phase(trainer, engine)
    state = load_json(ckpt, SYNC_STATE)
    source.load_state(state["source"])
    result.history = state["history"]
    result.consumed = Counter(state["consumed"])
    result.rewards = [tuple(x) for x in state["rewards"]]
    logging.getLogger("laminar.training").warning(
        "resuming RL from checkpoint %s (step %d)", ckpt, state["step"]
    )
    return int(state["step"]) + 1
