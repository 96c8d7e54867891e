"""Typed schema of the pipeline configuration.

Hydra composes the YAML tree in ``conf/``; :func:`conf.load_config` merges the result into these
dataclasses, so an unknown key or a wrong type fails at start, before anything is written.
Cross-field rules live in :func:`validate`. Every default lives here; the YAML tree sets only what
a config group changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class ModelConfig:
    """Which model to train. ``kind=tiny`` builds a Llama-architecture model and a character-level
    tokenizer from the fields below; ``kind=hf`` loads any local Hugging Face causal LM from ``path``."""

    kind: str = "tiny"
    path: Optional[str] = None
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_seq_len: int = 160
    rope_theta: float = 10000.0


@dataclass
class DataConfig:
    """The prompt pool and the held-out evaluation set of the synthetic arithmetic task."""

    source: str = "arith"
    pool_size: int = 6000
    heldout_size: int = 300
    levels: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    demo_error_rate: float = 0.15
    """Per-step chance that a warm-up demonstration's result is off by 1-2 (an imperfect teacher);
    gold solutions and answers stay exact. RL with the verifier is what corrects the slips."""


@dataclass
class SFTConfig:
    """Warm-up supervised fine-tuning on the prompt pool's demonstrations (of ``levels``)."""

    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    levels: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])


@dataclass
class RLConfig:
    """Reinforcement learning on the prompt pool. ``mode=sync`` generates a batch of groups with
    the current weights, scores it, takes one update and refreshes the sampler's weights."""

    algorithm: str = "grpo"
    mode: str = "sync"
    steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-4
    max_new_tokens: int = 64
    temperature: float = 1.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    minibatches: int = 1
    """Optimizer steps per collected batch (verl's ppo_mini_batch split). With 1 the update is
    on-policy and the clip bounds never bind; with more, later steps are clipped against the
    proximal log-probs taken before the first."""
    # Overrides of the algorithm's preset (training.objectives.PRESETS); None keeps the preset's value.
    advantage: Optional[str] = None  # grpo | dr_grpo | batch
    loss_agg: Optional[str] = None  # token_mean | seq_mean | seq_sum_const
    behaviour_weight: Optional[str] = None  # truncate | mask | none (off-policy correction)
    is_cap: Optional[float] = None
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    dual_clip: Optional[float] = None
    dynamic_sampling: Optional[bool] = None
    max_sampling_rounds: Optional[int] = None
    overlong_shaping: Optional[bool] = None
    overlong_filter: Optional[bool] = None
    kl_coef: Optional[float] = None
    overlong_cache_len: int = 16
    """DAPO's soft-punishment buffer L_cache, in tokens before ``max_new_tokens`` (the paper uses
    4,096 of 20,480; here 16 of 64, the same order of share)."""


@dataclass
class EvalConfig:
    """Held-out evaluation of checkpoints: ``n_samples`` sampled responses per problem (avg@n)."""

    benchmarks: List[str] = field(default_factory=lambda: ["arith_heldout"])
    n_samples: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 64
    batch_size: int = 256
    verifier_timeout_s: float = 5.0
    """Per-answer limit of the math-verify worker (the RL reward uses the same verifier and limit)."""


@dataclass
class Config:
    seed: int = 0
    device: str = "cpu"
    threads: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


MODEL_KINDS = ("tiny", "hf")
DATA_SOURCES = ("arith",)
RL_ALGORITHMS = ("grpo", "dapo", "dr_grpo")  # the keys of training.objectives.PRESETS (a test checks)
RL_MODES = ("sync",)
DEVICES = ("cpu", "cuda", "auto")


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what to change."""


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported; set {key} to one of: {', '.join(allowed)}")


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        node: object = cfg
        for part in key.split("."):
            node = getattr(node, part)
        if not node > 0:  # type: ignore[operator]
            raise ConfigError(f"{key}={node} must be > 0; set {key} to a positive value")


def validate(cfg: Config) -> Config:
    """Cross-field checks: impossible combinations fail here, before any write. Checks that need the
    libraries or the file system (benchmark names, model folders) are in ``tasks.preflight``."""
    _one_of("model.kind", cfg.model.kind, MODEL_KINDS)
    _one_of("data.source", cfg.data.source, DATA_SOURCES)
    _one_of("rl.algorithm", cfg.rl.algorithm, RL_ALGORITHMS)
    _one_of("rl.mode", cfg.rl.mode, RL_MODES)
    _one_of("device", cfg.device, DEVICES)
    if cfg.model.kind == "hf" and not cfg.model.path:
        raise ConfigError("model=hf needs a local model folder: add model.path=DIR (a save_pretrained folder)")
    if cfg.model.kind == "tiny" and cfg.model.path:
        raise ConfigError("model.path is only read with model=hf; add model=hf or drop model.path")
    if cfg.model.hidden_size % cfg.model.num_heads:
        raise ConfigError(
            f"model.hidden_size={cfg.model.hidden_size} must be divisible by model.num_heads={cfg.model.num_heads}"
        )
    if cfg.model.num_heads % cfg.model.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={cfg.model.num_heads} must be a multiple of model.num_kv_heads={cfg.model.num_kv_heads}"
        )
    _positive(cfg, "sft.batch_size", "sft.lr", "rl.prompts_per_step", "rl.minibatches", "rl.lr", "rl.max_new_tokens",
              "rl.temperature", "eval.n_samples", "eval.temperature", "eval.max_new_tokens",
              "eval.batch_size", "data.pool_size", "data.heldout_size")
    if cfg.sft.steps < 0 or cfg.rl.steps < 0:
        raise ConfigError("sft.steps and rl.steps must be >= 0")
    if cfg.rl.group_size < 2:
        raise ConfigError(
            f"rl.group_size={cfg.rl.group_size}: group advantages need at least 2 responses per prompt; "
            "set rl.group_size>=2"
        )
    bad_levels = [lv for lv in cfg.data.levels if lv not in range(1, 6)]
    if bad_levels or not cfg.data.levels:
        raise ConfigError(f"data.levels={cfg.data.levels}: levels are 1..5; pick a non-empty subset")
    if not 0 <= cfg.data.demo_error_rate < 1:
        raise ConfigError(f"data.demo_error_rate={cfg.data.demo_error_rate} must be in [0, 1)")
    if not set(cfg.sft.levels) & set(cfg.data.levels):
        raise ConfigError(f"sft.levels={cfg.sft.levels} shares no level with data.levels={cfg.data.levels}; "
                          "warm-up would have no examples")
    if cfg.rl.dual_clip is not None and cfg.rl.dual_clip <= 1:
        raise ConfigError(f"rl.dual_clip={cfg.rl.dual_clip} must be > 1 (verl uses 3.0) or null")
    if cfg.rl.max_sampling_rounds is not None and cfg.rl.max_sampling_rounds < 1:
        raise ConfigError("rl.max_sampling_rounds must be >= 1")
    if cfg.rl.kl_coef is not None and cfg.rl.kl_coef < 0:
        raise ConfigError("rl.kl_coef must be >= 0")
    if cfg.rl.clip_low is not None and not 0 <= cfg.rl.clip_low < 1:
        raise ConfigError(f"rl.clip_low={cfg.rl.clip_low} must be in [0, 1)")
    if cfg.rl.clip_high is not None and cfg.rl.clip_high < 0:
        raise ConfigError(f"rl.clip_high={cfg.rl.clip_high} must be >= 0")
    if not cfg.eval.benchmarks:
        raise ConfigError("eval.benchmarks is empty; name at least one, e.g. eval.benchmarks=[arith_heldout]")
    return cfg
