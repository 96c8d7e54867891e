"""The RL features of issue #43 on multi-turn episodes (``env=calculator``), each in a real short run of
a tiny model taught to call the ``calc`` tool: DAPO's dynamic sampling, HIVE / GRESO online selection,
LoRA, and checkpoint / resume. Every test checks that episodes really happened (multi-turn
trajectories with masked observation tokens, tool calls) and that the feature acted on them."""

from __future__ import annotations

import pytest
import torch

from conf.schema import EnvConfig, RLConfig
from generation.model import build_char_tokenizer, encode_problem, load_tokenizer
from generation.records import PromptItem
from tests.environments.episode_helpers import (
    Killed,
    ToolSaysAnswer,
    are_episodes,
    calc_prompts,
    killer,
    sigkill_trainer_at,
    spy_batches,
    spy_groups,
)
from tests.training.rl_fakes import Verdict
from training.rl.drivers.local import LocalDriver
from training.rl.stage import objective_params
from training.rl.sections import RLSections

ENV = EnvConfig(target="calculator", max_turns=3)


def sync_rl(**overrides) -> RLConfig:
    kw = dict(
        mode="sync",
        runtime="local",
        steps=3,
        prompts_per_step=4,
        group_size=4,
        lr=1e-3,
        max_new_tokens=12,
        rollout_capacity=16,
        chunk_steps=4,
        micro_batch_tokens=0,
    )
    return RLConfig(**{**kw, **overrides})


def episode_driver(model_dir, prompts, rl: RLConfig, driver=LocalDriver, **kw):
    """A local driver on calculator episodes answered by ``ToolSaysAnswer`` (``driver``: a subclass)."""
    return driver(
        model_dir,
        prompts,
        ToolSaysAnswer(),
        objective_params(rl),
        RLSections(rl, seed=0, env=ENV),
        device="cpu",
        **kw,
    )


# ------------------------------------------------------------------------------------- DAPO dynamic sampling
def test_dynamic_sampling_drops_uniform_episode_groups_and_refills_the_batch(monkeypatch, caller_dir):
    """DAPO (``rl.algorithm=dapo``: dynamic sampling, overlong shaping, clip-higher) on episodes: every
    group whose episodes are all right or all wrong (the answer-99 prompts, always) is dropped and
    counted, further rounds refill the batch, and the trainer sees only full batches of groups with
    mixed correctness."""
    tok = load_tokenizer(caller_dir)
    rl = sync_rl(algorithm="dapo", max_sampling_rounds=8, overlong_cache_len=4)
    assert objective_params(rl).dynamic_sampling
    prompts = calc_prompts(tok, 32)
    batches = spy_batches(monkeypatch)
    result = episode_driver(caller_dir, prompts, rl).run()
    assert len(batches) == len(result.history) == 3
    trained = [g for b in batches for g in b]
    assert all(len(b) == 4 for b in batches)  # refilled: full batches despite the drops
    assert all(len(set(g.correct)) == 2 for g in trained), [g.correct for g in trained]
    assert all(g.trajectories[0].prompt.answer == "3" and "overlong" in g.terms for g in trained)
    are_episodes([t for g in trained for t in g.trajectories])
    # the reward history holds every rolled-out group: the uniform ones are exactly the dropped ones
    wrong = {p.prompt_id for p in prompts if p.answer == "99"}
    assert all(m == 0.0 for _, p, m, _ in result.rewards if p in wrong)
    assert sum(p in wrong for _, p, _, _ in result.rewards) >= 3
    uniform = [r for r in result.rewards if r[2] in (0.0, 1.0)]
    assert sum(m.dropped_groups for m in result.history) == len(uniform)
    assert len(result.rewards) == len(uniform) + len(trained)
    assert all(m.sampling_rounds > 1 for m in result.history)
    assert all(m.trained_trajectories == 16 for m in result.history)
    assert all(m.extra["episode/tool_calls"] > 0.5 for m in result.history)


def test_dapos_overlong_term_judges_an_episode_by_its_longest_turn():
    """``rl.algorithm=dapo`` adds the overlong term, which compares a length with the generation limit
    (``max_new_tokens``, one turn's cap). An episode is judged by its longest policy turn: two turns of
    7 and 10 tokens under a cap of 12 (L_cache 4) ramp to -0.5, as a 10-token response would, not -1
    for the 22 tokens the whole episode holds with its observation; a turn cut at the cap gets -1.
    The same in RL's scoring and in evaluation's reward terms."""
    from generation.records import Trajectory
    from training.rl.loop import group_scorer

    tok = build_char_tokenizer()
    p = PromptItem("p0", "1+2", "3", encode_problem(tok, "{problem}\n", "1+2"), 1)

    def episode(i, mask, reason):
        n = len(mask)
        return Trajectory(
            "trajectory",
            p,
            i,
            (5,) * n,
            (0.0,) * n,
            0,
            reason == "answer",
            "x",
            loss_mask=tuple(mask),
            turns=1 + mask.count(0) // 5,
            tool_calls=mask.count(0) // 5,
            end_reason=reason,
        )

    answered = [1] * 7 + [0] * 5 + [1] * 10
    cut = [1] * 7 + [0] * 5 + [1] * 12
    single = Trajectory("trajectory", p, 2, (5,) * 7, (0.0,) * 7, 0, True, "x")
    rl = RLConfig(algorithm="dapo", max_new_tokens=12, overlong_cache_len=4)
    score = group_scorer(ToolSaysAnswer(), objective_params(rl), rl.max_new_tokens)
    trajs = [episode(0, answered, "answer"), episode(1, cut, "length"), single]
    assert score(trajs).terms["overlong"] == (-0.5, -1.0, 0.0)
    # evaluation's reward terms judge the same length
    from conf.schema import OverlongParams
    from evaluation.benchmarks import BenchmarkItem
    from evaluation.evaluate import _terms
    from rewards.components import Overlong

    item = BenchmarkItem("heldout", "h0", "1+2", "3")
    terms = _terms([item], 3, trajs, [Verdict(True)] * 3, {}, 12, [Overlong(OverlongParams(cache_len=4))])
    assert [t[0][:2] for t in terms] == [("overlong", -0.5), ("overlong", -1.0), ("overlong", 0.0)]


# --------------------------------------------------------------------------------- HIVE / GRESO selection
class FirstContext:
    """The calculator whose first context is the environment's own rendering (a newline after BOS,
    where a chat template would put its tool header): the finished trajectories' prompts carry these
    tokens, not the prompt's own."""

    name = "calculator_header"

    def __init__(self, inner, tok):
        self.inner = inner
        self.header = tuple(tok("\n", add_special_tokens=False)["input_ids"])

    def reset(self, prompt):
        p = tuple(prompt.prompt_tokens)
        return p[:1] + self.header + p[1:], None

    def step(self, state, turn):
        return self.inner.step(state, turn)

    def close(self):
        self.inner.close()


def test_hive_observes_episode_rewards_and_skips_the_prompts_they_show_uniform(monkeypatch, caller_dir):
    """HIVE's online source (GRESO's skip + the entropy prune) in front of an episode run whose
    environment rewrites the first context: every rolled-out episode group's mean correctness goes
    into GRESO's history, and GRESO then skips the prompts whose episode groups were all wrong (the
    answer-99 prompts) far more than the mixed ones, and skips more as such groups keep coming."""
    import environments.registry as registry
    from data_curation.hive import GresoFilter
    from training.rl.loop import HiveSource

    class Recording(GresoFilter):
        """GRESO's filter, keeping the prompt ids it skipped."""

        def __init__(self, history):
            super().__init__(history)
            self.skipped: list[str] = []

        def filter(self, prompt_ids, rng):
            kept, skipped = super().filter(prompt_ids, rng)
            self.skipped += skipped
            return kept, skipped

    real = registry.make_environment
    monkeypatch.setattr(
        registry,
        "make_environment",
        lambda cfg, tok, sandbox=None: FirstContext(real(cfg, tok, sandbox), tok),
    )
    tok = load_tokenizer(caller_dir)
    prompts = calc_prompts(tok, 16)
    greso = Recording(None)
    p_hard = greso.p_hard
    rl = sync_rl(steps=8, prompts_per_step=4, group_size=4)
    batches = spy_batches(monkeypatch)
    result = episode_driver(
        caller_dir,
        prompts,
        rl,
        source=lambda cursor, engine: HiveSource(cursor, engine, greso=greso, seed=0, min_raw_batch=8),
    ).run()
    trajs = [t for b in batches for g in b for t in g.trajectories]
    are_episodes(trajs)
    header = FirstContext(None, tok).header
    assert all(t.prompt.prompt_tokens[1 : 1 + len(header)] == header for t in trajs)  # rewritten contexts
    # GRESO's history is the episodes' reward history, group for group
    rows = greso.history_rows()
    assert len(rows) == len(result.rewards) == 8 * 4
    assert [(r["prompt_id"], r["mean_reward"]) for r in rows] == [(p, m) for _, p, m, _ in result.rewards]
    wrong = {p.prompt_id for p in prompts if p.answer == "99"}
    assert all(m == 0.0 for _, p, m, _ in result.rewards if p in wrong)
    # the selection reacted to those rewards: skips, mostly of the all-wrong prompts, and a skip base
    # moved down (skip more) by the all-wrong groups' share
    assert sum(m.extra["skipped_prompts"] for m in result.history) == len(greso.skipped) >= 8
    skipped_wrong = sum(p in wrong for p in greso.skipped)  # the mixed prompts are uniform now and then
    assert skipped_wrong >= 2 * (len(greso.skipped) - skipped_wrong), greso.skipped
    assert greso.p_hard < p_hard
    assert sum(m.extra["pruned_prompts"] for m in result.history) > 0  # the entropy prune ran too


# ------------------------------------------------------------------------------------------------- LoRA
def test_lora_trains_only_the_adapter_on_episodes_and_the_sampler_holds_each_version(
    monkeypatch, tmp_path, caller_dir
):
    """An RL run from an adapter folder (LoRA) on episodes: the trainer changes the adapter and nothing
    of the base, and at every weight pull the rollout engine (under the episode runner) computes, for
    an episode's token sequence, the log-probs the trainer's model has at the version it says it
    holds; the trained episodes' behaviour log-probs match the trainer's (the sampler ran them under
    that adapter version)."""
    from conf.schema import LoraConfig
    from generation.adapter import sequence_logprobs as lp_of
    from generation.model import load_model
    from tests.training.lora_probe import check_rollouts_match, versions_differ
    from training.lora import load_trainable, sampling_copy, save_trained

    base = {k: v.clone() for k, v in load_model(caller_dir)[0].state_dict().items()}
    model, tok, _ = load_trainable(caller_dir, LoraConfig(enabled=True, rank=4, alpha=8.0), "rl", seed=0)
    adapter = tmp_path / "adapter"
    save_trained(model, tok, adapter)
    eos = [tok.eos_token_id]
    seq = (
        list(encode_problem(tok, "{problem}\n", "1+2"))
        + tok("calc: 1+2", add_special_tokens=False)["input_ids"]
        + eos
        + tok("\n= 3\n#### 3", add_special_tokens=False)["input_ids"]
        + eos
    )
    trainer_lp, seen = {}, []

    class Probing(LocalDriver):
        def _pull(self, min_version):
            out = super()._pull(min_version)
            trainer_lp[self.trainer.version] = lp_of(self.trainer.model, seq)
            seen.append(("rollout-0", self.engine.version, lp_of(self.engine.model, seq)))
            return out

    rl = sync_rl(steps=4, lr=2e-2, dynamic_sampling=False)
    batches = spy_batches(monkeypatch)
    driver = episode_driver(adapter, calc_prompts(tok, 32), rl, driver=Probing)
    result = driver.run()
    are_episodes([t for b in batches for g in b for t in g.trajectories])
    assert [v for _, v, _ in seen] == [0, 1, 2, 3]  # the batches of updates 1-4 sample versions 0-3
    versions_differ(trainer_lp)
    assert check_rollouts_match(trainer_lp, seen) == 3
    assert all(m.extra["sampler_logprob_gap"] < 1e-4 for m in result.history)  # on-policy episodes
    trained = driver.final_model
    lora_b = [p for n, p in trained.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.detach().abs().max()) > 0 for p in lora_b)  # a fresh adapter's B is 0
    after = sampling_copy(trained).state_dict()  # the base without the adapter
    assert after.keys() == base.keys() and all(torch.equal(after[k], base[k]) for k in base)


# ------------------------------------------------------------------------------------- checkpoint / resume
def test_a_sync_episode_run_killed_after_a_checkpoint_resumes_and_ends_identical(tmp_path, caller_dir):
    """The local driver on episodes (with dynamic sampling) checkpoints every 2 updates; a run killed
    after update 3 resumes from its update-2 checkpoint and ends as the unkilled run: the same
    episodes' rewards, consumed prompts and history, and the same weights."""
    from generation.model import load_model
    from training.rl.checkpoint import RUN_STATE, latest_checkpoint, load_json
    from training.rl.stage import TIMING_KEYS

    tok = load_tokenizer(caller_dir)
    rl = sync_rl(steps=5, checkpoint_every=2, dynamic_sampling=True, max_sampling_rounds=8)

    ran = []  # (folder, step) of every update a run took itself

    def run(folder, kill_at=None):
        driver = episode_driver(
            caller_dir,
            calc_prompts(tok, 32),
            rl,
            state_dir=tmp_path / folder,
            on_step=killer(ran, folder, kill_at),
        )
        result = driver.run()
        return result, {k: v.clone() for k, v in driver.final_model.state_dict().items()}

    whole, w_whole = run("whole")
    with pytest.raises(Killed):
        run("killed", kill_at=3)
    last = latest_checkpoint(tmp_path / "killed" / "checkpoints")
    assert last is not None and last.name == "step-000002"
    assert load_json(last, RUN_STATE)["version"] == 2
    ran.clear()
    resumed, w_resumed = run("killed")
    assert ran == [
        ("killed", 3),
        ("killed", 4),
        ("killed", 5),
    ]  # it resumed: updates 1-2 came from the checkpoint

    def untimed(history):
        return [{k: v for k, v in m.as_dict().items() if k not in TIMING_KEYS} for m in history]

    # the same tokens and rewards; float metrics and weights to float noise: the tool pool answers in
    # its own order, which changes the engine's batch layout and so the last bits of the behaviour
    # log-probs (the unkilled run against itself differs as much)
    a, b = untimed(resumed.history), untimed(whole.history)
    assert len(a) == len(b) == 5 and [x.keys() for x in a] == [y.keys() for y in b]
    assert all(x == pytest.approx(y, rel=1e-4, abs=1e-5) for x, y in zip(a, b))
    assert all(m["episode/tool_calls"] > 0.5 and m["episode/turns"] > 1.5 for m in b)
    assert sorted(resumed.rewards) == sorted(whole.rewards)  # recorded as groups complete: tool timing
    assert resumed.consumed == whole.consumed
    assert all(torch.allclose(w_whole[k], w_resumed[k], atol=1e-5) for k in w_whole)
    fresh = {k: v for k, v in load_model(caller_dir)[0].state_dict().items()}
    assert any(not torch.allclose(fresh[k], w_whole[k], atol=1e-3) for k in fresh)  # and they trained


@pytest.mark.slow
def test_a_laminar_episode_run_killed_after_a_checkpoint_resumes_its_buffered_and_in_flight_episodes(
    monkeypatch, tmp_path, local_ray, caller_dir
):
    """The Ray runtime (laminar: two rollouts, the trainer SIGKILLed after update 5) on episodes: the
    update-4 checkpoint holds finished episodes of groups not yet trained, with their loss masks, and
    the episodes then in flight; the resumed run trains the checkpoint's episodes as they were saved,
    starts the in-flight ones again from their prompts, trains every group exactly once over both
    runs and ends at update 8."""
    from conf.schema import ClusterConfig
    from tests.training.rl_fakes import ray_rl
    from training.rl.checkpoint import RUN_STATE, latest_checkpoint, load_json
    from training.rl.control import trajectory_from_json
    from training.rl.drivers.ray import LaminarRuntime

    ray = local_ray
    tok = load_tokenizer(caller_dir)
    rl = ray_rl(
        "laminar", steps=8, lr=1e-3, checkpoint_every=2, eval_every=0, group_size=4, rollout_capacity=16
    )
    batches = spy_groups(monkeypatch)

    def runtime(on_step=None):
        return LaminarRuntime(
            caller_dir,
            calc_prompts(tok, 200, answer=lambda i: "3"),
            ToolSaysAnswer(),
            objective_params(rl),
            RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=2, actor_threads=1), env=ENV),
            device="cpu",
            state_dir=tmp_path / "state",
            on_step=on_step,
        )

    rt = runtime(sigkill_trainer_at(5, ray, lambda: rt))
    with pytest.raises(ray.exceptions.RayActorError):
        rt.run()
    first = list(batches)
    are_episodes([t for _, g in first for t in g.trajectories])
    last = latest_checkpoint(tmp_path / "state" / "checkpoints")
    assert last is not None and last.name == "step-000004"
    saved = load_json(last, RUN_STATE)
    held = [trajectory_from_json(t) for t in saved["buffer"]["partial"] + saved["buffer"]["ready"]]
    assert held and any(t.turns > 1 and 0 in t.loss_mask and t.tool_calls for t in held), held
    assert saved["in_flight"], "nothing was in flight at the checkpoint"
    assert len(saved["trained_uids"]) == 4 * 4

    batches.clear()
    rt2 = runtime()
    result = rt2.run()
    assert rt2.summary.get("resumed") == 1 and rt2.summary["updates"] == len(result.history) == 8
    uids = rt2.summary["trained_uids"]  # the checkpoint's 16 and the resumed run's 16
    assert len(uids) == len(set(uids)) == 8 * 4
    assert uids[:16] == saved["trained_uids"] and [u for u, _ in batches] == uids[16:]
    trained = {(t.group_uid, t.sample_idx): t for _, g in batches for t in g.trajectories}
    are_episodes(list(trained.values()))
    # a buffered episode trains as saved (tokens, mask, log-probs, turns), unless its group went too
    # stale and was rolled out again under newer weights
    kept = []
    for t in held:
        got = trained.get((t.group_uid, t.sample_idx))
        if got is not None and got != t:
            assert got.version > t.version
        elif got is not None:
            kept.append(t)
    assert any(t.turns > 1 and 0 in t.loss_mask for t in kept), (len(held), len(kept))
    in_flight = [(q["group_uid"], q["sample_idx"]) for q in saved["in_flight"]]
    fresh = [trained[k] for k in in_flight if k in trained]
    assert fresh and all(t.version >= 4 for t in fresh)  # re-queued: rolled out again, after the resume
