"""The rollout-equals-trainer check shared by the LoRA tests: after each update, the log-probs a
rollout computes for a fixed sequence must equal the trainer's for the version the rollout says it
holds. An adapter that never reaches the rollouts (verl's asynchronous-trainer bug, its issue 7495)
leaves them on an older version's weights under a newer version number, and fails it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from conf.schema import LoraConfig
from generation.model import build_char_tokenizer, build_tiny_model, save_model
from tests.training.rl_fakes import MICRO

TOL = 1e-4


@dataclass(frozen=True)
class EvenLength:
    """A reward that varies within every group (a random model never answers right, and groups of
    equal rewards carry no gradient): even-length responses are "correct"."""

    correct: bool

    @property
    def reward(self) -> float:
        return float(self.correct)


class EvenLengthVerifier:
    def verify_batch(self, texts, answers):
        return [EvenLength(len(t) % 2 == 0) for t in texts]


def probe_tokens(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] + list(
        tokenizer("3+4=7 and 12-5=7\n#### 7", add_special_tokens=False)["input_ids"]
    )


def write_base_and_adapter(root: Path, rank: int = 4) -> tuple[Path, Path]:
    """A micro base model and an adapter on it whose lora_B is not zero (as after RFT), so the bare
    base and the adapted model differ from version 0 on."""
    from training.lora import load_trainable, save_trained

    base, adapter = Path(root) / "base", Path(root) / "adapter"
    tok = build_char_tokenizer()
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, base)
    model, tokenizer, _ = load_trainable(
        base, LoraConfig(enabled=True, rank=rank, alpha=2.0 * rank), "rl", seed=0
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_trained(model, tokenizer, adapter)
    return base, adapter


def check_rollouts_match(
    trainer_lp: dict[int, list[float]], seen: list[tuple[str, int, list[float]]], tol: float = TOL
) -> int:
    """Every (rollout, version, log-probs) seen equals the trainer's log-probs of that version; returns
    how many observations of a version after 0 were checked (the caller asserts some were)."""
    assert seen, "no rollout was probed"
    checked = 0
    for who, version, lp in seen:
        assert version in trainer_lp, f"{who} holds version {version}, which the trainer never had"
        gap = max(abs(a - b) for a, b in zip(lp, trainer_lp[version]))
        assert gap <= tol, (
            f"{who} says it holds version {version} but its log-probs differ from the "
            f"trainer's for that version by up to {gap:.3g} (> {tol})"
        )
        checked += version > 0
    return checked


def versions_differ(trainer_lp: dict[int, list[float]], tol: float = TOL) -> None:
    """The check can tell versions apart: each update moved the probe's log-probs by far more than ``tol``."""
    vs = sorted(trainer_lp)
    for a, b in zip(vs, vs[1:]):
        gap = max(abs(x - y) for x, y in zip(trainer_lp[a], trainer_lp[b]))
        assert gap > 10 * tol, f"versions {a} and {b} give the probe nearly the same log-probs ({gap:.3g})"
