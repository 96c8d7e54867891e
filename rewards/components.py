"""Reward components: each scores a batch of responses at once and has a name, a weight and typed
parameters (``conf.schema``'s ``*Params``). Formulas and papers: docs/rewards.md.

``math_verify`` is the correctness component: its verdict is the ``correct`` every stage reads.
The others are shaping terms over a batch and the correctness verdicts already taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from conf.schema import CosineLengthParams, EndsWithParams, FormatParams, OverlongParams, RepetitionParams
from rewards.verifier import extract_answer, normalize_answer


@dataclass(frozen=True)
class Sample:
    """One response to score: its text, the gold answer, its length in tokens and the generation limit
    it was sampled under (``max_tokens``: the default length limit of ``cosine_length`` and
    ``overlong``); ``prompt``: the problem it answers (the learned reward model reads it; "" unknown);
    ``state``: a multi-turn episode's final environment state (``Trajectory.env_state``; None unknown),
    where an agent's return lies (``rewards.agent``)."""

    text: str
    answer: str
    n_tokens: int
    max_tokens: int
    prompt: str = ""
    state: object = field(default=None, compare=False, hash=False)


def _limit(max_len: int | None, sample: Sample) -> int:
    limit = int(max_len) if max_len is not None else int(sample.max_tokens)
    if limit <= 0:
        raise ValueError("no length limit: set max_len, or score samples with their max_tokens")
    return limit


@dataclass(frozen=True)
class CosineLength:
    """Yeo et al. 2025's cosine length-scaling reward: correct answers from r_0^c (length 0) to r_L^c
    (length L), wrong ones from r_0^w to r_L^w, and r_e at or past L."""

    params: CosineLengthParams
    name: str = "cosine_length"
    correctness: bool = False
    fallback: float = 0.0

    def value(self, n_tokens: int, correct: bool, limit: int) -> float:
        p = self.params
        if n_tokens >= limit:
            return float(p.r_exceed)
        r0, rl = (p.r0_correct, p.rl_correct) if correct else (p.r0_wrong, p.rl_wrong)
        return rl + 0.5 * (r0 - rl) * (1.0 + math.cos(math.pi * n_tokens / limit))

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        return [self.value(s.n_tokens, c, _limit(self.params.max_len, s)) for s, c in zip(samples, correct)]


def repeated_ngram_rate(text: str, n: int) -> float:
    """Share of the word n-grams of ``text`` (lower-cased, split on whitespace) that repeat an earlier
    one: ``1 - unique / all``; 0 when the text has fewer than ``n`` words."""
    words = text.lower().split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


@dataclass(frozen=True)
class Repetition:
    """N-gram repetition penalty: ``max_penalty * repeated_ngram_rate(text, ngram)`` (0 to max_penalty)."""

    params: RepetitionParams
    name: str = "repetition"
    correctness: bool = False
    fallback: float = 0.0

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        return [self.params.max_penalty * repeated_ngram_rate(s.text, self.params.ngram) for s in samples]


def overlong_penalty(length: int, max_len: int, cache_len: int) -> float:
    """DAPO's soft overlong punishment of one response of ``length`` tokens: 0 up to
    ``max_len - cache_len``, then a linear ramp to -1 at ``max_len``, -1 beyond."""
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong cache_len={cache_len} must be in (0, max_len={max_len}]")
    start = max_len - cache_len
    return max(-1.0, min(0.0, (start - length) / cache_len))


@dataclass(frozen=True)
class Overlong:
    """DAPO's soft overlong punishment (``overlong_penalty``) over L_max = ``max_len`` (default: the
    generation limit) and L_cache = ``cache_len``."""

    params: OverlongParams
    name: str = "overlong"
    correctness: bool = False
    fallback: float = 0.0

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        p = self.params
        return [overlong_penalty(s.n_tokens, _limit(p.max_len, s), p.cache_len) for s in samples]


@dataclass(frozen=True)
class Format:
    """1 when the response has a final answer (``\\boxed{...}``, ``#### ...`` or "The answer is N")
    that normalises to a non-empty string, else 0. Says nothing of whether the answer is right: not a
    correctness term."""

    params: FormatParams
    name: str = "format"
    correctness: bool = False
    fallback: float = 0.0

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        out = []
        for s in samples:
            raw = extract_answer(s.text)
            out.append(1.0 if raw is not None and normalize_answer(raw) else 0.0)
        return out


@dataclass(frozen=True)
class EndsWith:
    """1 when the response, trailing whitespace stripped, ends with ``suffix``, else 0."""

    params: EndsWithParams
    name: str = "ends_with"
    correctness: bool = False
    fallback: float = 0.0

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        return [1.0 if s.text.rstrip().endswith(self.params.suffix) else 0.0 for s in samples]


SHAPING = {
    "cosine_length": (CosineLength, CosineLengthParams),
    "repetition": (Repetition, RepetitionParams),
    "overlong": (Overlong, OverlongParams),
    "format": (Format, FormatParams),
    "ends_with": (EndsWith, EndsWithParams),
}
"""Shaping component name -> (its class, its parameters' schema). ``math_verify`` is built by
``rewards.compose.Reward`` around the verifier."""
