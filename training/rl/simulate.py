"""A discrete-event simulator of the Laminar runtime at cluster scale.

The simulator drives the *same* control plane as the real runtime (``training.rl.control``): the
prompt queue, the experience buffer (whole groups, staleness bound, train-once), the mode's
per-rollout decision (``dispatch_plan``), the batch gate (``may_open_batch``, ``round_robin_groups``),
the repack planner (``plan_repack`` over ``RolloutView``\\ s) and the relay chain (``RelayChain``).
Only the rollout engines and the trainer are replaced, by cost models on a simulated clock (a heap
of events), so a scheduling change in ``control`` shows up here and in the real system alike.

**Engines.** A rollout engine is a continuous batch of at most ``capacity`` sequences. Between two
events its batch is constant, so it advances straight to its next completion (or to the end of a
chunk of ``chunk_steps`` decode steps when ``chunk_steps > 0``, as the real runtime's calls do):
``k`` decode steps cost ``k * decode_step_s(batch, mean context)``. Admitting sequences costs a
prefill of their tokens (prompt, plus the tokens so far for a handed-over or interrupted response:
re-prefill). With ``chunk_steps = 0`` a call lasts until the engine's next completion, and the
manager "pokes" a busy engine when it needs it sooner (new work, an interrupt, a repack extraction):
the call is cut at that instant, which stands for the real runtime's chunk boundary (a fraction of a
second, negligible at cluster scale).

**Decode cost.** Either measured points ``decode_points = [[batch, seconds], ...]`` (at context
``decode_points_ctx``, interpolated linearly in the batch; context adds ``kv_bytes_per_token`` over
the memory bandwidth) or a roofline for ``gpus_per_engine`` GPUs (tensor parallel)::

    step = overhead + tp_latency * layers * [tp > 1]
           + max((weights + B * ctx * kv_bytes_per_token) / (tp * hbm_bw * mem_eff),
                 2 * params * B / (tp * flops * mfu_decode))

**Trainer.** ``train_flops_per_token * params`` (default 8: forward + backward, 6N, plus the
old-log-prob forward, 2N) plus attention (``12 * layers * hidden * ctx / 2`` per token) over
``trainer_gpus * flops * mfu_train``, plus ``train_step_overhead_s`` per update. After an update the
trainer stalls for ``weights / (trainer_gpus * d2h_bw)`` (its copy to host memory, the relay push),
then goes on; the master relay forwards along the chain (pipelined: relay ``k`` holds it after
``weights / relay_bw + k * hop_s``); a rollout pulls from its node's relay in
``weights / (tp * h2d_bw) + pull_overhead_s``.

**Modes** (``SIM_MODES``): the runtime's ``sync | one_step | partial | laminar`` (``control.MODES``)
plus a simulator-only ``stream``: one-step off-policy with streamed training (StreamRL-style: the
trainer starts forward/backward on each group as soon as it is complete, and takes the optimizer step
once the batch is in). ``colocate_sync`` (default on): ``sync`` runs generation and training on all
GPUs in turn (verl's hybrid engine, the Laminar paper's sync baseline) with a ``reshard_s`` weight switch;
every other mode splits the GPUs into a trainer and rollouts (``trainer_gpus``).

**Lengths.** ``lognormal`` with a median and p99/median ratio, a per-prompt share of the log-variance
(``group_corr``: responses to a hard prompt are long together), truncated at ``max_output``; or a
``mixture`` of such components (weights, medians, sigmas) chosen per prompt; or ``values`` (lengths
from a real run, drawn per response).

**Back-pressure** (``sched.max_ahead_batches``, simulator only, off by default like the runtime):
the continuous modes issue prompts only while issued-but-untrained groups stay within that many
batches. Without it a trainer-bound run keeps generating (the buffer grows, as in the runtime).

**CPU sharing** (calibration only): with ``shared_cores > 0`` every busy rollout and a busy trainer
share that many cores (one thread each): each runs at ``min(1, shared_cores / busy)`` speed. This is
how the real runtime behaves on the 2-core machine its throughput benchmark ran on.

The simulator never touches Ray or torch; one mode of 1,024 GPUs x several steps of 512 x 16
responses up to 16K tokens takes seconds.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from generation.records import GenRequest, Partial, PromptItem, ScoredGroup, Trajectory
from training.rl.control import MODES, ModeSpec, RelayChain
from training.rl.manager import ManagerSettings, RolloutManager
from training.rl.records import ExtractOrder, PullResult, RolloutStatus

STREAM = ModeSpec("stream", batched=True, max_ahead=1, interrupt=False, drain=False, repack=False)
SIM_MODES: dict[str, ModeSpec] = {**MODES, "stream": STREAM}
"""The runtime's modes plus ``stream`` (simulator only: never in the real config's ``rl.mode``)."""
STREAMED_TRAINING = {"stream"}


# ============================================================================================ config
@dataclass
class ClusterSpec:
    """Cluster shape. ``trainer_gpus = 0``: ``trainer_share`` of the GPUs (rounded to whole nodes when
    there are several nodes). ``gpus_per_engine``: tensor-parallel size of one rollout engine."""

    nodes: int = 128
    gpus_per_node: int = 8
    trainer_gpus: int = 0
    trainer_share: float = 0.5
    """Used when ``trainer_gpus = 0``; 0 = balanced: the split where one update's training takes as long
    as generating its tokens on the remaining GPUs at full occupancy (see ``balanced_trainer_gpus``)."""
    gpus_per_engine: int = 1
    colocate_sync: bool = True


@dataclass
class ModelSpec:
    """Model size. ``kv_bytes_per_token = 0``: ``2 * layers * kv_heads * head_dim * bytes_per_param``."""

    name: str = "qwen2.5-7b"
    params_b: float = 7.6
    layers: int = 28
    hidden: int = 3584
    kv_heads: int = 4
    head_dim: int = 128
    bytes_per_param: float = 2.0
    kv_bytes_per_token: float = 0.0

    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    def kv_per_token(self) -> float:
        return (
            self.kv_bytes_per_token
            or 2.0 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param
        )


@dataclass
class LengthSpec:
    """Response lengths. ``kind``: ``lognormal`` (``median``, ``p99_over_median``, ``group_corr``),
    ``mixture`` (per prompt: component ``i`` with probability ``weights[i]``, lognormal around
    ``medians[i]`` with log-sd ``sigmas[i]``; within a group the spread is ``sigmas[i]``), or
    ``values`` (each response draws one of ``values``). Always clipped to ``[1, max_output]``."""

    kind: str = "lognormal"
    median: float = 1500.0
    p99_over_median: float = 10.0
    group_corr: float = 0.5
    weights: list = field(default_factory=list)
    medians: list = field(default_factory=list)
    sigmas: list = field(default_factory=list)
    values: list = field(default_factory=list)


@dataclass
class WorkloadSpec:
    prompts_per_step: int = 512
    group_size: int = 16
    steps: int = 6
    max_output: int = 16384
    prompt_len: int = 256
    lengths: LengthSpec = field(default_factory=LengthSpec)
    pass_rates: list = field(default_factory=list)
    """Each prompt's chance that a response is right, drawn per prompt from this list (empty: every
    response is wrong, rewards are not modelled)."""


@dataclass
class CostSpec:
    """Hardware and cost model (defaults: H800/H100 SXM class, see the module docstring)."""

    hbm_gbps: float = 3350.0
    flops_tflops: float = 989.0
    mem_eff: float = 0.7
    mfu_decode: float = 0.5
    mfu_prefill: float = 0.5
    mfu_train: float = 0.35
    decode_overhead_s: float = 0.004
    tp_latency_s: float = 2e-5
    """Per layer and decode step when an engine spans several GPUs (two all-reduces)."""
    decode_points: list = field(default_factory=list)
    """Measured ``[[batch, seconds per decode step], ...]``; empty: the roofline."""
    decode_points_ctx: float = 0.0
    prefill_s_per_token: float = 0.0
    """> 0: measured prefill cost per token (instead of the FLOP model)."""
    prefill_overhead_s: float = 0.0
    train_flops_per_token: float = 8.0
    """x params: 6 (forward + backward) + 2 (old log-probs)."""
    train_s_per_token: float = 0.0
    train_gen_share: float = 0.0
    """> 0: set ``mfu_train`` so that generation is this share of a colocated synchronous step (the
    paper states 0.83 for its setting); ``mfu_train`` is then an output, reported as implied MFU."""
    """> 0: measured training seconds per token on the whole trainer (instead of the FLOP model)."""
    train_step_overhead_s: float = 1.0
    d2h_gbps: float = 25.0
    relay_gbps: float = 100.0
    relay_hop_s: float = 0.01
    h2d_gbps: float = 25.0
    pull_overhead_s: float = 0.2
    reshard_s: float = 2.0
    """Colocated sync: switching the GPUs between the trainer's and the engines' weights."""
    extract_s: float = 0.01
    kv_mem_share: float = 0.85
    """Share of an engine's memory left after weights that holds KV cache (sets the auto capacity)."""
    gpu_mem_gb: float = 80.0
    shared_cores: float = 0.0


@dataclass
class SchedSpec:
    """The runtime's knobs (``rl.*`` of the real config). ``capacity = 0``: from KV memory at the
    mean response length (at most ``max_capacity``). ``max_staleness``: None = unbounded (the Laminar paper)."""

    capacity: int = 0
    max_capacity: int = 512
    chunk_steps: int = 0
    call_overhead_s: float = 0.0
    repack_interval_s: float = 5.0
    repack_b: int = 0
    max_staleness: int | None = None
    admit_lag: int = 1
    keep_versions: int = 2
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (the manager's rule): groups with no reward variance are dropped; batched
    modes sample further rounds, at most ``max_sampling_rounds``, until the batch is full."""
    max_sampling_rounds: int = 10
    max_ahead_batches: int = 0
    """Simulator-only back-pressure for the continuous modes (the runtime's own flow control, also
    modelled here, acts only under ``max_staleness``): new prompts
    are issued only while issued-but-untrained groups stay within this many batches (0 = unbounded).
    It stands for a bounded experience buffer / AReaL-style admission control; without it a
    trainer-bound run generates without limit (and the simulation slows with it)."""


@dataclass
class SimConfig:
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    cost: CostSpec = field(default_factory=CostSpec)
    sched: SchedSpec = field(default_factory=SchedSpec)
    modes: list = field(default_factory=lambda: ["sync", "one_step", "stream", "partial", "laminar"])
    seed: int = 0
    warmup_updates: int = 1
    """Updates left out of the steady-state throughput (pipeline fill)."""
    timeline_rollouts: int = 16
    """Rollouts whose occupancy the timeline records (evenly spread); 0 = all."""


def _build(cls, data: Mapping[str, Any] | None):
    """A dataclass from a (nested) mapping, refusing unknown keys."""
    data = dict(data or {})
    kw = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key not in names:
            raise KeyError(f"unknown simulator key {cls.__name__}.{key}")
        default = (
            names[key].default_factory() if names[key].default_factory is not dataclasses.MISSING else None
        )
        kw[key] = (
            _build(type(default), value)
            if dataclasses.is_dataclass(default) and isinstance(value, Mapping)
            else (list(value) if isinstance(value, (list, tuple)) else value)
        )
    return cls(**kw)


def config_from_dict(data: Mapping[str, Any]) -> SimConfig:
    return _build(SimConfig, data)


# ============================================================================================ costs
class CostModel:
    def __init__(self, cfg: SimConfig, gpus_per_engine: int, trainer_gpus: int):
        self.c = cfg.cost
        self.m = cfg.model
        self.tp = gpus_per_engine
        self.trainer_gpus = trainer_gpus
        self.params = self.m.params_b * 1e9
        self.w = self.m.weight_bytes()
        self.kv = self.m.kv_per_token()
        pts = sorted((float(b), float(s)) for b, s in self.c.decode_points)
        self.pts_b = [b for b, _ in pts]
        self.pts_s = [s for _, s in pts]

    def decode_step_s(self, batch: int, ctx: float) -> float:
        c = self.c
        if self.pts_b:
            b, s = self.pts_b, self.pts_s
            if len(b) == 1:
                t = s[0] * max(1.0, batch / b[0]) if batch > b[0] else s[0]
            else:
                i = min(max(bisect.bisect_left(b, batch), 1), len(b) - 1)
                t = s[i - 1] + (s[i] - s[i - 1]) * (batch - b[i - 1]) / (b[i] - b[i - 1])
                t = max(t, s[0] * 0.5)
            extra_ctx = max(0.0, ctx - c.decode_points_ctx) if c.decode_points_ctx else 0.0
            return t + batch * extra_ctx * self.kv / (c.hbm_gbps * 1e9 * c.mem_eff * self.tp)
        mem = (self.w + batch * ctx * self.kv) / (self.tp * c.hbm_gbps * 1e9 * c.mem_eff)
        comp = 2.0 * self.params * batch / (self.tp * c.flops_tflops * 1e12 * c.mfu_decode)
        tp = c.tp_latency_s * self.m.layers if self.tp > 1 else 0.0
        return c.decode_overhead_s + tp + max(mem, comp)

    def prefill_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        c = self.c
        if c.prefill_s_per_token > 0:
            return c.prefill_overhead_s + tokens * c.prefill_s_per_token
        comp = 2.0 * self.params * tokens / (self.tp * c.flops_tflops * 1e12 * c.mfu_prefill)
        mem = self.w / (self.tp * c.hbm_gbps * 1e9 * c.mem_eff)
        return c.prefill_overhead_s + max(comp, mem)

    def train_s(self, tokens: int, ctx_tokens: float) -> float:
        """One update on ``tokens`` response tokens whose mean context is ``ctx_tokens``."""
        c = self.c
        if c.train_s_per_token > 0:
            return c.train_step_overhead_s + tokens * c.train_s_per_token
        attn = 12.0 * self.m.layers * self.m.hidden * ctx_tokens / 2.0
        flops = tokens * (c.train_flops_per_token * self.params + attn)
        return c.train_step_overhead_s + flops / (self.trainer_gpus * c.flops_tflops * 1e12 * c.mfu_train)

    def publish_stall_s(self) -> float:
        return self.w / (self.trainer_gpus * self.c.d2h_gbps * 1e9)

    def relay_arrival_s(self, hop: int) -> float:
        return self.w / (self.c.relay_gbps * 1e9) + hop * self.c.relay_hop_s

    def pull_s(self) -> float:
        return self.w / (self.tp * self.c.h2d_gbps * 1e9) + self.c.pull_overhead_s

    def auto_capacity(self, mean_ctx: float, max_capacity: int) -> int:
        free = (self.c.gpu_mem_gb * 1e9 * self.tp - self.w) * self.c.kv_mem_share
        if free <= 0:
            raise ValueError(
                f"{self.m.name} does not fit {self.tp} GPU(s) of {self.c.gpu_mem_gb:g} GB: "
                "raise cluster.gpus_per_engine"
            )
        return max(1, min(max_capacity, int(free / (self.kv * max(1.0, mean_ctx)))))


# ============================================================================================ lengths
class LengthSampler:
    """Deterministic per (seed, prompt index): a list of ``group_size`` response lengths."""

    def __init__(self, spec: LengthSpec, max_output: int, group_size: int, seed: int):
        self.s = spec
        self.max = max_output
        self.g = group_size
        self.seed = seed
        if spec.kind not in ("lognormal", "mixture", "values"):
            raise ValueError(f"workload.lengths.kind={spec.kind!r}: expected lognormal, mixture or values")
        if spec.kind == "mixture" and not (len(spec.weights) == len(spec.medians) == len(spec.sigmas) > 0):
            raise ValueError("workload.lengths mixture needs weights, medians and sigmas of one length")
        if spec.kind == "values" and not spec.values:
            raise ValueError("workload.lengths.kind=values needs workload.lengths.values")

    def group(self, index: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + index)
        s = self.s
        if s.kind == "values":
            return [self._clip(rng.choice(s.values)) for _ in range(self.g)]
        if s.kind == "mixture":
            u, acc, k = rng.random() * sum(s.weights), 0.0, 0
            for k, w in enumerate(s.weights):
                acc += w
                if u <= acc:
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


class _Source:
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


# ============================================================================================ state
@dataclass
class _Row:
    key: tuple
    req: GenRequest
    target: int
    pre: int
    s_admit: float
    version: int


@dataclass
class _SimRollout:
    """A simulated rollout engine (the manager keeps its scheduling state: ``RolloutManager.rollouts``)."""

    name: str
    index: int
    capacity: int
    busy: bool = False
    op: str = ""
    epoch: int = 0
    rows: list = field(default_factory=list)  # heap of (finish_at, seq, _Row)
    row_seq: int = 0
    S: float = 0.0  # decode steps performed (the engine's clock)
    sum_c0: float = 0.0
    queue: deque = field(default_factory=deque)  # submitted GenRequests not yet admitted
    partials: deque = field(
        default_factory=deque
    )  # injected Partials not yet admitted (tokens so far: Simulator.pre)
    admitting: bool = True
    eversion: int = -1  # the engine's loaded weights
    finished: list = field(default_factory=list)
    seg_start: float = 0.0
    seg_work: float = 0.0  # seconds of work at full speed in this segment
    seg_done: float = 0.0
    seg_speed: float = 1.0
    seg_steps: float = 0.0  # decode steps in this segment (0: prefill/pull)
    chunk_left: float = 0.0
    pull_version: int = -1
    pulled: bool = False  # this call pulled weights
    cut_req: bool = False
    # accounting
    busy_active_s: float = 0.0
    last_t: float = 0.0
    occ_s: float = 0.0


@dataclass
class ModeResult:
    mode: str
    updates: int
    wall_s: float
    trained_tokens: int
    tokens_per_s: float
    steady_tokens_per_s: float
    idle_share: float
    mean_occupancy: float
    staleness_histogram: dict
    repacks: int
    pulls: int
    interrupts: int
    update_times: list
    step_seconds: list
    generation_share: float
    rollouts: int
    trainer_gpus: int
    rollout_gpus: int
    capacity: int
    events: int
    trained_groups: int
    trained_uids: list
    timeline: dict
    stale_dropped: int = 0
    """Groups that outgrew ``max_staleness`` in the buffer and were generated again."""
    dropped_groups: int = 0
    """Groups dynamic sampling dropped (no reward variance)."""
    extra_rounds: int = 0
    """Further sampling rounds batched modes took to fill their batches (dynamic sampling)."""
    empty_batches: int = 0

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("timeline")
        d.pop("trained_uids")
        return d


# ============================================================================================ simulator
class Simulator:
    """One mode on one config. ``run()`` returns a :class:`ModeResult`."""

    def __init__(self, cfg: SimConfig, mode: str):
        if mode not in SIM_MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {sorted(SIM_MODES)}")
        self.cfg = cfg
        self.mode = dataclasses.replace(SIM_MODES[mode], admit_lag=cfg.sched.admit_lag)
        self.streamed = mode in STREAMED_TRAINING
        cl, wl, sc = cfg.cluster, cfg.workload, cfg.sched
        total = cl.nodes * cl.gpus_per_node
        if total < 2 or cl.gpus_per_engine < 1 or total % cl.gpus_per_engine:
            raise ValueError(f"{total} GPUs cannot hold engines of {cl.gpus_per_engine} GPUs")
        self.colocated = mode == "sync" and cl.colocate_sync
        if self.colocated:
            trainer_gpus, rollout_gpus = total, total
        else:
            trainer_gpus = cl.trainer_gpus or self._auto_trainer_gpus(total)
            rollout_gpus = total - trainer_gpus
        if rollout_gpus < cl.gpus_per_engine or trainer_gpus < 1:
            raise ValueError(
                f"trainer {trainer_gpus} GPUs leaves {rollout_gpus} for rollouts of "
                f"{cl.gpus_per_engine} GPUs each"
            )
        self.trainer_gpus, self.rollout_gpus = trainer_gpus, rollout_gpus
        self.cost = CostModel(cfg, cl.gpus_per_engine, trainer_gpus)
        self.sampler = LengthSampler(wl.lengths, wl.max_output, wl.group_size, cfg.seed)
        self.mean_len = self.sampler.mean()
        self.capacity = sc.capacity or self.cost.auto_capacity(wl.prompt_len + self.mean_len, sc.max_capacity)
        self.b = sc.repack_b or self.capacity
        self.n = wl.prompts_per_step
        self.steps = wl.steps
        self.source = _Source(self.sampler, wl.prompt_len, wl.pass_rates, cfg.seed)
        n_rollouts = rollout_gpus // cl.gpus_per_engine
        per_node = max(1, cl.gpus_per_node // cl.gpus_per_engine)
        first_node = (
            0 if self.colocated else math.ceil(trainer_gpus / cl.gpus_per_node) if cl.nodes > 1 else 0
        )
        nodes_used = sorted(
            {f"node-{(first_node + i // per_node) % cl.nodes}" for i in range(n_rollouts)},
            key=lambda s: int(s.split("-")[1]),
        )
        self.chain = RelayChain([(f"relay-{i}", node) for i, node in enumerate(nodes_used)])
        self.rollouts: dict[str, _SimRollout] = {}
        placed = []
        for i in range(n_rollouts):
            node = f"node-{(first_node + i // per_node) % cl.nodes}"
            name = f"rollout-{i}"
            self.rollouts[name] = _SimRollout(name, i, self.capacity)
            placed.append((name, node, self.chain.relay_for(node)))
        self.rlist = list(self.rollouts.values())
        settings = ManagerSettings(
            mode=self.mode,
            steps=wl.steps,
            prompts_per_step=wl.prompts_per_step,
            group_size=wl.group_size,
            capacity=self.capacity,
            max_staleness=None if mode == "sync" else sc.max_staleness,
            repack_b=self.b,
            max_sampling_rounds=sc.max_sampling_rounds if sc.dynamic_sampling else 1,
            max_ahead_batches=sc.max_ahead_batches,
        )
        keep = (lambda g: len(set(g.correct)) > 1) if sc.dynamic_sampling else None
        self.m = RolloutManager(settings, self.source, self.source.score, self, placed, keep=keep)
        """The rollout manager the real runtime drives, driven here by the event clock."""
        self.pre: dict[tuple[int, int], int] = {}
        """Tokens generated so far of each handed-over response (its Partial carries no tokens here)."""
        k = cfg.timeline_rollouts
        if k and k < n_rollouts:
            idx = sorted({round(i * (n_rollouts - 1) / (k - 1)) for i in range(k)}) if k > 1 else [0]
            self.traced = {self.rlist[i].name for i in idx}
        else:
            self.traced = set(self.rollouts)
        self.timeline: dict = {
            "rollouts": [r.name for r in self.rlist if r.name in self.traced],
            "samples": [],
            "events": [],
            "updates": [],
        }

    def _auto_trainer_gpus(self, total: int) -> int:
        cl = self.cfg.cluster
        if cl.trainer_share > 0:
            want = max(1, round(total * cl.trainer_share))
        else:
            want = balanced_trainer_gpus(self.cfg)
        if cl.nodes > 1 and want >= cl.gpus_per_node:
            want = max(cl.gpus_per_node, round(want / cl.gpus_per_node) * cl.gpus_per_node)
        return max(1, min(want, total - self.cfg.cluster.gpus_per_engine))

    # ------------------------------------------------------------------------------------ helpers
    @property
    def version(self) -> int:
        return self.m.version

    @property
    def queue(self):
        return self.m.queue

    @property
    def buffer(self):
        return self.m.buffer

    # ------------------------------------------------------------------------------------ Outside
    def refresh(self) -> None:
        """The simulated prompt source holds no policy."""

    def poke(self, rollout: str) -> None:
        self._poke(self.rollouts[rollout])

    def note(self, rollout: str, kind: str, version: int) -> None:
        if rollout in self.traced:
            self.timeline["events"].append(
                {"t": self.now, "rollout": rollout, "kind": kind, "version": version}
            )

    def _push(self, t: float, kind: str, obj=None, epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, epoch))

    def _sample(self, r: _SimRollout) -> None:
        if r.name in self.traced:
            self.timeline["samples"].append(
                {
                    "t": self.now,
                    "rollout": r.name,
                    "occupancy": len(r.rows) / r.capacity,
                    "active": len(r.rows),
                }
            )

    def _account(self, r: _SimRollout) -> None:
        dt = self.now - r.last_t
        if dt > 0:
            if r.rows:
                r.busy_active_s += dt
                r.occ_s += dt * len(r.rows) / r.capacity
            r.last_t = self.now

    # ------------------------------------------------------------------------------------ speed (CPU sharing)
    def _speed(self) -> float:
        cores = self.cfg.cost.shared_cores
        if cores <= 0:
            return 1.0
        busy = self.n_busy + (1 if self.trainer_busy else 0)
        return min(1.0, cores / max(1, busy))

    def _busy_changed(self) -> None:
        """Shared cores: every running segment continues at the new speed (re-timed from now)."""
        if self.cfg.cost.shared_cores <= 0:
            return
        sp = self._speed()
        for r in self.rlist:
            if r.busy and r.seg_speed != sp:
                self._retime(r, sp)
        if self.trainer_busy and self.tr_speed != sp:
            done = (self.now - self.tr_start) * self.tr_speed
            self.tr_left -= done
            self.tr_start, self.tr_speed = self.now, sp
            self.tr_epoch += 1
            self._push(self.now + max(0.0, self.tr_left) / sp, "train_done", None, self.tr_epoch)

    def _retime(self, r: _SimRollout, sp: float) -> None:
        done = (self.now - r.seg_start) * r.seg_speed
        frac = min(1.0, done / r.seg_work) if r.seg_work > 0 else 1.0
        if r.seg_steps:
            r.S += r.seg_steps * frac
            r.chunk_left -= r.seg_steps * frac
            r.seg_steps *= 1 - frac
        r.seg_work = max(0.0, r.seg_work - done)
        r.seg_start, r.seg_speed = self.now, sp
        r.epoch += 1
        self._push(self.now + r.seg_work / sp, "seg_end", r, r.epoch)

    def _set_busy(self, r: _SimRollout, busy: bool) -> None:
        if r.busy != busy:
            r.busy = busy
            self.n_busy += 1 if busy else -1

    # ------------------------------------------------------------------------------------ engine
    def _start_segment(self, r: _SimRollout, work: float, steps: float) -> None:
        sp = self._speed()
        r.seg_start, r.seg_work, r.seg_speed, r.seg_steps = self.now, work, sp, steps
        r.epoch += 1
        self._push(self.now + work / sp, "seg_end", r, r.epoch)

    def _admit(self, r: _SimRollout) -> int:
        """Fill free slots (partials first, queued requests when admitting); returns prefill tokens."""
        tokens = 0
        while len(r.rows) < r.capacity and (r.partials or (r.admitting and r.queue)):
            if r.partials:
                p = r.partials.popleft()
                req, version = p.request, p.version
                pre = self.pre.pop((req.group_uid, req.sample_idx), 0)
            else:
                req, pre, version = r.queue.popleft(), 0, r.eversion
            target = self.source.lengths[req.prompt.prompt_id][req.sample_idx]
            if pre >= target:  # already complete
                self._finish(r, _Row((req.group_uid, req.sample_idx), req, target, pre, r.S, version))
                continue
            row = _Row((req.group_uid, req.sample_idx), req, target, pre, r.S, version)
            r.row_seq += 1
            heapq.heappush(r.rows, (r.S + (target - pre), r.row_seq, row))
            r.sum_c0 += self.cfg.workload.prompt_len + pre - r.S
            tokens += self.cfg.workload.prompt_len + pre
        return tokens

    def _finish(self, r: _SimRollout, row: _Row) -> None:
        traj = Trajectory(
            "trajectory",
            row.req.prompt,
            row.req.sample_idx,
            (),
            (),
            row.version,
            True,
            "",
            group_uid=row.req.group_uid,
            last_version=r.eversion,
        )
        r.finished.append((traj, row.target))

    def _retire(self, r: _SimRollout) -> None:
        while r.rows and r.rows[0][0] <= r.S + 1e-6:
            _, _, row = heapq.heappop(r.rows)
            r.sum_c0 -= self.cfg.workload.prompt_len + row.pre - row.s_admit
            self._finish(r, row)

    def _decode_or_return(self, r: _SimRollout, extra_s: float = 0.0) -> None:
        """Continue the current call: decode to the next completion (or the chunk's end), else return.
        ``extra_s``: a prefill (and call overhead) that precedes the decode steps in the same segment."""
        chunked = self.cfg.sched.chunk_steps > 0
        if not r.rows or (chunked and r.chunk_left <= 1e-9) or r.eversion < 0:
            if extra_s > 0:
                self._start_segment(r, extra_s, 0)
                r.cut_req = True  # return once the prefill is done
                return
            self._return(r)
            return
        nxt = r.rows[0][0] - r.S
        k = min(nxt, r.chunk_left) if chunked else nxt
        k = max(k, 1e-9)
        n = len(r.rows)
        ctx = r.sum_c0 / n + r.S + k / 2
        self._start_segment(r, extra_s + k * self.cost.decode_step_s(n, ctx), k)

    def _on_segment_end(self, r: _SimRollout) -> None:
        self._account(r)
        if r.seg_steps:
            r.S += r.seg_steps
            r.chunk_left -= r.seg_steps
            r.seg_steps = 0
        op = r.op
        if op == "pull":
            r.eversion = r.pull_version
            if self.mode.interrupt and r.rows:  # continue under the new weights: re-prefill every row
                tokens = sum(
                    self.cfg.workload.prompt_len + row.pre + int(r.S - row.s_admit) for _, _, row in r.rows
                )
                r.op = "reprefill"
                self._start_segment(r, self.cost.prefill_s(tokens), 0)
                return
            r.op = "step"
            self._begin_step(r)
            return
        if op == "reprefill":
            r.op = "step"
            self._begin_step(r)
            return
        if op == "extract":
            self._on_extract(r)
            return
        # decode segment (or a prefill) ended
        self._retire(r)
        if r.cut_req:
            r.cut_req = False
            self._return(r)
            return
        if self.cfg.sched.chunk_steps > 0:
            tokens = self._admit(r)
            self._retire(r)
            self._decode_or_return(r, self.cost.prefill_s(tokens))
            return
        elif r.finished:
            self._return(r)
            return
        self._decode_or_return(r)

    def _begin_step(self, r: _SimRollout) -> None:
        """After an optional pull: admit (prefill) then decode."""
        r.chunk_left = float(self.cfg.sched.chunk_steps) if self.cfg.sched.chunk_steps > 0 else math.inf
        tokens = self._admit(r)
        self._retire(r)
        self._decode_or_return(r, self.cost.prefill_s(tokens) + self.cfg.sched.call_overhead_s)

    def _cut(self, r: _SimRollout) -> None:
        """Event mode: end a busy decode call now (the manager needs the rollout before its next completion)."""
        if not r.busy or r.op != "step" or self.cfg.sched.chunk_steps > 0:
            return
        if not r.seg_steps:  # a prefill: the call returns when it is done
            r.cut_req = True
            return
        self._account(r)
        done = (self.now - r.seg_start) * r.seg_speed
        frac = min(1.0, done / r.seg_work) if r.seg_work > 0 else 1.0
        if r.seg_steps:
            r.S += r.seg_steps * frac
        r.seg_steps = 0
        r.epoch += 1  # the pending seg_end is void
        self._retire(r)
        self._return(r)

    def _poke(self, r: _SimRollout) -> None:
        if r.busy:
            self._cut(r)
        else:
            self._dispatch(r)

    # ------------------------------------------------------------------------------------ manager calls
    def _dispatch(self, r: _SimRollout) -> None:
        """An idle engine asks the manager what to do next (``RolloutManager.dispatch``, as the
        runtime does) and starts it: a hand-over (repack), or a call that pulls, admits and decodes."""
        if r.busy:
            return
        order = self.m.dispatch(r.name)
        if order is None:
            self.idle.add(r.name)
            return
        self.idle.discard(r.name)
        self._set_busy(r, True)
        self._account(r)
        if isinstance(order, ExtractOrder):
            r.op = "extract"
            self._start_segment(r, self.cfg.cost.extract_s, 0)
            self._busy_changed()
            return
        r.admitting = order.admitting
        r.partials.extend(order.inject)
        r.queue.extend(order.submit)
        if order.pull:
            self._start_pull(r, order.min_version)
        else:
            r.op = "step"
            self._begin_step(r)
        self._busy_changed()

    def _start_pull(self, r: _SimRollout, min_version: int) -> None:
        want = max(min_version, 0) if min_version >= 0 else -1
        avail = self._relay_version_time(self.m.rollouts[r.name].relay, want)
        r.op, r.pulled = "pull", True
        r.pull_version = avail[0]
        wait = max(0.0, avail[1] - self.now)
        cost = self.cfg.cost.reshard_s if self.colocated else self.cost.pull_s()
        # waiting for the relay is idle time, not work: it does not slow shared cores
        sp = self._speed()
        r.seg_start, r.seg_work, r.seg_speed, r.seg_steps = self.now, cost + wait * sp, sp, 0
        r.epoch += 1
        self._push(self.now + wait + cost / sp, "seg_end", r, r.epoch)

    def _relay_version_time(self, relay: str, min_version: int) -> tuple[int, float]:
        """(version, time it is at ``relay``): the newest published version, or ``min_version`` when
        that is newer than what the relay holds yet (the pull waits for it)."""
        v = max(self.published, min_version)
        return v, self.relay_at[v].get(relay, self.now) if v in self.relay_at else self.now

    def _status(self, r: _SimRollout) -> RolloutStatus:
        return RolloutStatus(r.eversion, len(r.rows), len(r.queue) + len(r.partials), r.capacity)

    def _return(self, r: _SimRollout) -> None:
        """A rollout call returns: its result goes to the manager (``step_done``), as in the runtime."""
        self._set_busy(r, False)
        pulled = PullResult(True, r.eversion) if r.pulled and r.eversion >= 0 else None
        r.pulled = False
        finished, r.finished = r.finished, []
        for traj, length in finished:
            self.lengths[(traj.group_uid, traj.sample_idx)] = length
            self.gen_tokens += length
        completed = self.m.step_done(r.name, [t for t, _ in finished], self._status(r), pulled)
        if self.streamed:
            for uid, group in completed:
                self._stream_arrival(uid, group)
        self._sample(r)
        self._busy_changed()
        self.dirty = True
        self._dispatch(r)

    def _on_extract(self, r: _SimRollout) -> None:
        """A repack source's hand-over: its partials and queued requests go to the manager
        (``extract_done``), which passes them on; then the receiver is poked."""
        partials = list(r.partials)
        r.partials.clear()
        for _, _, row in r.rows:
            self.pre[row.key] = row.pre + int(r.S - row.s_admit)
            partials.append(Partial(row.req, (), (), row.version))
        r.rows, r.sum_c0 = [], 0.0
        queued = list(r.queue)
        r.queue.clear()
        self._set_busy(r, False)
        dst = self.m.extract_done(r.name, partials, queued, self._status(r))
        self._sample(r)
        self._busy_changed()
        self.dirty = True
        self._dispatch(r)
        if dst is not None:
            self._poke(self.rollouts[dst])

    def _repack(self) -> None:
        self.m.repack()

    # ------------------------------------------------------------------------------------ batches
    def _maybe_open_batch(self) -> None:
        done = self.m.maybe_open_batch()
        if done:
            self.dirty = True
            self.wake = self.wake or done == "issued"

    # ------------------------------------------------------------------------------------ trainer
    def _group_tokens(self, uid: int, g: ScoredGroup) -> tuple[int, float]:
        lens = [self.lengths[(uid, t.sample_idx)] for t in g.trajectories]
        tokens = sum(lens)
        ctx = self.cfg.workload.prompt_len + (sum(x * x for x in lens) / max(1, tokens)) / 2
        return tokens, ctx

    def _train_work(self, groups: Sequence[tuple[int, ScoredGroup]]) -> float:
        tokens, wctx = 0, 0.0
        for uid, g in groups:
            t, c = self._group_tokens(uid, g)
            tokens += t
            wctx += t * c
        return self.cost.train_s(tokens, wctx / max(1, tokens))

    def _maybe_train(self) -> None:
        if self.trainer_busy or self.streamed or self.version >= self.steps:
            return
        groups = self.m.next_batch()
        if not groups:
            return
        self.trainer_busy = True
        self.tr_left = self._train_work(groups) + (0.0 if self.colocated else self.cost.publish_stall_s())
        self.tr_start, self.tr_speed = self.now, self._speed()
        self.tr_epoch += 1
        self._busy_changed()
        self._push(self.now + self.tr_left / self._speed(), "train_done", None, self.tr_epoch)

    # stream: forward/backward per group as it completes, optimizer step when the batch is in
    def _stream_arrival(self, uid: int, group: ScoredGroup) -> None:
        b = self.m.batch_of.get(uid)
        if b is None:
            return
        tokens, ctx = self._group_tokens(uid, group)
        work = self.cost.train_s(tokens, ctx) - self.cfg.cost.train_step_overhead_s
        self.stream_work.setdefault(b, []).append((self.now, work))

    def _stream_schedule(self) -> None:
        b = self.version  # the batch of the next update: the first closed one
        if self.trainer_busy or not self.m.closed_batches or self.version >= self.steps:
            return
        t = self.stream_free
        for arrival, work in sorted(self.stream_work.get(b, [])):
            t = max(t, arrival) + work
        t += self.cfg.cost.train_step_overhead_s + self.cost.publish_stall_s()
        if not self.m.next_batch():
            return
        self.trainer_busy = True
        self.tr_epoch += 1
        self._push(max(t, self.now + self.cfg.cost.train_step_overhead_s), "train_done", None, self.tr_epoch)

    def _after_update(self) -> None:
        groups = self.m.training
        self.trainer_busy = False
        version = self.version + 1
        tokens = sum(self.lengths[(uid, t.sample_idx)] for uid, g in groups for t in g.trajectories)
        self.trained_tokens += tokens
        self.per_update.append((self.now, tokens))
        self.timeline["updates"].append({"t": self.now, "version": version})
        # publish: the master relay has it now, the others along the chain
        self.published = version
        at = {}
        relay = self.chain.master
        hop = 0
        while relay is not None:
            at[relay] = self.now + (0.0 if self.colocated else self.cost.relay_arrival_s(hop))
            relay = self.chain.next_of(relay)
            hop += 1
        self.relay_at[version] = at
        keep = self.m.retained_versions(self.cfg.sched.keep_versions, latest=version)
        for v in [v for v in self.relay_at if v not in keep and v != version]:
            self.relay_at.pop(v)
        if self.streamed:
            self.stream_free = self.now
        self._busy_changed()
        self.dirty = True
        self.wake = True
        self.m.updated(version)  # the rollouts hear of it (interrupt, drain) and laminar repacks
        if self.mode.repack:
            self.next_repack = self.now + self.cfg.sched.repack_interval_s

    # ------------------------------------------------------------------------------------ loop
    def run(self, max_events: int = 50_000_000) -> ModeResult:
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.n_busy = 0
        self.trainer_busy = False
        self.tr_left = self.tr_start = 0.0
        self.tr_speed = 1.0
        self.tr_epoch = 0
        self.published = 0
        self.relay_at: dict[int, dict[str, float]] = {0: {name: 0.0 for name in self.chain.order}}
        self.idle: set[str] = set(self.rollouts)  # the first control pass dispatches every rollout
        self.lengths: dict[tuple, int] = {}
        self.gen_tokens = 0
        self.trained_tokens = 0
        self.per_update: list[tuple[float, int]] = []
        self.stream_work: dict[int, list] = {}
        self.stream_free = 0.0
        self.dirty = True
        self.wake = True
        self.next_repack = self.cfg.sched.repack_interval_s
        if self.mode.repack:
            self._push(self.next_repack, "repack")
        gen_busy_since: float | None = None
        gen_time = 0.0
        events = 0
        self._control_pass()
        while self.version < self.steps:
            if not self.heap:
                raise RuntimeError(
                    f"simulation of {self.mode.name} stalled at t={self.now:.1f}s (version {self.version})"
                )
            t, _, kind, obj, epoch = heapq.heappop(self.heap)
            self.now = t
            events += 1
            if events > max_events:
                raise RuntimeError(f"simulation of {self.mode.name} exceeded {max_events} events")
            if kind == "seg_end":
                if epoch != obj.epoch:
                    continue
                self._on_segment_end(obj)
            elif kind == "train_done":
                if epoch != self.tr_epoch or not self.trainer_busy:
                    continue
                self._after_update()
            elif kind == "repack":
                if self.now + 1e-9 >= self.next_repack:
                    self._repack()
                    self.next_repack = self.now + self.cfg.sched.repack_interval_s
                self._push(self.next_repack, "repack")
            if self.dirty:
                self._control_pass()
            busy = self.n_busy > 0
            if busy and gen_busy_since is None:
                gen_busy_since = self.now
            elif not busy and gen_busy_since is not None:
                gen_time += self.now - gen_busy_since
                gen_busy_since = None
        if gen_busy_since is not None:
            gen_time += self.now - gen_busy_since
        return self._result(events, gen_time)

    def _control_pass(self) -> None:
        """One turn of the runtime's loop: trainer, batches, idle rollouts."""
        self.dirty = False
        for _ in range(4):
            self._maybe_train()
            if self.mode.batched:
                self._maybe_open_batch()
            if self.streamed:
                self._stream_schedule()
            if self.wake:
                self.wake = False
                for name in sorted(self.idle, key=lambda n: self.rollouts[n].index):
                    self._dispatch(self.rollouts[name])
            if not self.dirty:
                break
            self.dirty = False

    def _result(self, events: int, gen_time: float) -> ModeResult:
        wall = self.now
        for r in self.rlist:
            self._account(r)
        times = [t for t, _ in self.per_update]
        w = min(self.cfg.warmup_updates, len(self.per_update) - 1)
        if w > 0:
            steady = sum(x for _, x in self.per_update[w:]) / max(1e-9, times[-1] - times[w - 1])
        else:
            steady = self.trained_tokens / max(wall, 1e-9)
        n = len(self.rlist)
        idle = 1.0 - sum(r.busy_active_s for r in self.rlist) / max(1e-9, n * wall)
        occ = sum(r.occ_s for r in self.rlist) / max(1e-9, n * wall)
        self.timeline["t_end"] = wall
        steps = [b - a for a, b in zip([0.0] + times[:-1], times)]
        return ModeResult(
            mode=self.mode.name,
            updates=self.version,
            wall_s=wall,
            trained_tokens=self.trained_tokens,
            tokens_per_s=self.trained_tokens / max(wall, 1e-9),
            steady_tokens_per_s=steady,
            idle_share=idle,
            mean_occupancy=occ,
            staleness_histogram={str(k): v for k, v in sorted(self.buffer.stats.staleness.items())},
            stale_dropped=self.buffer.stats.stale_dropped,
            dropped_groups=self.buffer.stats.filtered,
            extra_rounds=self.m.counts["extra_rounds"],
            empty_batches=self.m.counts["empty_batches"],
            repacks=self.m.counts["repacks"],
            pulls=self.m.counts["pulls"],
            interrupts=self.m.counts["interrupts"],
            update_times=times,
            step_seconds=steps,
            generation_share=gen_time / max(wall, 1e-9),
            rollouts=n,
            trainer_gpus=self.trainer_gpus,
            rollout_gpus=self.rollout_gpus,
            capacity=self.capacity,
            events=events,
            trained_groups=len(self.m.trained_uids),
            trained_uids=list(self.m.trained_uids),
            timeline=self.timeline,
        )


def balanced_trainer_gpus(cfg: SimConfig) -> int:
    """Trainer GPUs where one update (``prompts_per_step x group_size`` responses of the mean length)
    trains in the time the other GPUs' engines generate its tokens at full occupancy: a split that
    neither starves the trainer nor lets generation run far ahead. The same for every asynchronous mode."""
    cl, wl = cfg.cluster, cfg.workload
    total = cl.nodes * cl.gpus_per_node
    one = CostModel(cfg, cl.gpus_per_engine, 1)
    mean_len = LengthSampler(wl.lengths, wl.max_output, wl.group_size, cfg.seed).mean()
    cap = cfg.sched.capacity or one.auto_capacity(wl.prompt_len + mean_len, cfg.sched.max_capacity)
    tokens = wl.prompts_per_step * wl.group_size * mean_len
    train_1 = one.train_s(int(tokens), wl.prompt_len + mean_len) - cfg.cost.train_step_overhead_s
    rate = cap / one.decode_step_s(cap, wl.prompt_len + mean_len / 2) / cl.gpus_per_engine  # tokens/s per GPU
    gen_1 = tokens / rate
    return max(1, min(total - cl.gpus_per_engine, round(total * train_1 / (train_1 + gen_1))))


MAX_TRAIN_MFU = 0.6
"""``calibrate_train_share`` never implies a training MFU above this (a physical ceiling)."""


def calibrate_train_share(cfg: SimConfig) -> tuple[SimConfig, dict]:
    """With ``cost.train_gen_share = s > 0``: simulate the colocated synchronous mode without training
    cost to get its generation time per step ``G``, then set ``mfu_train`` so that one update on all
    GPUs takes ``G * (1 - s) / s``, but never above ``MAX_TRAIN_MFU`` of the FLOP count (then
    generation is less than ``s`` of a step: ``capped``). Returns the new config and what was derived."""
    s = cfg.cost.train_gen_share
    if s <= 0:
        return cfg, {}
    if not 0 < s < 1:
        raise ValueError("cost.train_gen_share must be in (0, 1)")
    probe = dataclasses.replace(
        cfg,
        cluster=dataclasses.replace(cfg.cluster, colocate_sync=True),
        cost=dataclasses.replace(
            cfg.cost, train_s_per_token=1e-12, train_step_overhead_s=0.0, train_gen_share=0.0
        ),
        workload=dataclasses.replace(cfg.workload, steps=min(cfg.workload.steps, 3)),
    )
    sim = Simulator(probe, "sync")
    res = sim.run()
    gen = sum(res.step_seconds) / len(res.step_seconds)
    target = gen * (1 - s) / s
    tokens = res.trained_tokens / res.updates
    # the trainer's time per update on all GPUs at mfu 1, from the same FLOP model
    total = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    unit = dataclasses.replace(
        cfg,
        cost=dataclasses.replace(cfg.cost, mfu_train=1.0, train_step_overhead_s=0.0, train_s_per_token=0.0),
    )
    mean_ctx = cfg.workload.prompt_len + sim.mean_len
    at_peak = CostModel(unit, cfg.cluster.gpus_per_engine, total).train_s(int(tokens), mean_ctx)
    busy = max(1e-9, target - cfg.cost.train_step_overhead_s)
    mfu = at_peak / busy
    capped = mfu > MAX_TRAIN_MFU
    if capped:
        mfu = MAX_TRAIN_MFU
        target = at_peak / mfu + cfg.cost.train_step_overhead_s
    new = dataclasses.replace(cfg, cost=dataclasses.replace(cfg.cost, mfu_train=mfu, train_gen_share=0.0))
    return new, {
        "sync_generation_s": gen,
        "train_s_per_update_all_gpus": target,
        "implied_mfu_train": mfu,
        "train_gen_share": s,
        "capped": capped,
        "generation_share": gen / (gen + target),
    }


def simulate(cfg: SimConfig, modes: Iterable[str] | None = None) -> dict[str, ModeResult]:
    """Every mode of ``cfg.modes`` (or ``modes``) on the same config and seed (after
    ``calibrate_train_share`` when ``cost.train_gen_share`` is set)."""
    cfg, _ = calibrate_train_share(cfg)
    return {m: Simulator(cfg, m).run() for m in (list(modes) if modes is not None else list(cfg.modes))}


def speedups(results: Mapping[str, ModeResult], of: str = "laminar", steady: bool = True) -> dict[str, float]:
    key = "steady_tokens_per_s" if steady else "tokens_per_s"
    base = getattr(results[of], key)
    return {m: base / max(1e-12, getattr(r, key)) for m, r in results.items() if m != of}


def format_table(results: Mapping[str, ModeResult], baseline: str = "sync") -> str:
    base = results.get(baseline) or next(iter(results.values()))
    lines = [
        "| mode | trained tok/s (steady) | vs " + base.mode + " | overall tok/s | step s | idle share | "
        "occupancy | staleness | repacks | gen share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        steps = r.step_seconds[1:] or r.step_seconds
        lines.append(
            f"| {r.mode} | {r.steady_tokens_per_s:,.0f} | {r.steady_tokens_per_s / base.steady_tokens_per_s:.2f}x | "
            f"{r.tokens_per_s:,.0f} | {sum(steps) / max(1, len(steps)):.1f} | {r.idle_share:.2f} | "
            f"{r.mean_occupancy:.2f} | {r.staleness_histogram} | {r.repacks} | {r.generation_share:.2f} |"
        )
    return "\n".join(lines)


# model presets (Qwen2.5 configs: layers, hidden, KV heads, head dim)
MODELS: dict[str, dict] = {
    "qwen2.5-7b": dict(name="qwen2.5-7b", params_b=7.6, layers=28, hidden=3584, kv_heads=4, head_dim=128),
    "qwen2.5-32b": dict(name="qwen2.5-32b", params_b=32.8, layers=64, hidden=5120, kv_heads=8, head_dim=128),
    "qwen2.5-72b": dict(name="qwen2.5-72b", params_b=72.7, layers=80, hidden=8192, kv_heads=8, head_dim=128),
}
ENGINE_TP: dict[str, int] = {"qwen2.5-7b": 1, "qwen2.5-32b": 4, "qwen2.5-72b": 8}
"""GPUs per rollout engine (tensor parallel) for each preset: room for a few hundred 16K-token
sequences of KV cache next to the weights on 80 GB GPUs."""


def config_from_settings(data: Mapping[str, Any]) -> SimConfig:
    """``conf.simulate.SimulateConfig`` as a dict -> :class:`SimConfig`: ``model.preset`` fills the
    architecture, ``cluster.gpus_per_engine = 0`` takes the preset's tensor-parallel size (else 1);
    keys the simulator does not know (``out``) are dropped."""
    data = {k: v for k, v in dict(data).items() if k != "out"}
    model = dict(data.get("model", {}))
    preset = model.pop("preset", "") or ""
    if preset:
        if preset not in MODELS:
            raise ValueError(f"model.preset={preset!r}: choose one of {', '.join(MODELS)} (or empty)")
        model.update(MODELS[preset])
    data["model"] = model
    cluster = dict(data.get("cluster", {}))
    if not cluster.get("gpus_per_engine"):
        cluster["gpus_per_engine"] = ENGINE_TP.get(preset, 1)
    data["cluster"] = cluster
    return config_from_dict(data)
