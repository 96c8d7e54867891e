"""Same tokens, every driver: the same tiny sync run under ``rl.runtime=local`` (the local driver) and
``rl.runtime=ray`` (the Ray driver, one rollout) trains on identical trajectories (token ids,
behaviour log-probs, versions) and writes an identical RL history."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conf.schema import ClusterConfig, ModelConfig, RLConfig
from generation.model import build_char_tokenizer, build_tiny_model, encode_problem, save_model
from generation.records import PromptItem
from tests.training.rl_fakes import Verdict
from training.rl.manager import RolloutManager
from training.rl.stage import TIMING_KEYS, objective_params
from training.rl.sections import RLSections

ray = pytest.importorskip("ray")

TINY = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=64
)


class EndsWithAnswer:
    def verify_batch(self, texts, answers):
        return [Verdict(t.strip().endswith(a)) for t, a in zip(texts, answers)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("drivers-model")
    tok = build_char_tokenizer()
    save_model(build_tiny_model(TINY, tok, seed=0), tok, d)
    return d


@pytest.fixture(scope="module")
def prompts(model_dir):
    from generation.model import load_tokenizer

    tok = load_tokenizer(model_dir)
    return [
        PromptItem(
            f"p{i}",
            f"{i % 4}+{i % 3}",
            str(i % 4 + i % 3),
            encode_problem(tok, "{problem}\n", f"{i % 4}+{i % 3}"),
            1,
        )
        for i in range(64)
    ]


def trained(monkeypatch) -> list:
    """Every trajectory the trainer is handed, as (update, group uid, sample, prompt, tokens,
    behaviour log-probs, version), recorded at the manager whichever driver runs it."""
    seen: list = []
    original = RolloutManager.next_batch

    def spy(self):
        groups = original(self)
        seen.extend(
            (
                self.version + 1,
                uid,
                t.sample_idx,
                t.prompt.prompt_id,
                t.response_tokens,
                t.behaviour_logprobs,
                t.version,
            )
            for uid, g in groups
            for t in g.trajectories
        )
        return groups

    monkeypatch.setattr(RolloutManager, "next_batch", spy)
    return seen


def untimed(history) -> str:
    return json.dumps(
        [{k: v for k, v in m.as_dict().items() if k not in TIMING_KEYS} for m in history], sort_keys=True
    )


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("dapo", marks=pytest.mark.slow)])
def test_local_and_ray_sync_runs_sample_the_same_tokens_and_write_the_same_history(
    local_ray, monkeypatch, model_dir, prompts, algorithm
):
    from training.rl.drivers.local import LocalDriver
    from training.rl.drivers.ray import LaminarRuntime

    rl = RLConfig(
        mode="sync",
        algorithm=algorithm,
        steps=3,
        prompts_per_step=4,
        group_size=4,
        lr=1e-2,
        max_new_tokens=12,
        rollout_capacity=16,
        chunk_steps=4,
        micro_batch_tokens=0,
    )
    params = objective_params(rl)
    if algorithm == "dapo":  # dynamic sampling's further rounds are the manager's in both drivers
        params = dataclasses.replace(params, overlong_cache_len=4)
    runs = {}
    for runtime in ("local", "ray"):
        seen = trained(monkeypatch)
        run = RLSections(rl.model_copy(update={"runtime": runtime}), seed=0)
        if runtime == "local":
            driver = LocalDriver(model_dir, prompts, EndsWithAnswer(), params, run, device="cpu")
        else:
            run = dataclasses.replace(run, cluster=ClusterConfig(rollouts=1, actor_threads=1))
            driver = LaminarRuntime(model_dir, prompts, EndsWithAnswer(), params, run, device="cpu")
        result = driver.run()
        runs[runtime] = (list(seen), untimed(result.history), dict(result.consumed), list(result.rewards))
        monkeypatch.undo()
    (local_t, local_h, local_c, local_r), (ray_t, ray_h, ray_c, ray_r) = runs["local"], runs["ray"]
    assert {u for u, *_ in local_t} == {1, 2, 3} and len(local_t) % 4 == 0
    if algorithm == "grpo":
        assert len(local_t) == 3 * 4 * 4
    else:  # groups without signal were dropped and further rounds sampled
        assert sum(m["dropped_groups"] for m in json.loads(local_h)) > 0
    assert {v for *_, v in local_t} == {0, 1, 2}  # sync: batch b is sampled by version b - 1, nothing stale
    assert local_t == ray_t  # token ids and behaviour log-probs, to the bit
    assert local_h == ray_h and json.loads(local_h)[-1]["step"] == 3.0
    assert local_c == ray_c and local_r == ray_r
