"""Episodes through the RL drivers: a sync run of the local driver trains on multi-turn episodes
(observation tokens masked, episode metrics in the history) through the same manager and
``run_order`` as single-turn runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conf.schema import EnvConfig, ModelConfig, RLConfig
from environments.base import StepResult
from generation.model import (
    build_char_tokenizer,
    build_tiny_model,
    encode_problem,
    load_tokenizer,
    save_model,
)
from generation.records import PromptItem
from tests.training.rl_fakes import Verdict
from training.rl.manager import RolloutManager
from training.rl.stage import objective_params

TINY = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=128
)


class EndsWithAnswer:
    def verify_batch(self, texts, answers):
        return [Verdict(t.strip().endswith(a)) for t, a in zip(texts, answers)]


class CallsTwice:
    """Text-format observations: the first two turns are answered ``= 7``, the third ends it."""

    name = "calls_twice"

    def __init__(self, tok):
        self.obs = tuple(tok("\n= 7\n", add_special_tokens=False)["input_ids"])
        self.turns = {}

    def reset(self, prompt):
        return prompt.prompt_tokens

    def step(self, turn_text):
        if turn_text.endswith("#"):  # a few turns answer: the episode ends with the policy's turn
            return StepResult(done=True, reason="answer")
        return StepResult(self.obs, tool_call=True)

    def close(self):
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("episode-model")
    tok = build_char_tokenizer()
    model = build_tiny_model(TINY, tok, seed=0)
    with torch.no_grad():  # turns end at varied lengths
        model.get_input_embeddings().weight[tok.eos_token_id] *= 30
    save_model(model, tok, d)
    return d


def test_a_sync_local_run_trains_on_masked_multi_turn_episodes(monkeypatch, model_dir):
    import environments.registry as registry
    from training.rl.drivers.local import LocalDriver

    tok = load_tokenizer(model_dir)
    monkeypatch.setattr(registry, "make_environment", lambda cfg, tokenizer: CallsTwice(tokenizer))
    prompts = [
        PromptItem(
            f"p{i}", f"{i % 4}+{i % 3}", "7", encode_problem(tok, "{problem}\n", f"{i % 4}+{i % 3}"), 1
        )
        for i in range(16)
    ]
    rl = RLConfig(
        mode="sync",
        runtime="local",
        steps=2,
        prompts_per_step=4,
        group_size=2,
        lr=1e-2,
        max_new_tokens=10,
        rollout_capacity=8,
        chunk_steps=4,
        micro_batch_tokens=0,
    )
    seen = []
    original = RolloutManager.next_batch

    def spy(self):
        groups = original(self)
        seen.extend(t for _, g in groups for t in g.trajectories)
        return groups

    monkeypatch.setattr(RolloutManager, "next_batch", spy)
    env = EnvConfig(name="calculator", max_turns=3)
    driver = LocalDriver(
        model_dir, prompts, EndsWithAnswer(), objective_params(rl), rl, seed=0, device="cpu", env=env
    )
    result = driver.run()
    assert len(seen) == 2 * 4 * 2
    multi = [t for t in seen if t.turns > 1]
    assert multi and all(0 in t.loss_mask and len(t.loss_mask) == len(t.response_tokens) for t in multi)
    assert all(t.turns <= 3 and t.end_reason for t in seen)
    assert {t.version for t in seen} == {0, 1}  # sync: an episode keeps the version it started with
    last = result.history[-1].as_dict()
    assert last["episode/tool_calls"] > 0 and last["episode/turns"] > 1
    assert 0 < last["episode/policy_token_share"] < 1
    assert dataclasses.is_dataclass(result.history[-1])
