"""``env.target`` -> the environment, and the one place an engine gets its episode runner.

An environment is a plug-in (``core.plugins``): ``env.target`` is a short name (the built-ins below,
or one an installed package adds through the entry-point group ``laminar.environments``) or an
import path ``package.module:attr``. The target is a factory, usually the environment's class,
called as ``factory(tokenizer, params, env)``: the policy's tokenizer, ``env.params`` validated into
the factory's own ``Params`` model (None when it declares none) and the ``env`` section
(``conf.schema.EnvConfig``: ``tool_format`` and the episode limits). Built-ins and a user's
environment go through the same path.

``env=single_turn`` (the default) leaves the engine as it is: today's single-turn path, the same
tokens for the same seed. Any other environment wraps the engine in ``EpisodeEngine``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from conf.schema import SandboxConfig
from core import plugins
from environments.base import Environment
from environments.calculator import Calculator
from environments.episodes import EpisodeEngine, EpisodeLimits
from environments.tool_use import ToolEnvironment

KIND = "environments"
"""The plug-in kind: entry-point group ``laminar.environments``."""

BUILTINS: Mapping[str, str] = MappingProxyType(
    {
        "single_turn": "environments.base:SingleTurn",
        "calculator": "environments.registry:calculator",
        "calculator_sandbox": "environments.registry:calculator_sandbox",
        "guess": "environments.guess:Guess",
        "python_session": "environments.python_session:PythonSession",
    }
)
"""Built-in short names -> their targets (``env.target=calculator``)."""


AGENT_WORKERS = 64
"""At least this many pool threads for an agent environment: each ``step`` waits (idle) on its agent's
next request."""


def calculator(tokenizer, params, env) -> Environment:
    """The arithmetic task's ``calc`` tool (``environments.calculator``), in ``env.tool_format``."""
    return ToolEnvironment("calculator", [Calculator()], tokenizer, env.tool_format)


def calculator_sandbox(tokenizer, params, env, sandbox: SandboxConfig | None = None) -> Environment:
    """``calculator`` with each call evaluated in the sandbox (``environments.tools.SandboxCalculator``)
    under the run's ``sandbox`` settings (None: the defaults)."""
    from environments.tools import SandboxCalculator

    tool = SandboxCalculator(sandbox or SandboxConfig())
    return ToolEnvironment("calculator_sandbox", [tool], tokenizer, env.tool_format)


def resolve(env_cfg) -> tuple[str, Any, Any]:
    """``(target, factory, params)`` of ``env_cfg``: the import path its ``target`` stands for, the
    factory imported, and ``env_cfg.params`` validated into the factory's ``Params``. Everything
    that goes wrong is a one-line ``core.plugins.PluginError`` naming the target."""
    target = plugins.resolve_name(KIND, env_cfg.target, BUILTINS)
    factory = plugins.load(target)
    if inspect.iscoroutinefunction(factory):  # an agent program: async def solve(client, task)
        from environments.agents.adapter import agent_factory

        plugins.check_callable(target, factory, 2, is_async=True)
        factory = agent_factory(target, factory)
    params = plugins.validate_params(target, factory, env_cfg.params)
    plugins.check_callable(target, factory, 3)
    if inspect.isclass(factory):
        _check_methods(target, factory, bound=False)
    return target, factory, params


def check_environment(env_cfg) -> str:
    """What ``tasks.preflight`` asks before any write: the target resolves, imports, takes its params
    and (a class) has the interface; returns the target's import path."""
    return resolve(env_cfg)[0]


def _check_methods(target: str, obj: Any, bound: bool) -> None:
    """``obj`` (an environment, or its class when ``bound`` is False) has ``reset(prompt)``,
    ``step(state, turn)`` and ``close()``; an old ``step(turn_text)`` is named as such."""
    extra = 0 if bound else 1  # an unbound method takes self too
    for method, arity in (("reset", 1), ("step", 2), ("close", 0)):
        fn = getattr(obj, method, None)
        if not callable(fn):
            raise plugins.PluginError(
                f"environment {target!r} has no {method}() method; an environment has reset(prompt), "
                "step(state, turn) and close() (docs/environments.md)"
            )
        try:
            sig = inspect.signature(fn)
            sig.bind(*([None] * (arity + extra)))
        except TypeError:
            old = (
                " (the old step(turn_text): see docs/environments.md, 'Migrating')"
                if method == "step"
                else ""
            )
            want = {"reset": "reset(prompt)", "step": "step(state, turn)", "close": "close()"}[method]
            has = ", ".join(list(sig.parameters)[extra:])
            raise plugins.PluginError(
                f"environment {target!r}: {method}({has}) does not take {want}{old}"
            ) from None
        except ValueError:  # no signature to read: the call decides
            pass


def make_environment(env_cfg, tokenizer, sandbox: SandboxConfig | None = None) -> Environment:
    """The environment ``env_cfg`` names, built for ``tokenizer`` and checked for the interface; a
    factory that takes a ``sandbox`` keyword gets the run's sandbox settings (for tools that run code)."""
    target, factory, params = resolve(env_cfg)
    try:
        if _takes_sandbox(factory):
            env = factory(tokenizer, params, env_cfg, sandbox=sandbox)
        else:
            env = factory(tokenizer, params, env_cfg)
    except plugins.PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's factory failing is reported in one line
        raise plugins.PluginError(
            f"environment {target!r} failed to build: {type(e).__name__}: {e}"
        ) from None
    _check_methods(target, env, bound=True)
    if not isinstance(getattr(env, "name", None), str):
        try:
            env.name = env_cfg.target
        except AttributeError:
            pass
    return env


def _takes_sandbox(factory) -> bool:
    try:
        return "sandbox" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def wrap_engine(engine, env_cfg, tokenizer=None, sandbox: SandboxConfig | None = None):
    """``engine`` as it is for ``single_turn`` (or no ``env_cfg``); else an ``EpisodeEngine`` running
    the configured environment's episodes on it (``tokenizer``: the engine's, by default; ``sandbox``:
    the run's sandbox settings, for its tools)."""
    if env_cfg is None or env_cfg.is_default():
        return engine
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    env = make_environment(env_cfg, tokenizer, sandbox)
    limits = EpisodeLimits.from_config(env_cfg)
    if getattr(env, "restarts_lost", False):  # an agent: an episode whose session is gone restarts
        # and each step waits on its agent's next request: a pool thread per agent between requests
        limits = dataclasses.replace(
            limits, on_error="retry", tool_workers=max(limits.tool_workers, AGENT_WORKERS)
        )
        env.sampler = engine  # its requests are checked against the engine's sampling settings
    return EpisodeEngine(engine, env, tokenizer, limits)
