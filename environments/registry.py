"""Environment name -> how to build it, and the one place an engine gets its episode runner.

``env=single_turn`` (the default) leaves the engine as it is: today's single-turn path, the same
tokens for the same seed. Any other environment wraps the engine in ``EpisodeEngine``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from conf.schema import SandboxConfig
from environments.base import Environment, SingleTurn
from environments.calculator import Calculator
from environments.episodes import EpisodeEngine, EpisodeLimits
from environments.tool_use import ToolEnvironment


def _calculator(tokenizer, env_cfg, sandbox=None) -> Environment:
    return ToolEnvironment("calculator", [Calculator()], tokenizer, env_cfg.tool_format)


def _calculator_sandbox(tokenizer, env_cfg, sandbox=None) -> Environment:
    from environments.tools import SandboxCalculator

    tool = SandboxCalculator(sandbox or SandboxConfig())
    return ToolEnvironment("calculator_sandbox", [tool], tokenizer, env_cfg.tool_format)


ENVIRONMENTS: Mapping[str, Callable[..., Environment]] = MappingProxyType(
    {
        "single_turn": lambda tokenizer, env_cfg, sandbox=None: SingleTurn(),
        "calculator": _calculator,
        "calculator_sandbox": _calculator_sandbox,
    }
)
"""``env.name`` -> (tokenizer, ``conf.schema.EnvConfig``, ``conf.schema.SandboxConfig`` or None) ->
the environment; a tool that runs code runs it under the sandbox settings given (None: defaults)."""


def make_environment(env_cfg, tokenizer, sandbox: SandboxConfig | None = None) -> Environment:
    if env_cfg.name not in ENVIRONMENTS:
        raise ValueError(
            f"env.name={env_cfg.name!r} is not registered; choose one of {', '.join(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[env_cfg.name](tokenizer, env_cfg, sandbox)


def wrap_engine(engine, env_cfg, tokenizer=None, sandbox: SandboxConfig | None = None):
    """``engine`` as it is for ``single_turn`` (or no ``env_cfg``); else an ``EpisodeEngine`` running
    the configured environment's episodes on it (``tokenizer``: the engine's, by default; ``sandbox``:
    the run's sandbox settings, for its tools)."""
    if env_cfg is None or env_cfg.name == "single_turn":
        return engine
    tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
    return EpisodeEngine(
        engine, make_environment(env_cfg, tokenizer, sandbox), tokenizer, EpisodeLimits.from_config(env_cfg)
    )
