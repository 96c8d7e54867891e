"""Environment name -> how to build it, and the one place an engine gets its episode runner.

``env=single_turn`` (the default) leaves the engine as it is: today's single-turn path, the same
tokens for the same seed. Any other environment wraps the engine in ``EpisodeEngine``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from environments.base import Environment, SingleTurn
from environments.calculator import Calculator
from environments.episodes import EpisodeEngine, EpisodeLimits
from environments.tool_use import ToolEnvironment


def _calculator(tokenizer, env_cfg) -> Environment:
    return ToolEnvironment("calculator", [Calculator()], tokenizer, env_cfg.tool_format)


def _calculator_sandbox(tokenizer, env_cfg) -> Environment:
    from environments.tools import SandboxCalculator

    return ToolEnvironment("calculator_sandbox", [SandboxCalculator()], tokenizer, env_cfg.tool_format)


ENVIRONMENTS: Mapping[str, Callable[..., Environment]] = MappingProxyType(
    {
        "single_turn": lambda tokenizer, env_cfg: SingleTurn(),
        "calculator": _calculator,
        "calculator_sandbox": _calculator_sandbox,
    }
)
"""``env.name`` -> (tokenizer, ``conf.schema.EnvConfig``) -> the environment."""


def make_environment(env_cfg, tokenizer) -> Environment:
    if env_cfg.name not in ENVIRONMENTS:
        raise ValueError(
            f"env.name={env_cfg.name!r} is not registered; choose one of {', '.join(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[env_cfg.name](tokenizer, env_cfg)


def wrap_engine(engine, env_cfg, tokenizer=None):
    """``engine`` as it is for ``single_turn`` (or no ``env_cfg``); else an ``EpisodeEngine`` running
    the configured environment's episodes on it (``tokenizer``: the engine's, by default)."""
    if env_cfg is None or env_cfg.name == "single_turn":
        return engine
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    return EpisodeEngine(
        engine, make_environment(env_cfg, tokenizer), tokenizer, EpisodeLimits.from_config(env_cfg)
    )
