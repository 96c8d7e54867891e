"""A learned reward model as a reward component: a ``save_pretrained`` folder of an
``AutoModelForSequenceClassification`` with one label (safetensors only), loaded here with
``transformers`` itself (``rewards/`` sits below ``training/``). Scores are normalised with fixed
statistics (``(r - mean) / std``, measured once on reference responses) and optionally clipped to
``[-clip, clip]``: a bounded learned reward resists hacking."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rewards.components import Sample


def load_sequence_classifier(path: str | Path):
    """(model, tokenizer) from ``path``; a folder that is not a one-label sequence-classification
    checkpoint with safetensors weights is refused with what to pass."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = Path(path)
    cfg = path / "config.json"
    arch = json.loads(cfg.read_text()).get("architectures") or [] if cfg.is_file() else []
    if not any(a.endswith("ForSequenceClassification") for a in arch) or not list(path.glob("*.safetensors")):
        raise ValueError(
            f"reward model {path} is not a sequence-classification checkpoint with safetensors weights; "
            "pass the folder the reward_model stage saved"
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), use_safetensors=True, dtype=torch.float32
    )
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path} has {model.config.num_labels} labels; a reward model has 1")
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


@dataclass
class RewardModelScorer:
    """The ``reward_model`` component: scores each ``Sample.text`` (the sequence the model reads:
    prompt and response as it was trained on them), normalised by ``mean``/``std``, clipped to
    ``[-clip, clip]`` when ``clip`` is set."""

    model: object
    tokenizer: object
    mean: float = 0.0
    std: float = 1.0
    clip: float | None = None
    max_len: int = 160
    name: str = "reward_model"
    correctness: bool = False
    fallback: float = 0.0

    def raw(self, texts: Sequence[str]) -> list[float]:
        import torch

        out = []
        with torch.no_grad():
            for i in range(0, len(texts), 32):
                seqs = [
                    self.tokenizer(t, add_special_tokens=False)["input_ids"][-self.max_len :]
                    for t in texts[i : i + 32]
                ]
                width = max(len(s) for s in seqs)
                pad = self.tokenizer.pad_token_id
                ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
                out.extend(self.model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist())
        return out

    def calibrate(self, texts: Sequence[str]) -> RewardModelScorer:
        """Fix ``mean`` and ``std`` from the raw scores of reference ``texts``."""
        xs = self.raw(texts)
        m = sum(xs) / len(xs)
        sd = (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5
        self.mean, self.std = m, sd if sd > 1e-8 else 1.0
        return self

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        z = [(x - self.mean) / self.std for x in self.raw([s.text for s in samples])]
        if self.clip is not None:
            z = [max(-self.clip, min(self.clip, x)) for x in z]
        return z


STATS_FILE = "reward_stats.json"
"""Beside the reward model's weights: ``{"mean": m, "std": s}`` of its raw scores on the held-out
comparisons' responses (the reward_model stage writes it): the fixed statistics of ``normalize=fixed``."""


def rm_text(template: str, problem: str, response: str) -> str:
    """What the reward model reads: the prompt as the policy read it (``template`` with ``{problem}``
    replaced), then the response."""
    return template.replace("{problem}", problem) + response


class RewardModelUnavailable(RuntimeError):
    """A ``reward_model`` component asked to score with no checkpoint to score with."""


@dataclass
class RewardModelComponent:
    """The ``reward_model`` item of ``reward.components``: ``params`` (``conf.schema.RewardModelParams``)
    over the checkpoint at ``path`` (the reward_model stage's artifact), loaded on the first score;
    reads ``rm_text(template, sample.prompt, sample.text)``. With no ``path`` it only describes itself
    (the RL cache key's reward spec) and refuses to score."""

    params: object
    path: str | None = None
    template: str = "{problem}"
    name: str = "reward_model"
    correctness: bool = False
    fallback: float = 0.0
    _scorer: RewardModelScorer | None = None

    def scorer(self) -> RewardModelScorer:
        if self._scorer is None:
            if self.path is None:
                raise RewardModelUnavailable(
                    "the reward_model component has no checkpoint: run the reward_model stage "
                    "(laminar run reward=reward_model) or pass reward_model.path"
                )
            model, tok = load_sequence_classifier(self.path)
            mean, std = 0.0, 1.0
            stats = Path(self.path) / STATS_FILE
            if self.params.normalize == "fixed" and stats.is_file():
                s = json.loads(stats.read_text())
                mean, std = float(s["mean"]), float(s["std"]) or 1.0
            self._scorer = RewardModelScorer(model, tok, mean=mean, std=std, clip=self.params.clip)
        return self._scorer

    def raw(self, samples: Sequence[Sample]) -> list[float]:
        """Unnormalised, unclipped scores."""
        return self.scorer().raw([rm_text(self.template, s.prompt, s.text) for s in samples])

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        scorer = self.scorer()
        texts = [rm_text(self.template, s.prompt, s.text) for s in samples]
        return scorer.score(
            [Sample(t, s.answer, s.n_tokens, s.max_tokens) for t, s in zip(texts, samples)], correct
        )
