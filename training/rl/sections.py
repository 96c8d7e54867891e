"""The config sections one RL run reads, as one object (``RLSections``): the RL stage hands it to
its driver and the driver to its actors, so a new option (or a new section the run reads) changes the
schema and this class, never the signatures in between."""

from __future__ import annotations

from dataclasses import dataclass, field

from conf.schema import (
    ClusterConfig,
    Config,
    EngineOptions,
    EnvMixConfig,
    EnvConfig,
    LoraConfig,
    RLConfig,
    RolloutConfig,
    SandboxConfig,
    SelectConfig,
    TeacherConfig,
    TrainerConfig,
)


@dataclass(frozen=True)
class RLSections:
    """``rl`` (``RLConfig``), the run's ``seed``, the engine (``rollout``), the trainer, where the
    roles run (``cluster``: the Ray driver), and the optional ones: ``env`` (None: single-turn),
    ``sandbox`` (None: the defaults), ``select`` (HIVE's online pruning; None: off) and ``lora``
    (None: off). Every default is the schema's (``RLSections.of(cfg)`` takes a whole config's)."""

    rl: RLConfig
    seed: int
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    env: EnvConfig | None = None
    sandbox: SandboxConfig | None = None
    select: SelectConfig | None = None
    lora: LoraConfig | None = None
    envs: tuple[EnvMixConfig, ...] = ()
    """Several environments in one run, weighted (``envs``; empty: ``env`` alone)."""
    teacher: TeacherConfig | None = None
    """``rl.algorithm=opd``'s teacher (``training.rl.teacher``); None: none."""

    @classmethod
    def of(cls, cfg: Config) -> RLSections:
        """The sections of the validated config ``cfg``."""
        return cls(
            rl=cfg.rl,
            seed=cfg.seed,
            rollout=cfg.rollout,
            trainer=cfg.trainer,
            cluster=cfg.cluster,
            env=cfg.env,
            sandbox=cfg.sandbox,
            select=cfg.curation.select,
            lora=cfg.model.lora,
            envs=tuple(cfg.envs),
            teacher=cfg.teacher,
        )

    def engine_options(self, capacity: int, lora_rank: int = 0) -> EngineOptions:
        """A rollout engine's options: ``capacity`` rows, the RL run's sampling and seed, the rollout
        section's engine, started for LoRA adapters of ``lora_rank`` (0: none)."""
        return EngineOptions(
            capacity=capacity,
            max_new_tokens=self.rl.max_new_tokens,
            temperature=self.rl.temperature,
            seed=self.seed,
            lora_rank=lora_rank,
            rollout=self.rollout,
        )
