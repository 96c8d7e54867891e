"""The verdict: the one reward component per run that judges correctness (docs/plugins.md).

Every stage that asks "is this response right?" (DAPO's filter, HIVE and GRESO, difficulty, DART and
so RFT's data, evaluation's avg@n, pass@k and maj@k) asks the run's verdict through one interface,
``verify_batch(texts, golds) -> [Verdict]``, which the math verifier has always had. ``math_verify``
is the math verifier itself (its worker pool, unchanged); any other component (``code_tests``, a
plug-in) is wrapped in ``ComponentVerdict``: correct when it scores at least ``threshold``, or as the
``Verdict`` / bool it returns says. A verdict that raises on a sample judges it wrong, with an
``error``, counted (``reward_errors/<name>``).
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from conf.schema import RewardComponentConfig, RewardConfig, SandboxConfig
from rewards.components import Sample
from rewards.registry import ClassComponent, FunctionComponent, build_component
from rewards.verifier import Verdict, Verifier, extract_answer

MATH_VERIFY = "math_verify"


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


@dataclass(frozen=True)
class _Failed:
    """A sample the component could not judge, and why."""

    reason: str


class ComponentVerdict:
    """A reward component as a verdict. ``component``: anything with ``name``, ``fallback`` and
    ``score(samples, correct)`` (its ``correct`` is all None: the verdict is what decides it);
    ``threshold``: the score from which a response is correct. ``calls`` counts the samples judged."""

    def __init__(self, component: Any, threshold: float = 1.0) -> None:
        self.component = component
        self.name = component.name
        self.threshold = float(threshold)
        self.calls = 0

    def _raw(self, samples: Sequence[Sample]) -> list[tuple[Any, str | None]]:
        """Per sample, (the component's result, None) or (None, the error it raised)."""

        def batch(chunk: Sequence[Sample]) -> list[Any]:
            if isinstance(self.component, FunctionComponent | ClassComponent):
                return self.component.results(chunk)  # bools and Verdicts as the plug-in gave them
            if hasattr(self.component, "score_reasons"):  # code_tests: a failed judging says why
                pairs = self.component.score_reasons(chunk, [None] * len(chunk))
                return [_Failed(r) if r else x for x, r in pairs]
            return list(self.component.score(chunk, [None] * len(chunk)))

        try:
            out = batch(samples)
            if len(out) == len(samples):
                return [(None, x.reason) if isinstance(x, _Failed) else (x, None) for x in out]
        except Exception:  # noqa: BLE001 - judged again one sample at a time below
            pass
        raw = []
        for s in samples:
            try:
                (x,) = batch([s])
                raw.append((None, x.reason) if isinstance(x, _Failed) else (x, None))
            except Exception as e:  # noqa: BLE001 - a sample that breaks the verdict is judged wrong
                raw.append((None, _one_line(e)))
        return raw

    def _verdict(self, x: Any, sample: Sample) -> tuple[Verdict, float]:
        """The verdict of one result; a verdict without its own ``pred`` gets the response's final
        answer as math extracts it (None when it has none): what maj@k votes on."""
        if isinstance(x, Verdict):
            own = x if x.pred is not None else replace(x, pred=extract_answer(sample.text))
            return own, float(x.correct)
        if isinstance(x, bool):
            return Verdict(x, extract_answer(sample.text)), 1.0 if x else 0.0
        score = float(x)
        if score != score or score in (float("inf"), float("-inf")):
            raise ValueError(f"{self.name} scored {score}")
        return Verdict(score >= self.threshold, extract_answer(sample.text)), score

    def judge(self, samples: Sequence[Sample]) -> tuple[tuple[Verdict, ...], list[float], list[bool]]:
        """(a ``Verdict`` per sample, the component's score, whether it got the fallback)."""
        self.calls += len(samples)
        verdicts, scores, failed = [], [], []
        for sample, (x, error) in zip(samples, self._raw(samples)):
            if error is None:
                try:
                    v, score = self._verdict(x, sample)
                except (TypeError, ValueError) as e:
                    error = _one_line(e)
            if error is not None:
                v, score = Verdict(False, None, f"error: {error}"), float(self.component.fallback)
            verdicts.append(v)
            scores.append(score)
            failed.append(error is not None)
        return tuple(verdicts), scores, failed

    def verify_batch(self, responses: Sequence[str], golds: Sequence[Any]) -> list[Verdict]:
        """The stage libraries' interface: text and gold answer only (no lengths, no prompt)."""
        if len(responses) != len(golds):
            raise ValueError(f"verify_batch needs one gold per response: {len(responses)} and {len(golds)}")
        samples = [Sample(t, "" if g is None else str(g), 0, 0) for t, g in zip(responses, golds)]
        return list(self.judge(samples)[0])

    def verify(self, response: str, gold: Any) -> Verdict:
        return self.verify_batch([response], [gold])[0]

    def close(self) -> None:
        close = getattr(self.component, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> ComponentVerdict:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class MathVerify:
    """``math_verify`` as a component beside another verdict (a shaping term, or a benchmark's
    ``score_with``): 1 when the math verifier accepts the response, else 0. As the run's verdict it is
    the ``Verifier`` itself (``verdict_of``)."""

    params: Any = None
    name: str = MATH_VERIFY
    correctness: bool = False
    fallback: float = 0.0

    def score(self, samples: Sequence[Sample], correct: Sequence[bool | None]) -> list[float]:
        verifier = shared_verifier()
        verdicts = verifier.verify_batch([s.text for s in samples], [s.answer for s in samples])
        return [1.0 if v.correct else 0.0 for v in verdicts]


def shared_verifier() -> Verifier:
    """One math verifier per process for ``MathVerify`` terms (closed at exit)."""
    from rewards import verifier as module

    with module._shared_lock:
        if module._shared is None:
            module._shared = Verifier()
            atexit.register(module._shared.close)
        return module._shared


def verdict_of(
    spec: RewardComponentConfig, timeout_s: float, sandbox: SandboxConfig | None = None
) -> Verifier | ComponentVerdict:
    """The verdict ``spec`` names, ready to judge (close it, or use it as a context manager): the math
    verifier for the built-in ``math_verify``, else the component wrapped."""
    if spec.is_builtin() and spec.name == MATH_VERIFY:
        return Verifier(timeout_s=timeout_s)
    return ComponentVerdict(build_component(spec, sandbox=sandbox), spec.threshold)


def open_verdict(
    cfg: RewardConfig | None, timeout_s: float, sandbox: SandboxConfig | None = None
) -> Verifier | ComponentVerdict:
    """The run's verdict (``RewardConfig.verdict``; None: the math verifier); code it runs runs under
    ``sandbox`` (the run's settings)."""
    if cfg is None:
        return Verifier(timeout_s=timeout_s)
    return verdict_of(cfg.verdict(), timeout_s, sandbox)


def benchmark_verdict(
    name: str, params: dict | None, timeout_s: float, sandbox: SandboxConfig | None = None
) -> Verifier | ComponentVerdict:
    """A file benchmark's verdict (``BenchmarkFileConfig.verdict``): a short name or an import path."""
    spec = RewardComponentConfig.of(name=name, params=dict(params or {}), verdict=True)
    return verdict_of(spec, timeout_s, sandbox)
