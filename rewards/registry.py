"""Reward components by name or import path: the built-ins' table and the one builder every
component goes through, a user's plug-in and a built-in alike (``core.plugins``; docs/plugins.md).

A plug-in reward is either

- a function ``fn(sample) -> float | bool | Verdict`` (``rewards.components.Sample``), or
  ``fn(sample, params)`` when it declares ``fn.Params`` (a pydantic model or a dataclass); or
- a class with ``score(samples, correct) -> list[float]`` over a batch, built as ``cls(params)``
  when it declares ``Params``, else ``cls()``.

Either may serve as the run's verdict (``verdict: true``): a response is correct when its score
reaches the component's ``threshold`` (default 1.0), or as a returned ``Verdict`` / bool says.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from conf.schema import RewardComponentConfig, SandboxConfig
from core import plugins
from rewards.components import Sample
from rewards.verifier import Verdict

KIND = "rewards"
"""The plug-in kind of reward components (entry-point group ``laminar.rewards``)."""

REWARDS: Mapping[str, str] = MappingProxyType(
    {
        "math_verify": "rewards.verdicts:MathVerify",
        "cosine_length": "rewards.components:CosineLength",
        "repetition": "rewards.components:Repetition",
        "overlong": "rewards.components:Overlong",
        "format": "rewards.components:Format",
        "ends_with": "rewards.components:EndsWith",
        "code_tests": "environments.code:CodeTests",
        "reward_model": "rewards.reward_model:RewardModelComponent",
    }
)
"""Built-in short name -> its target. Each built-in takes its ``conf.schema.REWARD_PARAMS`` record;
As the run's verdict, ``math_verify`` is the math verifier itself (a worker pool, opened by
``rewards.verdicts.open_verdict``)."""


def target_of(spec: RewardComponentConfig) -> str:
    """The import path ``spec`` names: its ``target``, or its name resolved through the built-ins and
    the ``laminar.rewards`` entry points (a ``PluginError`` for an unknown name)."""
    return plugins.resolve_name(KIND, spec.target or spec.name, REWARDS)


def is_plugin(spec: RewardComponentConfig) -> bool:
    """Whether ``spec`` is user code (an import path or an entry point), not a built-in."""
    return not spec.is_builtin()


def params_dict(params: Any) -> dict:
    """A component's parameters as JSON-ready data (a dataclass, a pydantic model, or None)."""
    if params is None:
        return {}
    if dataclasses.is_dataclass(params):
        return dataclasses.asdict(params)
    dump = getattr(params, "model_dump", None)
    return dump(mode="json") if dump else dict(params)


def _as_score(value: Any) -> float:
    """A plug-in's per-sample result as a number: a ``Verdict`` or a bool is 1 or 0."""
    if isinstance(value, Verdict):
        return 1.0 if value.correct else 0.0
    return float(value)


@dataclasses.dataclass(frozen=True)
class FunctionComponent:
    """A plug-in function as a component: ``fn(sample)`` (or ``fn(sample, params)``) per sample."""

    fn: Callable
    name: str
    params: Any = None
    target: str = ""
    fallback: float = 0.0
    correctness: bool = False

    def results(self, samples: Sequence[Sample]) -> list[Any]:
        """The function's own results, one per sample (a float, a bool or a ``Verdict``)."""
        if self.params is None:
            return [self.fn(s) for s in samples]
        return [self.fn(s, self.params) for s in samples]

    def score(self, samples: Sequence[Sample], correct: Sequence[bool | None]) -> list[float]:
        return [_as_score(x) for x in self.results(samples)]


@dataclasses.dataclass(frozen=True)
class ClassComponent:
    """A plug-in class's instance as a component: its ``score(samples, correct)``."""

    impl: Any
    name: str
    params: Any = None
    target: str = ""
    correctness: bool = False

    @property
    def fallback(self) -> float:
        return float(getattr(self.impl, "fallback", 0.0))

    def results(self, samples: Sequence[Sample]) -> list[Any]:
        """The instance's own results as a verdict sees them (``correct`` all None)."""
        return list(self.impl.score(samples, [None] * len(samples)))

    def score(self, samples: Sequence[Sample], correct: Sequence[bool | None]) -> list[float]:
        return [_as_score(x) for x in self.impl.score(samples, correct)]


def load_plugin(spec: RewardComponentConfig) -> tuple[str, Any, Any]:
    """(target, the loaded object, its validated params) of a plug-in component; a ``PluginError``
    naming it when it cannot be imported, has the wrong shape or refuses its params."""
    target = target_of(spec)
    obj = plugins.load(target)
    params = plugins.validate_params(target, obj, spec.params)
    if inspect.isclass(obj):
        if not callable(getattr(obj, "score", None)):
            raise plugins.PluginError(
                f"plug-in {target!r} is a class without score(samples, correct): add that method, "
                "or make the reward a function fn(sample) -> float"
            )
        return target, obj, params
    plugins.check_callable(target, obj, arity=1 if params is None else 2)
    return target, obj, params


def build_plugin(spec: RewardComponentConfig) -> FunctionComponent | ClassComponent:
    """The component a plug-in ``spec`` names, ready to score."""
    target, obj, params = load_plugin(spec)
    if inspect.isclass(obj):
        try:
            impl = obj(params) if params is not None else obj()
        except Exception as e:  # noqa: BLE001 - a plug-in's constructor failing is reported in one line
            why = f"{type(e).__name__}: {e}"
            raise plugins.PluginError(f"plug-in {target!r} failed to build: {why}") from None
        return ClassComponent(impl, spec.name, params, target)
    return FunctionComponent(obj, spec.name, params, target)


def build_builtin(
    spec: RewardComponentConfig,
    reward_model: str | None = None,
    template: str = "",
    sandbox: SandboxConfig | None = None,
):
    """A built-in component from its validated spec (``RewardComponentConfig.params_of``); the learned
    reward model's over the checkpoint folder ``reward_model``, reading prompts put in ``template``;
    ``code_tests`` under the run's ``sandbox`` settings."""
    cls = plugins.load(REWARDS[spec.name])
    if spec.name == "reward_model":
        return cls(spec.params_of(), reward_model, template or "{problem}")
    if spec.name == "code_tests":
        return cls(spec.params_of(), sandbox)
    return cls(spec.params_of())


def build_component(
    spec: RewardComponentConfig,
    reward_model: str | None = None,
    template: str = "",
    sandbox: SandboxConfig | None = None,
):
    """The component ``spec`` names: a built-in or a plug-in, through one path."""
    if spec.is_builtin():
        return build_builtin(spec, reward_model, template, sandbox)
    return build_plugin(spec)


def component_spec(spec: RewardComponentConfig, component: Any, correctness: bool) -> dict:
    """One line of ``Reward.spec``: name, weight, whether it is the verdict and its parameters; a
    plug-in's target too (a built-in's line is what it always was)."""
    if component is not None:
        params = params_dict(getattr(component, "params", None))
    else:  # the verdict, described without opening it
        params = params_dict(spec.params_of() if spec.is_builtin() else load_plugin(spec)[2])
    out = {"name": spec.name, "weight": float(spec.weight), "correctness": correctness, "params": params}
    if is_plugin(spec):
        out["target"] = target_of(spec)
    if correctness and spec.name != "math_verify" and spec.threshold != 1.0:
        out["threshold"] = float(spec.threshold)
    return out


def check(spec: RewardComponentConfig) -> None:
    """Preflight of one component: a plug-in imports, has a reward's shape and accepts its params
    (a ``PluginError`` otherwise); a built-in needs nothing more than the schema checked."""
    if is_plugin(spec):
        load_plugin(spec)
