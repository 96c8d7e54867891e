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
