"""The learned reward model in its own Ray actor: it scores exactly as in process, and a killed actor
is restarted by Ray with the batch it held scored again, once, alone and in a laminar run. Starts Ray:
marked slow."""

from __future__ import annotations

import pytest

from conf.schema import ModelConfig, RewardComponentConfig, RewardConfig
from generation.model import build_char_tokenizer, build_tiny_model, save_model
from rewards.components import Sample
from rewards.compose import Reward
from training.reward_model import train_reward_model
from training.rl.reward_actor import RemoteRewardModel, with_reward_actor
from training.rl.sections import RLSections

pytestmark = pytest.mark.slow

SMALL = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)


class _Verifier:
    def verify_batch(self, texts, golds):
        from types import SimpleNamespace

        return [SimpleNamespace(correct=t.rstrip(".").endswith(g), error=None) for t, g in zip(texts, golds)]


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_actor")
    tok = build_char_tokenizer()
    save_model(build_tiny_model(SMALL, tok, 0), tok, root / "lm")
    rows = [{"prompt": f"{a}+1=", "chosen": f"{a + 1}.", "rejected": f"{a + 1}"} for a in range(40)]
    train_reward_model(root / "lm", rows, root / "rm", steps=20, batch_size=8, lr=3e-3)
    spec = RewardConfig(
        components=[RewardComponentConfig.of(), RewardComponentConfig.of(name="reward_model", weight=0.5)]
    )
    return Reward.of(_Verifier(), spec, str(root / "rm"), "{problem}=")


SAMPLES = [Sample(f"{a + 1}" + ("." if a % 2 else ""), str(a + 1), 2, 8, prompt=f"{a}+1") for a in range(12)]


def test_a_killed_reward_actor_restarts_and_rescores_its_batch_once(local_ray, reward):
    ray = local_ray
    local = reward.score(SAMPLES)
    remote = with_reward_actor(ray, reward)
    (proxy,) = remote.shaping
    assert isinstance(proxy, RemoteRewardModel) and remote.spec() == reward.spec()
    first = remote.score(SAMPLES)
    assert first.terms["reward_model"] == pytest.approx(local.terms["reward_model"], abs=1e-5)
    pid = ray.get(proxy.handle.pid.remote())
    in_flight = proxy.handle.score.remote(SAMPLES, [True] * len(SAMPLES))
    ray.kill(proxy.handle, no_restart=False)  # dies with the batch in hand; Ray restarts it
    assert ray.get(in_flight) == pytest.approx(list(local.terms["reward_model"]), abs=1e-5)
    assert ray.get(proxy.handle.pid.remote()) != pid
    # at most once on the restarted actor (none when the kill came after the batch was done)
    assert ray.get(proxy.handle.count.remote()) <= 1
    again = remote.score(SAMPLES)
    assert again.terms["reward_model"] == pytest.approx(local.terms["reward_model"], abs=1e-5)
    assert again.errors["reward_model"] == 0  # nothing fell back: every sample was scored


def test_a_laminar_run_whose_reward_actor_is_killed_mid_run_finishes_with_every_group_scored_once(
    local_ray, reward, tmp_path, monkeypatch
):
    """The Ray runtime in laminar mode with the verifier + the reward model in its actor; the actor is
    SIGKILLed (Ray restarts it) while it holds the second batch. The run finishes, every group is
    trained once, none of them got the reward model's fallback, and the actor that finished is a new
    process."""
    import math

    from conf.schema import ClusterConfig
    from generation.model import encode_problem
    from generation.records import PromptItem
    from tests.training.rl_fakes import ray_rl
    from training.rl.drivers.ray import LaminarRuntime
    from training.rl.stage import objective_params

    ray = local_ray
    tok = build_char_tokenizer()
    save_model(build_tiny_model(SMALL, tok, 0), tok, tmp_path / "policy")
    prompts = [
        PromptItem(f"p{i}", f"{i}+1", str(i + 1), encode_problem(tok, "{problem}=", f"{i}+1"), 1)
        for i in range(40)
    ]
    calls, pids = [], []
    score = RemoteRewardModel.score

    def killing_score(self, samples, correct):
        calls.append(len(samples))
        if len(calls) == 2:  # the actor dies with this batch submitted; the retry scores it
            pids.append(ray.get(self.handle.pid.remote()))
            ref = self.handle.score.remote(list(samples), list(correct))
            ray.kill(self.handle, no_restart=False)
            out = ray.get(ref)
            pids.append(ray.get(self.handle.pid.remote()))
            return out
        return score(self, samples, correct)

    monkeypatch.setattr(RemoteRewardModel, "score", killing_score)
    rl = ray_rl("laminar", max_new_tokens=6)
    rt = LaminarRuntime(
        tmp_path / "policy",
        prompts,
        reward,
        objective_params(rl),
        RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=2, actor_threads=1)),
        device="cpu",
    )
    result = rt.run()
    uids = rt.summary["trained_uids"]
    assert len(uids) == len(set(uids)) == 12  # every group trained once, none twice
    assert len(calls) >= 3 and len(pids) == 2 and pids[0] != pids[1]  # killed mid-run, restarted
    for m in result.history:
        d = m.as_dict()
        assert d["reward_errors/reward_model"] == 0  # no trajectory fell back to the default score
        assert math.isfinite(d["reward/reward_model"])
