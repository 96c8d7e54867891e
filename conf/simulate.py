"""Typed schema of ``laminar simulate`` (the cluster-scale simulator, ``training.rl.drivers.sim``),
composed by Hydra from ``conf/simulate.yaml``; the simulator reads it as it is. An unknown key or a
wrong type fails here, before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from conf.schema import ConfigError, ToolLatencyConfig, _validate_latency_fields

SIM_MODE_NAMES = ("sync", "one_step", "stream", "partial", "laminar")
"""The runtime's modes plus the simulator-only ``stream``."""
LENGTH_KINDS = ("lognormal", "mixture", "values")
VERSION_RULES = ("turn", "episode")
"""What one weight version spans in laminar mode with tools (``env.version_rule``, docs/simulator.md)."""

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(name="qwen2.5-7b", params_b=7.6, layers=28, hidden=3584, kv_heads=4, head_dim=128),
    "qwen2.5-32b": dict(name="qwen2.5-32b", params_b=32.8, layers=64, hidden=5120, kv_heads=8, head_dim=128),
    "qwen2.5-72b": dict(name="qwen2.5-72b", params_b=72.7, layers=80, hidden=8192, kv_heads=8, head_dim=128),
}
"""``model.preset`` -> the architecture fields it sets (Qwen2.5 configs)."""
ENGINE_TP: dict[str, int] = {"qwen2.5-7b": 1, "qwen2.5-32b": 4, "qwen2.5-72b": 8}
"""GPUs per rollout engine (tensor parallel) for each preset: room for a few hundred 16K-token
sequences of KV cache next to the weights on 80 GB GPUs."""


@dataclass
class SimClusterConfig:
    nodes: int = 128
    gpus_per_node: int = 8
    trainer_gpus: int = 0
    """0: ``trainer_share`` of the GPUs (0 = balanced split)."""
    trainer_share: float = 0.5
    gpus_per_engine: int = 0
    """Tensor-parallel GPUs per rollout engine (0: the preset's default for ``model.preset``)."""
    colocate_sync: bool = True
    """``sync`` alternates generation and training on all GPUs (verl's hybrid engine)."""


@dataclass
class SimModelConfig:
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


@dataclass
class SimLengthConfig:
    kind: str = "lognormal"
    median: float = 1500.0
    p99_over_median: float = 10.0
    group_corr: float = 0.5
    weights: list[float] = field(default_factory=list)
    medians: list[float] = field(default_factory=list)
    sigmas: list[float] = field(default_factory=list)
    values: list[int] = field(default_factory=list)
    values_file: str | None = None
    """With ``kind=values``: read the lengths from a JSON file, a list or a real run's ``runtime.json``
    (its ``response_lengths``), instead of ``values``."""


@dataclass
class SimToolConfig:
    """A tool every episode calls ``calls`` times, each call waiting a latency drawn from ``latency``
    (``conf.schema.ToolLatencyConfig``, the same distributions as ``env.tool_latency``)."""

    name: str = "tool"
    calls: int = 1
    latency: ToolLatencyConfig = field(default_factory=ToolLatencyConfig)


@dataclass
class SimWorkloadConfig:
    prompts_per_step: int = 512
    group_size: int = 16
    steps: int = 8
    max_output: int = 16384
    prompt_len: int = 256
    lengths: SimLengthConfig = field(default_factory=SimLengthConfig)
    pass_rates: list[float] = field(default_factory=list)
    """Each prompt's chance that a response is right, drawn per prompt from this list (empty: rewards
    are not modelled). With ``sched.dynamic_sampling``, groups whose responses all agree are dropped."""
    tools: list[SimToolConfig] = field(default_factory=list)
    """Tool calls of every episode, a latency distribution per tool (empty: single-turn responses);
    what a waiting episode does follows ``version_rule`` (docs/simulator.md)."""
    version_rule: str = "turn"
    """With ``tools``: ``turn`` (the runtime's default, ``env.version_rule``): a tool call ends a policy
    turn, the episode leaves the batch (parked, pinning no weights) until its latency has passed on the
    wall clock, then its next turn re-prefills under the rollout's current weights (held through a
    laminar drain until the pull). ``episode``: the waiting episode keeps its row and its wait counts
    in decode steps, so it pins its rollout's version until it ends."""


@dataclass
class SimCostConfig:
    hbm_gbps: float = 3350.0
    flops_tflops: float = 989.0
    mem_eff: float = 0.7
    mfu_decode: float = 0.5
    mfu_prefill: float = 0.5
    mfu_train: float = 0.35
    decode_overhead_s: float = 0.004
    tp_latency_s: float = 2e-5
    decode_points: list[Any] = field(default_factory=list)
    """Measured ``[[batch, seconds per decode step], ...]``; empty: the roofline."""
    decode_points_ctx: float = 0.0
    prefill_s_per_token: float = 0.0
    prefill_overhead_s: float = 0.0
    train_flops_per_token: float = 8.0
    train_s_per_token: float = 0.0
    train_gen_share: float = 0.0
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


@dataclass
class SimSchedConfig:
    capacity: int = 0
    max_capacity: int = 512
    chunk_steps: int = 0
    call_overhead_s: float = 0.0
    repack_interval_s: float = 5.0
    repack_b: int = 0
    max_staleness: int | None = None
    admit_lag: int = 1
    keep_versions: int = 2
    max_ahead_batches: int = 0
    """Simulator-only back-pressure: issued-but-untrained groups stay within this many batches (0 = off)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups with no reward variance are dropped; a batched mode samples
    further rounds (at most ``max_sampling_rounds``) until its batch is full."""
    max_sampling_rounds: int = 10


@dataclass
class SimulateConfig:
    cluster: SimClusterConfig = field(default_factory=SimClusterConfig)
    model: SimModelConfig = field(default_factory=SimModelConfig)
    workload: SimWorkloadConfig = field(default_factory=SimWorkloadConfig)
    cost: SimCostConfig = field(default_factory=SimCostConfig)
    sched: SimSchedConfig = field(default_factory=SimSchedConfig)
    modes: list[str] = field(default_factory=lambda: list(SIM_MODE_NAMES))
    seed: int = 0
    warmup_updates: int = 2
    timeline_rollouts: int = 16
    out: str | None = None
    """Output folder (default ``<workspace>/simulate/<timestamp>``)."""


def apply_preset(cfg: SimulateConfig) -> SimulateConfig:
    """``cfg`` with ``model.preset``'s architecture in the model fields and ``cluster.gpus_per_engine
    = 0`` replaced by the preset's tensor-parallel size (1 without a preset). Idempotent."""
    preset = cfg.model.preset
    if preset and preset not in MODEL_PRESETS:
        raise ConfigError(f"model.preset={preset!r}: choose one of {', '.join(MODEL_PRESETS)} (or empty)")
    model = dataclasses.replace(cfg.model, **MODEL_PRESETS[preset]) if preset else cfg.model
    tp = cfg.cluster.gpus_per_engine or ENGINE_TP.get(preset, 1)
    return dataclasses.replace(cfg, model=model, cluster=dataclasses.replace(cfg.cluster, gpus_per_engine=tp))


def validate_simulate(cfg: SimulateConfig) -> SimulateConfig:
    if cfg.model.preset and cfg.model.preset not in MODEL_PRESETS:
        raise ConfigError(
            f"model.preset={cfg.model.preset!r}: choose one of {', '.join(MODEL_PRESETS)} (or empty)"
        )
    bad = [m for m in cfg.modes if m not in SIM_MODE_NAMES]
    if bad or not cfg.modes:
        raise ConfigError(f"modes={list(cfg.modes)}: choose from {', '.join(SIM_MODE_NAMES)}")
    if len(set(cfg.modes)) != len(cfg.modes):
        raise ConfigError(f"modes={list(cfg.modes)} lists a mode twice")
    if cfg.workload.lengths.values_file and cfg.workload.lengths.kind != "values":
        raise ConfigError("workload.lengths.values_file is read only with workload.lengths.kind=values")
    if cfg.workload.lengths.kind not in LENGTH_KINDS:
        raise ConfigError(
            f"workload.lengths.kind={cfg.workload.lengths.kind!r}: choose one of {', '.join(LENGTH_KINDS)}"
        )
    for key, value in [
        ("cluster.nodes", cfg.cluster.nodes),
        ("cluster.gpus_per_node", cfg.cluster.gpus_per_node),
        ("workload.prompts_per_step", cfg.workload.prompts_per_step),
        ("workload.group_size", cfg.workload.group_size),
        ("workload.steps", cfg.workload.steps),
        ("workload.max_output", cfg.workload.max_output),
        ("cost.hbm_gbps", cfg.cost.hbm_gbps),
        ("cost.flops_tflops", cfg.cost.flops_tflops),
        ("sched.repack_interval_s", cfg.sched.repack_interval_s),
    ]:
        if value <= 0:
            raise ConfigError(f"{key} must be > 0 (got {value})")
    if (
        cfg.cluster.gpus_per_engine < 0
        or cfg.cluster.trainer_gpus < 0
        or not 0 <= cfg.cluster.trainer_share < 1
    ):
        raise ConfigError(
            "cluster.gpus_per_engine and cluster.trainer_gpus must be >= 0, cluster.trainer_share in [0, 1)"
        )
    if not 0 <= cfg.cost.train_gen_share < 1:
        raise ConfigError("cost.train_gen_share must be in [0, 1) (0: use cost.mfu_train)")
    if cfg.sched.max_staleness is not None and cfg.sched.max_staleness < 0:
        raise ConfigError("sched.max_staleness must be >= 0 or null")
    if cfg.sched.admit_lag < 1:
        raise ConfigError("sched.admit_lag must be >= 1")
    if cfg.warmup_updates < 0 or cfg.warmup_updates >= cfg.workload.steps:
        raise ConfigError(
            f"warmup_updates={cfg.warmup_updates} must be >= 0 and below workload.steps={cfg.workload.steps}"
        )
    try:
        points = [[float(b), float(t)] for b, t in cfg.cost.decode_points]
    except (TypeError, ValueError):
        raise ConfigError("cost.decode_points: a list of [batch, seconds per decode step] pairs") from None
    if any(b <= 0 or t <= 0 for b, t in points):
        raise ConfigError("cost.decode_points: batches and seconds must be > 0")
    cfg.cost.decode_points = points
    if cfg.workload.version_rule not in VERSION_RULES:
        raise ConfigError(
            f"workload.version_rule={cfg.workload.version_rule!r}: choose one of {', '.join(VERSION_RULES)}"
        )
    for i, tool in enumerate(cfg.workload.tools):
        if tool.calls < 0:
            raise ConfigError(f"workload.tools[{i}].calls must be >= 0 (got {tool.calls})")
        _validate_latency_fields(tool.latency, f"workload.tools[{i}].latency")
    return cfg


def load_simulate_config(overrides=()) -> SimulateConfig:
    """Hydra overrides -> a validated :class:`SimulateConfig` (``conf/simulate.yaml``); raises
    :class:`ConfigError` naming the offending key, like ``conf.loader.load_config``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException

    from conf.loader import CONF_DIR, _explain_composition, check_override_sizes

    check_override_sizes(overrides)  # before Hydra's parser, as for the pipeline's config
    ConfigStore.instance().store(name="simulate_schema", node=SimulateConfig)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            raw = compose(config_name="simulate", overrides=list(overrides))
    except HydraException as err:
        raise ConfigError(
            _explain_composition(err, overrides)
            .replace("`laminar config` prints", "conf/simulate.py lists")
            .replace("`laminar config` shows", "conf/simulate.py shows")
        ) from None
    return _typed(raw)


def simulate_config(data: Mapping[str, Any] | None = None) -> SimulateConfig:
    """A validated :class:`SimulateConfig` from a nested mapping over the schema's defaults (not
    ``conf/simulate.yaml``, so ``cost.train_gen_share`` stays 0), for code that builds configs:
    benchmarks and tests. Unknown keys and wrong types fail as in :func:`load_simulate_config`."""
    from omegaconf import OmegaConf

    return _typed(OmegaConf.create(dict(data or {})))


def _typed(raw) -> SimulateConfig:
    """A composed or built node -> the validated dataclass; errors name the key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from conf.loader import _unknown_keys

    unknown = _unknown_keys(raw, SimulateConfig)
    if unknown:
        raise ConfigError(
            f"unknown config key '{unknown[0]}': check the spelling (conf/simulate.py lists every key)"
        )
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SimulateConfig), raw))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        msg = str(err).splitlines()[0]
        if "not in struct" in str(err) or type(err).__name__ == "ConfigKeyError":
            raise ConfigError(
                f"unknown config key '{key}': check the spelling (conf/simulate.py lists every key)"
            ) from None
        raise ConfigError(
            f"config key '{key}': {msg}; give {key} a value of the type its default has"
        ) from None
    assert isinstance(cfg, SimulateConfig)
    return validate_simulate(cfg)
