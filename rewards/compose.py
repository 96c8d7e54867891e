"""The composed reward: the run's verdict (the component that judges correctness: ``math_verify``
by default, ``code_tests`` for a code pool, or any component marked ``verdict: true``) plus shaping
components, totalled as their weighted sum. Built from ``conf.schema.RewardConfig``; what RL,
curation and evaluation score with. Components are built by ``rewards.registry`` (built-ins and
plug-ins by import path alike); the verdict is opened by ``rewards.verdicts``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from conf.schema import RewardComponentConfig, RewardConfig, SandboxConfig
from rewards.components import Sample
from rewards.registry import build_component, component_spec
from rewards.verifier import Verdict, Verifier

MATH_VERIFY = "math_verify"
REWARD_MODEL = "reward_model"


@dataclass(frozen=True)
class Scores:
    """One batch's scores. Invariant: every tuple, and each ``terms`` entry, has one item per sample.
    ``terms``: component name -> its unweighted score per sample; ``total``: the weighted sum;
    ``failed``: component name -> per sample, whether it got the component's fallback score (for
    ``math_verify``: a verdict with an ``error``, scored as wrong); also ``<name>/<reason>`` for
    each reason a component gave (``safe_scores``), so ``errors`` counts them per reason."""

    verdicts: tuple[Verdict, ...]
    terms: dict[str, tuple[float, ...]]
    total: tuple[float, ...]
    failed: dict[str, tuple[bool, ...]] = field(default_factory=dict)

    @property
    def errors(self) -> dict[str, int]:
        """Component name -> how many samples got its fallback score."""
        return {k: sum(v) for k, v in self.failed.items()}

    @property
    def correct(self) -> tuple[bool, ...]:
        return tuple(v.correct for v in self.verdicts)

    def means(self) -> dict[str, float]:
        """``reward/<name>``: each component's mean, ``reward/total`` and ``reward_errors/<name>``."""
        n = max(1, len(self.total))
        out = {f"reward/{k}": sum(v) / n for k, v in self.terms.items()}
        out["reward/total"] = sum(self.total) / n
        out.update({f"reward_errors/{k}": float(v) for k, v in self.errors.items()})
        return out


def safe_scores(
    component, samples: Sequence[Sample], correct: Sequence[bool], why: list | None = None
) -> tuple[list[float], list[bool]]:
    """The component's scores of the batch and which samples failed: where it raises (or returns a
    non-finite number) on a sample, that sample gets the component's ``fallback``. A component with
    ``score_reasons`` (per sample: score and why it failed, None if it did not) says itself which
    failed; ``why`` (if given) gets each sample's reason."""
    why = why if why is not None else []
    try:
        scores, reasons = _scored(component, samples, correct)
        if len(scores) == len(samples) and all(math.isfinite(x) for x in scores):
            why.extend(reasons)
            return scores, [r is not None for r in reasons]
    except Exception:  # noqa: BLE001 - any failure of a component falls back per sample below
        pass
    out, failed = [], []
    for s, c in zip(samples, correct):
        try:
            (x,), (r,) = _scored(component, [s], [c])
            if not math.isfinite(x):
                raise ValueError(f"{component.name} scored {x}")
        except Exception:  # noqa: BLE001 - a bad sample gets the documented fallback, never a crash
            x, r = None, None
        failed.append(x is None or r is not None)
        out.append(float(component.fallback) if x is None else x)
        why.append(r)
    return out, failed


def _scored(component, samples, correct) -> tuple[list[float], list[str | None]]:
    """Scores and failure reasons (None: none) of a batch; a reason's sample scores the fallback."""
    if hasattr(component, "score_reasons"):
        pairs = list(component.score_reasons(samples, correct))
        return [float(component.fallback) if r else float(x) for x, r in pairs], [r for _, r in pairs]
    return [float(x) for x in component.score(samples, correct)], [None] * len(samples)


def judge(verdict, samples: Sequence[Sample]) -> tuple[tuple[Verdict, ...], list[float], list[bool]]:
    """The verdict's judgement of ``samples``: (verdicts, its score per sample, which samples got its
    fallback). ``verdict``: a ``rewards.verdicts.ComponentVerdict`` (it has ``judge``), or anything
    with ``verify_batch(texts, golds) -> [Verdict]`` (the math verifier, a test's fake): 1 or 0, an
    ``error`` counted as a fallback."""
    if hasattr(verdict, "judge"):
        return verdict.judge(samples)
    verdicts = tuple(verdict.verify_batch([s.text for s in samples], [s.answer for s in samples]))
    failed = [bool(getattr(v, "error", None)) for v in verdicts]
    return verdicts, [1.0 if v.correct else 0.0 for v in verdicts], failed


class Reward:
    """Weighted components over one verdict. ``verifier``: the run's verdict (see ``judge``);
    ``weights``: component name -> weight; ``shaping``: the other components in config order;
    ``verdict``: the verdict's name (a key of ``weights``); ``specs``: name -> its line of ``spec``
    (None: built from the components)."""

    def __init__(
        self,
        verifier,
        weights: dict[str, float],
        shaping: Sequence = (),
        verdict: str = MATH_VERIFY,
        specs: dict[str, dict] | None = None,
    ) -> None:
        if verdict not in weights:
            raise ValueError(f"a Reward needs its verdict {verdict!r} among its components {list(weights)}")
        self.verifier = verifier
        self.weights = dict(weights)
        self.shaping = tuple(shaping)
        self.verdict = verdict
        self.correctness = (verdict,)
        self.specs = dict(specs or {})

    @classmethod
    def of(
        cls,
        verifier,
        cfg: RewardConfig | None = None,
        reward_model: str | None = None,
        template: str = "",
        sandbox: SandboxConfig | None = None,
    ) -> Reward:
        """The reward ``cfg`` composes (None: the verifier alone) over ``verifier`` (the run's verdict,
        opened by ``rewards.verdicts.open_verdict``); a ``reward_model`` component scores with the
        checkpoint folder ``reward_model`` (None: it describes itself only) and reads prompts put in
        ``template``; a component that runs code runs it under ``sandbox`` (the run's settings)."""
        cfg = (
            cfg if cfg is not None else RewardConfig(components=[RewardComponentConfig.of(name=MATH_VERIFY)])
        )
        judge_spec = cfg.verdict()
        weights = {s.name: float(s.weight) for s in cfg.components}
        shaping, specs = [], {}
        for s in cfg.components:
            if s is judge_spec:
                component = getattr(verifier, "component", None)
                specs[s.name] = component_spec(s, component, True)
                continue
            component = build_component(s, reward_model, template, sandbox)
            shaping.append(component)
            specs[s.name] = component_spec(s, component, False)
        return cls(verifier, weights, shaping, judge_spec.name, specs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.weights)

    def spec(self) -> list[dict]:
        """The composition as JSON: per component its name, weight, whether it is the correctness
        verdict, its parameters (and a plug-in's target), the verdict first."""
        out = []
        for name in (self.verdict, *(n for n in self.weights if n != self.verdict)):
            line = self.specs.get(name)
            if line is None:
                comp = next((c for c in self.shaping if c.name == name), None)
                line = component_spec(
                    RewardComponentConfig.of(name=name, weight=self.weights[name]), comp, name == self.verdict
                )
            out.append({**line, "weight": self.weights[name]})
        return out

    def with_component(self, component, weight: float = 1.0) -> Reward:
        """This reward plus ``component`` (unless one of its name is already there)."""
        if component.name in self.weights:
            return self
        return Reward(
            self.verifier,
            {**self.weights, component.name: weight},
            (*self.shaping, component),
            self.verdict,
            self.specs,
        )

    def score(self, samples: Sequence[Sample]) -> Scores:
        verdicts, verdict_scores, verdict_failed = judge(self.verifier, samples)
        correct = [v.correct for v in verdicts]
        terms = {self.verdict: tuple(verdict_scores)}
        failed = {self.verdict: tuple(verdict_failed)}
        for comp in self.shaping:
            why: list = []
            scores, flags = safe_scores(comp, samples, correct, why)
            terms[comp.name], failed[comp.name] = tuple(scores), tuple(flags)
            for reason in sorted({r for r in why if r}):
                failed[f"{comp.name}/{reason}"] = tuple(r == reason for r in why)
        total = tuple(
            sum(self.weights[name] * terms[name][i] for name in self.weights) for i in range(len(samples))
        )
        return Scores(verdicts=verdicts, terms=terms, total=total, failed=failed)


_registered: dict[str, tuple[type, Callable]] = {}


def register_component(name: str, params_cls: type, factory: Callable) -> None:
    """Kept for modules that announce a built-in at import (``environments.code``: ``factory(params,
    sandbox)``): built-ins are listed in ``rewards.registry.REWARDS``, which builds them; this only
    records the announcement."""
    _registered[name] = (params_cls, factory)


def as_reward(scorer) -> Reward:
    """``scorer`` itself when it is a ``Reward``; a bare verifier is the math verifier alone."""
    return scorer if isinstance(scorer, Reward) else Reward.of(scorer)


def open_reward(cfg: RewardConfig | None, timeout_s: float) -> tuple[Verifier, Reward]:
    """The run's verdict (a context manager: the math verifier owns a worker pool) and the reward
    over it."""
    from rewards.verdicts import open_verdict

    verifier = open_verdict(cfg, timeout_s)
    return verifier, Reward.of(verifier, cfg)
