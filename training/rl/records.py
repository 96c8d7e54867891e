"""Typed records of the RL system: what an optimizer step did and what every trainer, relay and
rollout actor replies to the driver. No string-keyed dict crosses a process boundary inside the
project; generation's own records (prompts, requests, trajectories) live in ``generation.records``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from rewards.components import repeated_ngram_rate


@dataclass(frozen=True)
class UpdateStats:
    """What one optimizer step did; ``version`` is the trainer's weight version after the step."""

    kind: Literal["update_stats"]
    version: int
    loss: float
    grad_norm: float
    n_sequences: int
    n_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------------- actor replies
@dataclass(frozen=True)
class ActorInfo:
    """Any role's answer to ``ping``: who and where it is, and its process's CPU seconds so far.
    ``version``: the weights it holds (rollout, trainer; None before a trainer is built);
    ``versions``: what a relay holds; ``rank``: a trainer rank; ``idle_priority``: a rollout runs
    at SCHED_IDLE."""

    name: str
    pid: int
    node: str
    cpu_s: float
    version: int | None = None
    versions: tuple[int, ...] = ()
    rank: int | None = None
    idle_priority: bool = False


@dataclass(frozen=True)
class RolloutStatus:
    """A rollout engine's state after a call: its weights' version, sequences in flight (``active``)
    and waiting (``queued``) in at most ``capacity`` slots; ``parked``: of ``active``, episodes between
    turns that pin no weights (``environments.episodes``, the turn rule)."""

    version: int
    active: int
    queued: int
    capacity: int
    admitting: bool = True
    parked: int = 0

    @classmethod
    def of(cls, status: dict) -> RolloutStatus:
        """From an engine's protocol status (``generation.protocol``: a msgpack map on the worker's wire)."""
        return cls(
            version=int(status["version"]),
            active=int(status["active"]),
            queued=int(status["queued"]),
            capacity=int(status["capacity"]),
            admitting=bool(status.get("admitting", True)),
            parked=int(status.get("parked", 0)),
        )


@dataclass(frozen=True)
class PullResult:
    """A rollout's weight pull from its relay: ``ok`` with the ``version`` loaded, else ``error``."""

    ok: bool
    version: int = -1
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class StepReply:
    """A rollout's ``step``: the trajectories that finished, its status, the pull it made first (if
    asked), the seconds it decoded, and its process (a new pid: Ray restarted it between calls)."""

    finished: tuple
    status: RolloutStatus
    pulled: PullResult | None
    busy_s: float
    pid: int
    cpu_s: float


@dataclass(frozen=True)
class ExtractReply:
    """A repack source's ``extract``: its in-flight responses (``Partial``) and its queued requests."""

    partials: tuple
    queued: tuple
    status: RolloutStatus
    pid: int
    cpu_s: float


@dataclass(frozen=True)
class TrainReply:
    """The trainer's ``train``: the update's stats, its seconds, and the publish stall after it (wall
    and the trainer thread's CPU)."""

    stats: UpdateStats
    train_s: float
    publish_stall_s: float
    publish_cpu_s: float


@dataclass(frozen=True)
class Published:
    """A relay's answer to ``latest``/``get``: a weight version and the box (``[ObjectRef]``) holding it."""

    version: int
    box: list


# ------------------------------------------------------------------------------- manager orders
@dataclass(frozen=True)
class StepOrder:
    """The manager's order for a rollout's next ``step``: pull first (at least ``min_version``; -1:
    the relay's latest), whether it may start queued requests, the new requests and the handed-over
    partials it takes."""

    submit: tuple
    inject: tuple
    pull: bool
    min_version: int
    admitting: bool


@dataclass(frozen=True)
class ExtractOrder:
    """The manager's order to a repack source: hand every in-flight response to rollout ``dst``."""

    dst: str


# ------------------------------------------------------------------------------- step metrics
@dataclass
class StepMetrics:
    """One RL update's metrics: one line of ``history.jsonl`` and one tracker record. Every driver
    builds it with :meth:`of` (the manager, from the groups it trained); ``as_dict`` is the flat form
    the history, the trackers and the checkpoints hold (keys named as the fields, every value a
    float), ``from_dict`` its inverse. ``extra`` holds what the update's objective (``UpdateStats
    .metrics``), the prompt source (``step_counts``) and the in-run evaluation add under their own
    names."""

    step: int
    reward: float
    accuracy: float
    response_length: float
    truncated: float
    constant_groups: int
    dropped_groups: int
    sampling_rounds: int
    trained_trajectories: int
    generated_trajectories: int
    trained_tokens: int
    loss: float
    grad_norm: float
    entropy: float
    clipfrac: float
    staleness_mean: float
    staleness_max: float
    # timings and throughput (``training.rl.stage.TIMING_KEYS`` leaves them out of history.jsonl)
    gen_seconds: float
    train_seconds: float
    gen_tokens_per_s: float
    tokens_per_s: float
    occupancy: float
    repacks: int
    publish_stall_s: float = 0.0
    publish_cpu_s: float = 0.0
    wall_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        step: int,
        groups,
        stats: UpdateStats | None,
        *,
        dropped_groups: int,
        sampling_rounds: int,
        generated: int,
        generated_tokens: int,
        staleness: list[int],
        occupancy: float,
        repacks: int,
        wall: float,
        train_s: float,
    ) -> StepMetrics:
        """From the ``ScoredGroup``s the update trained on and its ``stats`` (None: no update ran);
        ``wall``: seconds since the last update, ``train_s`` of them in the update."""
        trajs = [t for g in groups for t in g.trajectories]
        n = max(1, len(trajs))
        n_tokens = sum(len(t.response_tokens) for t in trajs)
        objective = {k: float(v) for k, v in stats.metrics.items()} if stats else {}
        nan = float("nan")
        return cls(
            step=step,
            reward=sum(r for g in groups for r in g.rewards) / n,
            accuracy=sum(c for g in groups for c in g.correct) / n,
            response_length=n_tokens / n,
            truncated=sum(not t.finished for t in trajs) / n,
            constant_groups=sum(1 for g in groups if len(set(g.correct)) == 1),
            dropped_groups=dropped_groups,
            sampling_rounds=sampling_rounds,
            trained_trajectories=len(trajs),
            generated_trajectories=generated,
            trained_tokens=n_tokens,
            loss=stats.loss if stats else nan,
            grad_norm=stats.grad_norm if stats else nan,
            entropy=objective.pop("entropy", sum(t.mean_entropy for t in trajs) / n if trajs else nan),
            clipfrac=objective.pop("clipfrac", nan),
            staleness_mean=sum(staleness) / max(1, len(staleness)),
            staleness_max=float(max(staleness) if staleness else 0),
            gen_seconds=max(0.0, wall - train_s),
            train_seconds=train_s,
            gen_tokens_per_s=generated_tokens / max(wall, 1e-9),
            tokens_per_s=n_tokens / max(wall, 1e-9),
            occupancy=occupancy,
            repacks=repacks,
            extra={
                **reward_term_means(groups),
                **length_metrics(groups),
                **episode_metrics(trajs),
                **{k: v for k, v in objective.items() if k not in _STEP_NAMES},  # the manager's win
            },
        )

    def as_dict(self) -> dict[str, float]:
        out = {f.name: float(getattr(self, f.name)) for f in _STEP_FIELDS}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> StepMetrics:
        """What ``as_dict`` wrote (a checkpoint's history)."""
        names = {f.name: f.type for f in _STEP_FIELDS}
        missing = [k for k in names if k not in d]
        if missing:
            raise ValueError(f"a step's metrics lack {missing}: not written by StepMetrics.as_dict")
        kw = {k: (int(d[k]) if t == "int" else float(d[k])) for k, t in names.items()}
        return cls(**kw, extra={k: float(v) for k, v in d.items() if k not in names})

    def line(self, total: int) -> str:
        """One fixed-format line per RL step (with each reward term's mean when there are several)."""
        terms = {k.removeprefix("reward/"): v for k, v in self.extra.items() if k.startswith("reward/")}
        shaped = "".join(f" | {k} {v:.3f}" for k, v in terms.items()) if len(terms) > 1 else ""
        if "episode/tool_calls" in self.extra:
            shaped += (
                f" | tools {self.extra['episode/tool_calls']:.2f} | turns {self.extra['episode/turns']:.2f}"
            )
        return (
            f"step {self.step:4d}/{total} | reward {self.reward:.3f} | acc {self.accuracy:.3f} | "
            f"len {self.response_length:5.1f} | entropy {self.entropy:.3f} | clipfrac {self.clipfrac:.3f} | "
            f"dropped {self.dropped_groups:3d} | gen {self.gen_seconds:.2f}s | "
            f"train {self.train_seconds:.2f}s | tok/s {self.gen_tokens_per_s:.0f}{shaped}"
        )


def episode_metrics(trajs) -> dict[str, float]:
    """Multi-turn episodes' means (none for single-turn responses): tool calls, tool errors and
    policy turns per episode, the share that ended failed (environment crash, tool timeout) and the
    policy's share of the episode tokens."""
    eps = [t for t in trajs if t.loss_mask]
    if not eps:
        return _agent_metrics(trajs)
    n = len(eps)
    return {
        "episode/tool_calls": sum(t.tool_calls for t in eps) / n,
        "episode/tool_errors": sum(t.tool_errors for t in eps) / n,
        "episode/turns": sum(t.turns for t in eps) / n,
        "episode/failed": sum(t.end_reason in ("env_error", "tool_timeout") for t in eps) / n,
        "episode/policy_token_share": sum(sum(t.loss_mask) for t in eps)
        / max(1, sum(len(t.loss_mask) for t in eps)),
        **_agent_metrics(trajs),
    }


def _agent_metrics(eps) -> dict[str, float]:
    """Agent episodes (``environments.agents``; their state has a ``session``, an episode whose agent
    failed before its first request included): the share whose client rewrote its history (kept with
    loss mask 0 only), the share that ended on an agent fault and the share with a request served at
    the run's sampling instead of its own (``sampling: run`` in ``env.params``)."""
    agents = [t for t in eps if isinstance(t.env_state, dict) and "session" in t.env_state]
    if not agents:
        return {}
    n = len(agents)
    faults = ("agent_error", "agent_timeout", "agent_exit", "agent_capacity", "agent_cancelled")
    return {
        "episode/agent_mismatch": sum(bool(t.env_state.get("mismatches")) for t in agents) / n,
        "episode/agent_failed": sum(t.end_reason in faults for t in agents) / n,
        "episode/agent_sampling_overridden": sum(bool(t.env_state.get("sampling_overridden")) for t in agents)
        / n,
    }


def length_metrics(groups) -> dict[str, float]:
    """What length shaping acts on: the mean length (tokens) of the correct and of the wrong responses
    (left out when there are none) and their mean repeated word-3-gram rate."""
    pairs = [(len(t.response_tokens), c) for g in groups for t, c in zip(g.trajectories, g.correct)]
    right = [n for n, c in pairs if c]
    wrong = [n for n, c in pairs if not c]
    texts = [t.text for g in groups for t in g.trajectories]
    out = {"repeated_ngram_rate": sum(repeated_ngram_rate(x, 3) for x in texts) / max(1, len(texts))}
    if right:
        out["response_length_correct"] = sum(right) / len(right)
    if wrong:
        out["response_length_wrong"] = sum(wrong) / len(wrong)
    return out


def reward_term_means(groups) -> dict[str, float]:
    """``reward/<name>``: each reward component's mean over the groups' responses (unweighted; the
    weighted total is ``reward``), and ``reward_errors/<name>``: responses that got its fallback."""
    n = max(1, sum(len(g.trajectories) for g in groups))
    sums: dict[str, float] = {}
    errors: dict[str, float] = {}
    for g in groups:
        for name, values in g.terms.items():
            sums[name] = sums.get(name, 0.0) + sum(values)
        for name, count in g.errors.items():
            errors[name] = errors.get(name, 0.0) + count
    return {
        **{f"reward/{k}": v / n for k, v in sums.items()},
        **{f"reward_errors/{k}": v for k, v in errors.items()},
    }


_STEP_FIELDS = tuple(f for f in fields(StepMetrics) if f.name != "extra")
_STEP_NAMES = frozenset(f.name for f in _STEP_FIELDS)
