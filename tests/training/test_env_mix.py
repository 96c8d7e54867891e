"""Several environments in one RL run, weighted (issue 52, part 5): the interleave hands each
environment its share of the prompts at every step, the rollouts' one mixed environment routes every
episode to its own, and a real run trains each environment's share of the groups with metrics per
environment."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conf.loader import load_config
from conf.schema import ConfigError, EnvMixConfig, RLConfig
from environments.base import StepResult, Turn
from environments.mixed import MixedEnvironment, Params, split_tag, tag
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import PromptItem
from tests.training.rl_fakes import MICRO, Verdict, fit, saved_model
from training.objectives import PRESETS
from training.rl.drivers.local import LocalDriver
from training.rl.loop import PromptCursor
from training.rl.sections import RLSections
from training.rl.mix import MixedSource, mixed_env, mixed_run, trained_shares

OBSERVATION = "\n= 7\n"


class CallsOnce:
    """A tool environment with state: the first turn is answered with ``OBSERVATION`` (a tool call),
    the second ends the episode."""

    name = "calls_once"

    def __init__(self, tokenizer, params=None, env=None):
        self.obs = tuple(tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"])

    def reset(self, prompt):
        assert "/" not in prompt.prompt_id  # the environment sees the prompt's own id
        return prompt.prompt_tokens, {"calls": 0}

    def step(self, state, turn):
        if state["calls"] == 0:
            return StepResult(self.obs, tool_call=True, state={"calls": 1})
        return StepResult(done=True, reason="answer", state=state)

    def close(self):
        pass


def _items(tok, n: int) -> list[PromptItem]:
    return [PromptItem(f"p{i}", f"q{i}", "7", encode_prompt(tok, f"q{i}\n"), 1) for i in range(n)]


def test_the_interleave_hands_each_environment_its_share_at_every_step():
    tok = build_char_tokenizer()
    items = _items(tok, 5)
    src = _source(items)
    counts = {"a": 0, "b": 0}
    for step in range(1, 101):  # 100 batches of 16 prompts
        for p in src.take(16):
            counts[split_tag(p.prompt_id)[0]] += 1
        drawn = 16 * step
        assert abs(counts["a"] - 0.7 * drawn) <= 1 and abs(counts["b"] - 0.3 * drawn) <= 1
    assert counts == {"a": 1120, "b": 480}
    saved = src.state()
    again = _source(items)
    again.load_state(saved)
    assert [p.prompt_id for p in again.take(10)] == [p.prompt_id for p in src.take(10)]  # resumes in step


def _tagged(name, p):
    return dataclasses.replace(p, prompt_id=tag(name, p.prompt_id))


def _source(items) -> MixedSource:
    return MixedSource(
        [(n, w, PromptCursor([_tagged(n, p) for p in items], 0)) for n, w in (("a", 0.7), ("b", 0.3))]
    )


def test_the_mixed_environment_routes_each_episode_and_keeps_each_turn_limit():
    tok = build_char_tokenizer()
    envs = [
        EnvMixConfig(target="calculator", max_turns=2, name="short", weight=1),
        EnvMixConfig(target="calculator", max_turns=3, weight=1),
        EnvMixConfig(target="single_turn", weight=1),
    ]
    cfg = mixed_env(envs)
    assert cfg.max_turns == 3 and cfg.target == "environments.mixed:MixedEnvironment"
    env = MixedEnvironment(tok, Params(**cfg.params), cfg)
    item = _items(tok, 1)[0]
    tokens, state = env.reset(_tagged("calculator", item))
    assert tokens == item.prompt_tokens and state == {"env": "calculator", "turns": 0, "state": None}
    res = env.step(state, Turn("calc: 3+4", ()))
    assert res.tool_call and tok.decode(list(res.observation)) == "\n= 7\n" and res.state["turns"] == 1
    assert env.step(env.reset(_tagged("single_turn", item))[1], Turn("#### 7", ())).done
    first = env.step(env.reset(_tagged("short", item))[1], Turn("calc: 1+1", ()))
    assert first.tool_call and not first.done
    short = env.step(first.state, Turn("calc: 2+2", ()))
    assert short.done and short.reason == "max_turns" and not short.observation  # its own max_turns=2
    with pytest.raises(ValueError, match="no environment 'nope'"):
        env.reset(_tagged("nope", item))
    with pytest.raises(ValueError, match="distinct name"):
        mixed_env(
            [EnvMixConfig(target="calculator", max_turns=3), EnvMixConfig(target="calculator", max_turns=3)]
        )


def test_envs_compose_from_the_command_line_and_default_to_none():
    assert load_config([]).envs == []
    cfg = load_config(
        ["envs=[{target: calculator, weight: 0.7, max_turns: 3}, {target: single_turn, weight: 0.3}]"]
    )
    assert [(e.target, e.weight, e.max_turns) for e in cfg.envs] == [
        ("calculator", 0.7, 3),
        ("single_turn", 0.3, 1),
    ]
    with pytest.raises(ConfigError, match=r"envs\[0\]\.weight=0.0 must be > 0"):
        load_config(["envs=[{target: calculator, weight: 0}]"])


class DigitFirst:
    def verify_batch(self, responses, golds):
        return [Verdict(r[:1].isdigit()) for r in responses]


def ends_at_once(tok, items, steps: int = 40):
    """A tiny model taught (a few SFT steps) to end every turn at once (EOS first): each turn of an
    episode is one token, so every ``CallsOnce`` episode is call, observation, answer."""
    rows = [list(p.prompt_tokens) + [tok.eos_token_id] for p in items]
    rows += [
        r[:-1] + list(tok(OBSERVATION, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        for r in rows
    ]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(ids != tok.eos_token_id, -100)
    return fit(build_tiny_model(MICRO, tok, seed=0), ids, labels, steps=steps, lr=1e-2)


def test_a_run_mixed_0_7_0_3_trains_each_environment_its_share_with_metrics_per_environment(tmp_path):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = ends_at_once(tok, _items(tok, 8))
    envs = [
        EnvMixConfig(target="tests.training.test_env_mix:CallsOnce", max_turns=2, name="tool", weight=0.7),
        EnvMixConfig(target="single_turn", weight=0.3),
    ]
    source, env = mixed_run(envs, lambda: None, tok, "{problem}\n", seed=0)
    rl = RLConfig(steps=5, prompts_per_step=10, group_size=2, lr=1e-4, max_new_tokens=4, micro_batch_tokens=0)
    driver = LocalDriver(
        saved_model(tmp_path, model, tok), _items(tok, 8), DigitFirst(), PRESETS["grpo"],
        RLSections(rl, seed=0, env=env), device="cpu", source=source,
    )  # fmt: skip
    result = driver.run()
    shares = trained_shares(dict(result.consumed))
    assert sum(result.consumed.values()) == 5 * 10 * 2  # 50 groups trained
    assert abs(shares["tool"] - 0.7) <= 0.02 and abs(shares["single_turn"] - 0.3) <= 0.02
    for m in result.history:
        d = m.as_dict()
        assert d["env/tool/groups"] + d["env/single_turn/groups"] == 10
        assert abs(d["env/tool/group_share"] - 0.7) <= 0.1
        assert d["env/tool/tool_calls"] > 0.8 and d["env/tool/turns"] > 1.8  # routed to CallsOnce
        assert d["env/single_turn/tool_calls"] == 0.0 and d["env/single_turn/turns"] == 1.0
        assert 0.0 <= d["env/tool/accuracy"] <= 1.0


@pytest.mark.slow
def test_the_mix_runs_on_the_ray_runtime_in_laminar_mode(tmp_path, local_ray):
    """The same mix on two Ray rollouts in laminar mode: the mixed environment travels to the rollout
    actors with its config, and the trained groups keep the weights."""
    from conf.schema import ClusterConfig
    from training.rl.drivers.ray import LaminarRuntime

    tok = build_char_tokenizer()
    items = _items(tok, 8)
    envs = [
        EnvMixConfig(target="tests.training.test_env_mix:CallsOnce", max_turns=2, name="tool", weight=0.7),
        EnvMixConfig(target="single_turn", weight=0.3),
    ]
    source, env = mixed_run(envs, lambda: None, tok, "{problem}\n", seed=0)
    rl = RLConfig(
        mode="laminar", steps=3, prompts_per_step=10, group_size=2, lr=1e-4, max_new_tokens=4,
        micro_batch_tokens=0, rollout_capacity=16, chunk_steps=4,
    )  # fmt: skip
    rt = LaminarRuntime(
        saved_model(tmp_path, ends_at_once(tok, items), tok), items, DigitFirst(), PRESETS["grpo"],
        RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=2), env=env), device="cpu", source=source,
    )  # fmt: skip
    result = rt.run()
    assert trained_shares(dict(result.consumed)) == pytest.approx({"tool": 0.7, "single_turn": 0.3})
    rows = [m.as_dict() for m in result.history]
    assert (
        sum(d["env/tool/groups"] for d in rows) >= 21 and sum(d["env/single_turn/groups"] for d in rows) >= 9
    )
    assert all(
        d["env/tool/tool_calls"] in (0.0, 1.0) and d["env/single_turn/tool_calls"] == 0.0 for d in rows
    )
