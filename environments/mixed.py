"""Several environments in one run (``envs``): one environment that routes each episode to its own.

The weighted prompt source (``training.rl.mix.MixedSource``) tags every prompt id with the name of
the environment it was drawn for (``NAME/PROMPT_ID``: :func:`tag`). ``MixedEnvironment`` is the one
environment the rollouts' episode runner (``environments.episodes.EpisodeEngine``) runs: ``reset``
reads the tag and asks that environment (with the untagged prompt), the episode's state is
``{"env": NAME, "turns": N, "state": that environment's own state}`` (plain data, so it moves with
the episode through repack, hand-over and checkpoints), and ``step`` routes each turn to it and ends
the episode at that environment's own ``max_turns``. A ``single_turn`` item's episodes are one turn,
sampled as the single-turn path samples them (the first turn's request is the prompt's own).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from environments.base import StepResult, Turn, reset_result, step_result
from generation.records import PromptItem

SEP = "/"


def tag(name: str, prompt_id: str) -> str:
    """The prompt id an episode of environment ``name`` carries."""
    return f"{name}{SEP}{prompt_id}"


def split_tag(prompt_id: str) -> tuple[str, str]:
    """``(environment name, the prompt's own id)`` of a tagged prompt id."""
    name, sep, rest = prompt_id.partition(SEP)
    if not sep:
        raise ValueError(f"prompt id {prompt_id!r} names no environment (NAME{SEP}ID): not from envs=[...]")
    return name, rest


@dataclass
class Params:
    """``envs``: name -> its ``conf.schema.EnvConfig`` (built by ``training.rl.mix.mixed_env``)."""

    envs: dict[str, Any] = field(default_factory=dict)


class MixedEnvironment:
    """Routes each episode to the environment its prompt was drawn for (module docstring)."""

    Params = Params
    name = "mixed"

    def __init__(self, tokenizer, params: Params, env=None, sandbox=None):
        from environments.registry import make_environment

        if not params.envs:
            raise ValueError("MixedEnvironment needs at least one environment")
        self.envs = {n: make_environment(cfg, tokenizer, sandbox) for n, cfg in params.envs.items()}
        self.max_turns = {n: cfg.max_turns for n, cfg in params.envs.items()}

    def reset(self, prompt: PromptItem) -> tuple[tuple[int, ...], dict]:
        name, own = split_tag(prompt.prompt_id)
        if name not in self.envs:
            raise ValueError(f"prompt {prompt.prompt_id!r}: no environment {name!r} in {sorted(self.envs)}")
        tokens, state = reset_result(name, self.envs[name].reset(dataclasses.replace(prompt, prompt_id=own)))
        return tokens, {"env": name, "turns": 0, "state": state}

    def step(self, state: dict, turn: Turn) -> StepResult:
        name, turns = state["env"], state["turns"] + 1
        res = step_result(name, self.envs[name].step(state["state"], turn))
        wrapped = {"env": name, "turns": turns, "state": res.state}
        if not res.done and turns >= self.max_turns[name]:  # this environment's own turn limit
            return dataclasses.replace(res, observation=(), done=True, reason="max_turns", state=wrapped)
        return dataclasses.replace(res, state=wrapped)

    def close(self) -> None:
        for env in self.envs.values():
            env.close()
