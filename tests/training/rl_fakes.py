"""Small real fakes shared by the RL loop tests: a micro model config and a verdict record."""

from dataclasses import dataclass

from conf.schema import ModelConfig

MICRO = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=32
)


@dataclass(frozen=True)
class Verdict:
    """What the loop reads of a verifier's verdict."""

    correct: bool

    @property
    def reward(self) -> float:
        return float(self.correct)


def saved_model(folder, model, tokenizer):
    """``model`` and ``tokenizer`` written as a checkpoint folder, which the RL drivers start from."""
    from pathlib import Path

    from generation.model import save_model

    save_model(model, tokenizer, Path(folder))
    return Path(folder)


def ray_rl(mode: str, **overrides):
    """A short ``rl.runtime=ray`` run of ``mode`` for the runtime tests: 3 steps of 4 prompts x 2, two
    rollouts' worth of capacity, a loose staleness bound and frequent repack checks (``overrides``:
    any other ``RLConfig`` field)."""
    from conf.schema import RLConfig

    kw = dict(
        mode=mode,
        runtime="ray",
        steps=3,
        prompts_per_step=4,
        group_size=2,
        lr=1e-3,
        max_new_tokens=12,
        rollout_capacity=8,
        chunk_steps=4,
        max_staleness=4,
        repack_interval_s=0.2,
        micro_batch_tokens=0,
    )
    return RLConfig(**{**kw, **overrides})
