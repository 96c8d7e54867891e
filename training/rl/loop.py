"""What every RL driver shares (the local, the Ray and the simulated one): the prompt sources
(``PromptCursor``, HIVE's ``HiveSource``), the scoring of finished groups through the reward layer
(``rewards``; DAPO's overlong shaping is one of its components), and the run's result
(``RLResult``). The drivers themselves are in ``training.rl.drivers``; the scheduling they share
is ``training.rl.manager``.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from training.objectives import ObjectiveParams
from conf.schema import EngineOptions, OverlongParams
from generation.records import PromptItem, ScoredGroup, Trajectory
from rewards.components import Overlong, Sample
from rewards.compose import Reward, as_reward
from training.rl.records import StepMetrics

if TYPE_CHECKING:
    from generation.engine import Engine


@dataclass
class RLResult:
    """One ``StepMetrics`` per update, how often each prompt was trained on, and the reward history."""

    history: list[StepMetrics] = field(default_factory=list)
    consumed: Counter = field(default_factory=Counter)
    rewards: list[tuple[int, str, float, int]] = field(default_factory=list)
    """(step, prompt_id, mean correctness, responses) of every rolled-out group: the reward history."""
    terms: list[tuple[int, str, int, str, float]] = field(default_factory=list)
    """(step, prompt_id, sample_idx, component, score) of every rolled-out response (``total``: the
    weighted sum): ``reward_terms.parquet``."""


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
        """A further dynamic-sampling round of the batched modes: the groups still missing."""
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
        engine: Engine,
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

        # a batch takes one group per prompt: draw until the buffer holds n distinct prompts (or the
        # whole pool, when n is larger), not n prompts that may repeat one across an epoch's end
        want = min(n, len({p.prompt_id for p in self.cursor.prompts}))
        for _ in range(1000):  # GRESO never skips with certainty (keep prob >= 0.01): this ends
            if len({p.prompt_id for p in self.buffer}) >= want:
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


def score_phase(trajectories: Sequence[Trajectory], reward, max_new_tokens: int = 0) -> list[ScoredGroup]:
    """Group trajectories by prompt (in first-seen order) and score the batch through the reward layer
    (``reward``: a ``rewards.Reward``, or a bare verifier: the math verifier alone): ``correct`` is
    the correctness verdict, ``rewards`` the weighted total, ``terms`` each component's score. The
    length terms (DAPO's overlong, cosine length) compare ``Trajectory.longest_turn`` with
    ``max_new_tokens``."""
    samples = [
        Sample(t.text, t.prompt.answer, t.longest_turn(), max_new_tokens, t.prompt.text, t.env_state)
        for t in trajectories
    ]
    scores = as_reward(reward).score(samples)
    by_prompt: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        by_prompt.setdefault(t.prompt.prompt_id, []).append(i)
    return [
        ScoredGroup(
            kind="scored_group",
            prompt_id=pid,
            trajectories=tuple(trajectories[i] for i in idx),
            rewards=tuple(scores.total[i] for i in idx),
            correct=tuple(scores.verdicts[i].correct for i in idx),
            terms={name: tuple(v[i] for i in idx) for name, v in scores.terms.items()},
            errors={name: sum(f[i] for i in idx) for name, f in scores.failed.items()},
        )
        for pid, idx in by_prompt.items()
    ]


def rl_reward(reward, params: ObjectiveParams) -> Reward:
    """The reward RL trains on: ``reward`` plus DAPO's overlong component when the objective's preset
    (or ``rl.overlong_shaping``) turns it on and ``reward.components`` has none."""
    out = as_reward(reward)
    if params.overlong_shaping:
        out = out.with_component(Overlong(OverlongParams(cache_len=params.overlong_cache_len)))
    return out


def group_scorer(
    reward, params: ObjectiveParams, max_new_tokens: int
) -> Callable[[list[Trajectory]], ScoredGroup]:
    """The manager's ``score``: one finished group (its trajectories) scored through the reward layer
    (``rl_reward``)."""
    composed = rl_reward(reward, params)
    return lambda trajs: score_phase(trajs, composed, max_new_tokens)[0]


def keep_filter(params: ObjectiveParams) -> Callable[[ScoredGroup], bool] | None:
    """The manager's ``keep``: with dynamic sampling (DAPO) a group whose responses are all equally
    correct carries no signal and is dropped; None keeps every group."""
    return (lambda g: len(set(g.correct)) > 1) if params.dynamic_sampling else None


def policy_copy(model_dir: Path) -> Engine:
    """The driver's own copy of the policy on the CPU (HIVE's prompt entropy), at version 0, or -1 for
    an adapter folder (the bare base: the adapter arrives with the first refresh)."""
    from generation.adapter import is_adapter_dir, model_dir_for_sampling
    from generation.engine import Engine
    from generation.model import load_model

    model, tokenizer = load_model(model_dir_for_sampling(model_dir), "cpu")
    engine = Engine(
        model, tokenizer, EngineOptions(capacity=256), device="cpu"
    )  # prompt entropy: 256 at a time
    engine.version = -1 if is_adapter_dir(model_dir) else 0
    return engine
