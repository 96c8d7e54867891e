"""Episodes through the RL drivers: a sync run of the local driver trains on multi-turn episodes
(observation tokens masked, episode metrics in the history) through the same manager and
``run_order`` as single-turn runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conf.schema import EnvConfig, RLConfig
from environments.base import StepResult
from generation.model import (
    build_char_tokenizer,
    build_tiny_model,
    encode_problem,
    load_model,
    load_tokenizer,
    save_model,
)
from generation.records import PromptItem
from tests.environments.episode_helpers import TINY, spy_groups
from tests.training.rl_fakes import Verdict, ray_rl
from training.rl.stage import objective_params
from training.rl.sections import RLSections


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
        return prompt.prompt_tokens, None

    def step(self, state, turn):
        if turn.text.endswith("#"):  # a few turns answer: the episode ends with the policy's turn
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
    monkeypatch.setattr(
        registry, "make_environment", lambda cfg, tokenizer, sandbox=None: CallsTwice(tokenizer)
    )
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
    trained = spy_groups(monkeypatch)
    env = EnvConfig(target="calculator", max_turns=3)
    driver = LocalDriver(
        model_dir,
        prompts,
        EndsWithAnswer(),
        objective_params(rl),
        RLSections(rl, seed=0, env=env),
        device="cpu",
    )
    result = driver.run()
    seen = [t for _, g in trained for t in g.trajectories]
    assert len(seen) == 2 * 4 * 2
    multi = [t for t in seen if t.turns > 1]
    assert multi and all(0 in t.loss_mask and len(t.loss_mask) == len(t.response_tokens) for t in multi)
    assert all(t.turns <= 3 and t.end_reason for t in seen)
    assert {t.version for t in seen} == {0, 1}  # sync: an episode keeps the version it started with
    last = result.history[-1].as_dict()
    assert last["episode/tool_calls"] > 0 and last["episode/turns"] > 1
    assert 0 < last["episode/policy_token_share"] < 1
    assert dataclasses.is_dataclass(result.history[-1])


@pytest.mark.parametrize(
    "mode",
    [
        "laminar",
        pytest.param("one_step", marks=pytest.mark.slow),
        pytest.param("partial", marks=pytest.mark.slow),
    ],
)
def test_the_ray_modes_train_calculator_episodes_once_each(local_ray, caller_dir, mode):
    from conf.schema import ClusterConfig
    from training.rl.drivers.ray import LaminarRuntime

    tok = load_tokenizer(caller_dir)
    prompts = [
        PromptItem(
            f"p{i}", f"{i % 4}+{i % 3}", "3", encode_problem(tok, "{problem}\n", f"{i % 4}+{i % 3}"), 1
        )
        for i in range(40)
    ]
    rl = ray_rl(mode)
    rt = LaminarRuntime(
        caller_dir,
        prompts,
        EndsWithAnswer(),
        objective_params(rl),
        RLSections(
            rl,
            seed=0,
            cluster=ClusterConfig(rollouts=2, actor_threads=1),
            env=EnvConfig(target="calculator", max_turns=3),
        ),
        device="cpu",
    )
    result = rt.run()
    uids = rt.summary["trained_uids"]
    assert len(uids) == len(set(uids)) == 12  # every group trained once, none twice
    assert all(m.trained_trajectories == 8 for m in result.history)
    extra = [m.as_dict() for m in result.history]
    assert all(e["episode/tool_calls"] > 0.5 and e["episode/turns"] > 1.5 for e in extra), extra
    assert all(e["episode/tool_errors"] == 0 and e["episode/failed"] == 0 for e in extra)


def test_evaluation_samples_whole_episodes_and_reports_tool_use(caller_dir):
    from dataclasses import dataclass

    from evaluation.benchmarks import BenchmarkItem
    from evaluation.evaluate import evaluate_items, summarize_rows

    @dataclass(frozen=True)
    class Graded:
        correct: bool
        pred: str = ""
        error: str | None = None

    class Ends:
        def verify_batch(self, texts, answers):
            return [Graded(t.strip().endswith(a)) for t, a in zip(texts, answers)]

    model, tok = load_model(caller_dir)
    items = [BenchmarkItem("heldout", f"h{i}", f"{i % 4}+{i % 3}", "3") for i in range(6)]
    kw = dict(
        templates={"heldout": "{problem}\n"},
        n_samples=2,
        temperature=1.0,
        max_new_tokens=12,
        batch_size=8,
        seed=0,
        device="cpu",
        verifier=Ends(),
    )
    rows = evaluate_items(model, tok, items, env=EnvConfig(target="calculator", max_turns=3), **kw)
    assert len(rows) == 12 and any(r.tool_calls for r in rows) and max(r.turns for r in rows) > 1
    summary = summarize_rows(rows, 2)["heldout"]
    assert summary["tool_calls_per_episode"] > 0 and summary["turns_per_episode"] > 1
    single = evaluate_items(model, tok, items, **kw)  # the default: one turn, no episode metrics
    assert all(r.turns == 1 and r.tool_calls == 0 for r in single)
    assert "tool_calls_per_episode" not in summarize_rows(single, 2)["heldout"]


def test_a_poke_cuts_a_rollout_actors_wait_on_a_slow_tool_short(local_ray, caller_dir):
    """The Ray driver's ``poke``: a rollout actor whose ``run`` waits on 30 s tool calls (nothing to
    decode) returns as soon as ``wake`` arrives in its own concurrency group, holding every episode
    (so a draining laminar rollout pulls at once instead of after the slowest tool)."""
    import time

    import ray

    from conf.schema import ClusterConfig, ToolLatencyConfig
    from training.rl.actors import RelayWorker
    from training.rl.drivers.ray import WAKE_GROUP, rollout_actor_class
    from training.rl.records import StepOrder

    tok = load_tokenizer(caller_dir)
    prompts = [
        PromptItem(f"p{i}", f"{i}+1", "3", encode_problem(tok, "{problem}\n", f"{i}+1"), 1) for i in range(3)
    ]
    env = EnvConfig(
        target="calculator",
        max_turns=3,
        tool_timeout_s=120.0,
        tool_latency=ToolLatencyConfig(kind="fixed", seconds=[30.0]),
    )
    relay = ray.remote(num_cpus=0)(RelayWorker).remote("relay-0")
    state = {k: v.numpy() for k, v in load_model(caller_dir)[0].state_dict().items()}  # the same weights
    ray.get(relay.push.remote(0, [ray.put(state)]))
    Rollout = rollout_actor_class(ray, ClusterConfig(rollout_cpus=0))
    actor = Rollout.remote(
        "rollout-0",
        str(caller_dir),
        RLSections(ray_rl("laminar"), seed=0, cluster=ClusterConfig(rollout_priority="normal"), env=env),
        device="cpu",
    )
    from generation.records import GenRequest

    reqs = tuple(GenRequest(p, sample_idx=0, group_uid=i) for i, p in enumerate(prompts))
    reply = ray.get(actor.run.remote(StepOrder(reqs, (), True, 0, True), 64, relay))
    while reply.status.active != reply.status.parked:  # decode until every episode waits on its tool
        reply = ray.get(actor.run.remote(StepOrder((), (), False, -1, True), 64, None))
    assert reply.status.parked == 3 and not reply.finished
    call = actor.run.remote(StepOrder((), (), False, -1, True), 64, None)
    time.sleep(0.5)
    t0 = time.monotonic()
    actor.wake.options(concurrency_group=WAKE_GROUP).remote()
    reply = ray.get(call, timeout=20)
    assert time.monotonic() - t0 < 10  # not the 30 s tool
    assert reply.status.parked == reply.status.active == 3 and not reply.finished  # nothing lost
    ray.kill(actor)
