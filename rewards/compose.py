"""The composed reward: ``math_verify`` (the correctness verdict) plus shaping components, totalled
as their weighted sum. Built from ``conf.schema.RewardConfig``; what RL, curation and evaluation
score with."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from conf.schema import RewardComponentConfig, RewardConfig, SandboxConfig
from rewards.components import SHAPING, Sample
from rewards.reward_model import RewardModelComponent
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


class Reward:
    """Weighted components over one verifier. ``verifier``: anything with ``verify_batch(texts,
    golds) -> [Verdict]`` (the math verifier, or a test's fake); ``weights``: component name ->
    weight, ``math_verify`` first; ``shaping``: the shaping components in config order."""

    def __init__(self, verifier, weights: dict[str, float], shaping: Sequence = ()) -> None:
        if MATH_VERIFY not in weights:
            raise ValueError("a Reward needs math_verify: it gives the correctness verdict")
        self.verifier = verifier
        self.weights = dict(weights)
        self.shaping = tuple(shaping)
        self.correctness = (MATH_VERIFY,)

    @classmethod
    def of(
        cls,
        verifier,
        cfg: RewardConfig | None = None,
        reward_model: str | None = None,
        template: str = "",
        sandbox: SandboxConfig | None = None,
    ) -> Reward:
        """The reward ``cfg`` composes (None: the verifier alone) over ``verifier``; a ``reward_model``
        component scores with the checkpoint folder ``reward_model`` (None: it describes itself only)
        and reads prompts put in ``template``; a component that runs code runs it under ``sandbox``
        (the run's ``sandbox`` settings)."""
        specs = cfg.components if cfg is not None else [RewardComponentConfig(name=MATH_VERIFY)]
        weights = {s.name: float(s.weight) for s in specs}
        shaping = [
            build_component(s, reward_model, template, sandbox) for s in specs if s.name != MATH_VERIFY
        ]
        return cls(verifier, weights, shaping)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.weights)

    def spec(self) -> list[dict]:
        """The composition as JSON: per component its name, weight, whether it is the correctness
        verdict, and its parameters."""
        out = [{"name": MATH_VERIFY, "weight": self.weights[MATH_VERIFY], "correctness": True, "params": {}}]
        for c in self.shaping:
            params = asdict(c.params)
            out.append(
                {"name": c.name, "weight": self.weights[c.name], "correctness": False, "params": params}
            )
        return out

    def with_component(self, component, weight: float = 1.0) -> Reward:
        """This reward plus ``component`` (unless one of its name is already there)."""
        if component.name in self.weights:
            return self
        return Reward(self.verifier, {**self.weights, component.name: weight}, (*self.shaping, component))

    def score(self, samples: Sequence[Sample]) -> Scores:
        verdicts = tuple(self.verifier.verify_batch([s.text for s in samples], [s.answer for s in samples]))
        correct = [v.correct for v in verdicts]
        terms = {MATH_VERIFY: tuple(1.0 if c else 0.0 for c in correct)}
        failed = {MATH_VERIFY: tuple(bool(getattr(v, "error", None)) for v in verdicts)}
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


PROVIDERS: dict[str, str] = {"code_tests": "environments.code"}
"""Component name -> the module above this layer that provides it (it runs programs in the sandbox);
``build_component`` imports it by name the first time the component is built, and the module calls
``register_component``. Nothing here imports it statically, so the layer order holds."""

_registered: dict[str, tuple[type, Callable]] = {}


def register_component(name: str, params_cls: type, factory: Callable) -> None:
    """Make ``name`` buildable: ``factory(params, sandbox)`` returns the component (``params``: a
    ``params_cls``, the schema ``conf.schema.REWARD_PARAMS[name]`` declares; ``sandbox``: the run's
    ``SandboxConfig``, None for the defaults). Called once, at import, by the module
    ``PROVIDERS[name]`` names."""
    if name in SHAPING:
        raise ValueError(f"reward component {name!r} is built in; register another name")
    _registered[name] = (params_cls, factory)


def build_component(
    spec: RewardComponentConfig,
    reward_model: str | None = None,
    template: str = "",
    sandbox: SandboxConfig | None = None,
):
    """A shaping component from its validated spec (``RewardComponentConfig.params()``); the learned
    reward model's over the checkpoint folder ``reward_model``, reading prompts put in ``template``;
    a registered one (code_tests) with the run's ``sandbox`` settings."""
    if spec.name == REWARD_MODEL:
        return RewardModelComponent(spec.params(), reward_model, template or "{problem}")
    if spec.name in SHAPING:
        cls, _ = SHAPING[spec.name]
        return cls(spec.params())
    if spec.name not in _registered and spec.name in PROVIDERS:
        importlib.import_module(PROVIDERS[spec.name])
    if spec.name not in _registered:
        raise ValueError(f"reward component {spec.name!r} is not registered (no module provides it)")
    _, factory = _registered[spec.name]
    return factory(spec.params(), sandbox)


def as_reward(scorer) -> Reward:
    """``scorer`` itself when it is a ``Reward``; a bare verifier is the math verifier alone."""
    return scorer if isinstance(scorer, Reward) else Reward.of(scorer)


def open_reward(cfg: RewardConfig | None, timeout_s: float) -> tuple[Verifier, Reward]:
    """A fresh math verifier (a context manager: it owns a worker pool) and the reward over it."""
    verifier = Verifier(timeout_s=timeout_s)
    return verifier, Reward.of(verifier, cfg)
