"""Typed schema of ``laminar simulate`` (the cluster-scale simulator, ``training.rl.drivers.sim``),
composed by Hydra from ``conf/simulate.yaml``; the simulator reads it as it is. An unknown key or a
wrong type fails here, before anything is written.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, model_validator

from conf.base import Fraction, Ge, MaxLen, NonNegative, Positive, Section, rule, validated
from conf.schema import ToolLatencyConfig, VersionRule

SimMode = Literal["sync", "one_step", "stream", "partial", "laminar"]
SIM_MODE_NAMES: tuple[str, ...] = get_args(SimMode)
"""The runtime's modes plus the simulator-only ``stream``."""
LengthKind = Literal["lognormal", "mixture", "values"]
HINT = "conf/simulate.py"
"""Where an error sends the reader for the keys (``laminar config`` shows the pipeline's only)."""

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(name="qwen2.5-7b", params_b=7.6, layers=28, hidden=3584, kv_heads=4, head_dim=128),
    "qwen2.5-32b": dict(name="qwen2.5-32b", params_b=32.8, layers=64, hidden=5120, kv_heads=8, head_dim=128),
    "qwen2.5-72b": dict(name="qwen2.5-72b", params_b=72.7, layers=80, hidden=8192, kv_heads=8, head_dim=128),
}
"""``model.preset`` -> the architecture fields it sets (Qwen2.5 configs)."""
ENGINE_TP: dict[str, int] = {"qwen2.5-7b": 1, "qwen2.5-32b": 4, "qwen2.5-72b": 8}
"""GPUs per rollout engine (tensor parallel) for each preset: room for a few hundred 16K-token
sequences of KV cache next to the weights on 80 GB GPUs."""


class SimClusterConfig(Section):
    nodes: Annotated[int, Positive] = 128
    gpus_per_node: Annotated[int, Positive] = 8
    trainer_gpus: Annotated[int, NonNegative] = 0
    """0: ``trainer_share`` of the GPUs (0 = balanced split)."""
    trainer_share: Annotated[float, Fraction] = 0.5
    gpus_per_engine: Annotated[int, NonNegative] = 0
    """Tensor-parallel GPUs per rollout engine (0: the preset's default for ``model.preset``)."""
    colocate_sync: bool = True
    """``sync`` alternates generation and training on all GPUs (verl's hybrid engine)."""


class SimModelConfig(Section):
    preset: str = "qwen2.5-7b"
    """qwen2.5-7b | qwen2.5-32b | qwen2.5-72b sets the fields below; empty: give them yourself."""
    name: str = "custom"
    params_b: float = 7.6
    layers: int = 28
    hidden: int = 3584
    kv_heads: int = 4
    head_dim: int = 128
    bytes_per_param: float = 2.0
    kv_bytes_per_token: float = 0.0


class SimLengthConfig(Section):
    kind: LengthKind = "lognormal"
    median: float = 1500.0
    p99_over_median: float = 10.0
    group_corr: float = 0.5
    weights: list[float] = Field(default_factory=list)
    medians: list[float] = Field(default_factory=list)
    sigmas: list[float] = Field(default_factory=list)
    values: list[int] = Field(default_factory=list)
    values_file: str | None = None
    """With ``kind=values``: read the lengths from a JSON file, a list or a real run's ``runtime.json``
    (its ``response_lengths``), instead of ``values``."""


class SimToolConfig(Section):
    """A tool every episode calls ``calls`` times, each call waiting a latency drawn from ``latency``
    (``conf.schema.ToolLatencyConfig``, the same distributions as ``env.tool_latency``)."""

    name: str = "tool"
    calls: Annotated[int, NonNegative] = 1
    latency: ToolLatencyConfig = Field(default_factory=ToolLatencyConfig.model_construct)


class SimWorkloadConfig(Section):
    prompts_per_step: Annotated[int, Positive] = 512
    group_size: Annotated[int, Positive] = 16
    steps: Annotated[int, Positive] = 8
    max_output: Annotated[int, Positive] = 16384
    prompt_len: int = 256
    lengths: SimLengthConfig = Field(default_factory=SimLengthConfig.model_construct)
    pass_rates: list[float] = Field(default_factory=list)
    """Each prompt's chance that a response is right, drawn per prompt from this list (empty: rewards
    are not modelled). With ``sched.dynamic_sampling``, groups whose responses all agree are dropped."""
    tools: list[SimToolConfig] = Field(default_factory=list)
    """Tool calls of every episode, a latency distribution per tool (empty: single-turn responses);
    what a waiting episode does follows ``version_rule`` (docs/simulator.md)."""
    version_rule: VersionRule = "turn"
    """With ``tools``: ``turn`` (the runtime's default, ``env.version_rule``): a tool call ends a policy
    turn, the episode leaves the batch (parked, pinning no weights) until its latency has passed on the
    wall clock, then its next turn re-prefills under the rollout's current weights (held through a
    laminar drain until the pull). ``episode``: the waiting episode keeps its row and its wait counts
    in decode steps, so it pins its rollout's version until it ends."""


class SimCostConfig(Section):
    hbm_gbps: Annotated[float, Positive] = 3350.0
    flops_tflops: Annotated[float, Positive] = 989.0
    mem_eff: float = 0.7
    mfu_decode: float = 0.5
    mfu_prefill: float = 0.5
    mfu_train: float = 0.35
    decode_overhead_s: float = 0.004
    tp_latency_s: float = 2e-5
    decode_points: list[list[float]] = Field(default_factory=list)
    """Measured ``[[batch, seconds per decode step], ...]``; empty: the roofline."""
    decode_points_ctx: float = 0.0
    prefill_s_per_token: float = 0.0
    prefill_overhead_s: float = 0.0
    train_flops_per_token: float = 8.0
    train_s_per_token: float = 0.0
    train_gen_share: Annotated[float, Fraction] = 0.0
    train_step_overhead_s: float = 1.0
    d2h_gbps: float = 25.0
    relay_gbps: float = 100.0
    relay_hop_s: float = 0.01
    h2d_gbps: float = 25.0
    pull_overhead_s: float = 0.2
    reshard_s: float = 2.0
    extract_s: float = 0.01
    kv_mem_share: float = 0.85
    gpu_mem_gb: float = 80.0
    shared_cores: float = 0.0


class SimSchedConfig(Section):
    capacity: int = 0
    max_capacity: int = 512
    chunk_steps: int = 0
    call_overhead_s: float = 0.0
    repack_interval_s: Annotated[float, Positive] = 5.0
    repack_b: int = 0
    max_staleness: Annotated[int | None, NonNegative] = None
    admit_lag: Annotated[int, Ge(1)] = 1
    keep_versions: int = 2
    max_ahead_batches: int = 0
    """Simulator-only back-pressure: issued-but-untrained groups stay within this many batches (0 = off)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups with no reward variance are dropped; a batched mode samples
    further rounds (at most ``max_sampling_rounds``) until its batch is full."""
    max_sampling_rounds: int = 10


class SimulateConfig(Section):
    cluster: SimClusterConfig = Field(default_factory=SimClusterConfig.model_construct)
    model: SimModelConfig = Field(default_factory=SimModelConfig.model_construct)
    workload: SimWorkloadConfig = Field(default_factory=SimWorkloadConfig.model_construct)
    cost: SimCostConfig = Field(default_factory=SimCostConfig.model_construct)
    sched: SimSchedConfig = Field(default_factory=SimSchedConfig.model_construct)
    modes: Annotated[list[SimMode], MaxLen(len(SIM_MODE_NAMES))] = Field(
        default_factory=lambda: list(SIM_MODE_NAMES)
    )
    seed: Annotated[int, NonNegative] = 0
    warmup_updates: Annotated[int, NonNegative] = 2
    timeline_rollouts: int = 16
    out: str | None = None
    """Output folder (default ``<workspace>/simulate/<timestamp>``)."""

    @model_validator(mode="after")
    def _consistent(self) -> SimulateConfig:
        if self.model.preset and self.model.preset not in MODEL_PRESETS:
            raise rule(
                f"@model.preset={self.model.preset!r}: choose one of {', '.join(MODEL_PRESETS)} (or empty)"
            )
        if not self.modes or len(set(self.modes)) != len(self.modes):
            raise rule(
                f"@modes={list(self.modes)}: choose each at most once from {', '.join(SIM_MODE_NAMES)}"
            )
        lengths = self.workload.lengths
        if lengths.values_file and lengths.kind != "values":
            raise rule("@workload.lengths.values_file is read only with @workload.lengths.kind=values")
        if self.warmup_updates >= self.workload.steps:
            raise rule(
                f"@warmup_updates={self.warmup_updates} must be below @workload.steps={self.workload.steps}"
            )
        if any(len(p) != 2 or p[0] <= 0 or p[1] <= 0 for p in self.cost.decode_points):
            raise rule("@cost.decode_points: a list of [batch, seconds per decode step] pairs, both > 0")
        return self


def apply_preset(cfg: SimulateConfig) -> SimulateConfig:
    """``cfg`` with ``model.preset``'s architecture in the model fields and ``cluster.gpus_per_engine
    = 0`` replaced by the preset's tensor-parallel size (1 without a preset). Idempotent."""
    preset = cfg.model.preset
    model = cfg.model.model_copy(update=MODEL_PRESETS[preset]) if preset else cfg.model
    tp = cfg.cluster.gpus_per_engine or ENGINE_TP.get(preset, 1)
    return cfg.model_copy(
        update={"model": model, "cluster": cfg.cluster.model_copy(update={"gpus_per_engine": tp})}
    )


def load_simulate_config(overrides=()) -> SimulateConfig:
    """Hydra overrides -> a validated :class:`SimulateConfig` (``conf/simulate.yaml``); raises
    :class:`ConfigError` naming the offending key, like ``conf.loader.load_config``."""
    from conf.loader import compose_validated

    return compose_validated("simulate", SimulateConfig, overrides, hint=HINT)


def simulate_config(data: dict[str, Any] | None = None) -> SimulateConfig:
    """A validated :class:`SimulateConfig` from a nested mapping over the schema's defaults (not
    ``conf/simulate.yaml``, so ``cost.train_gen_share`` stays 0), for code that builds configs:
    benchmarks and tests. Unknown keys and wrong types fail as in :func:`load_simulate_config`."""
    return validated(SimulateConfig, dict(data or {}), HINT)
