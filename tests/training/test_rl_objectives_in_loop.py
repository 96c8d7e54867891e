"""The objectives wired into the loop: dynamic sampling, overlong shaping and filtering, KL, presets."""

from dataclasses import replace

import pytest
import torch
from rl_fakes import Verdict, cpu_trainer, micro_setup, saved_model

from conf.loader import load_config
from generation.model import encode_problem
from training.objectives import PRESETS
from generation.engine import Engine
from training.rl.loop import score_phase
from generation.records import GenRequest, PromptItem, ScoredGroup, Trajectory
from training.rl.stage import objective_params
from training.rl.sections import RLSections


class ByPrompt:
    """Prompts 'easy*' are always right, 'hard*' always wrong, others right when the text starts
    with a digit."""

    def verify_batch(self, responses, golds):
        return [Verdict(g == "easy" or (g == "mixed" and r[:1].isdigit())) for r, g in zip(responses, golds)]


def test_config_overrides_reach_the_objective():
    cfg = load_config(["rl.algorithm=dapo", "rl.clip_high=0.3", "rl.kl_coef=0.01"]).rl
    p = objective_params(cfg)
    assert p.clip_high == 0.3 and p.kl_coef == 0.01 and p.dynamic_sampling and p.loss_agg == "token_mean"
    assert p.overlong_cache_len == cfg.overlong_cache_len
    assert objective_params(load_config(["rl.algorithm=dr_grpo"]).rl).advantage == "dr_grpo"
    p = objective_params(
        load_config(["rl.advantage=batch", "rl.loss_agg=token_mean", "rl.behaviour_weight=mask"]).rl
    )
    assert (p.advantage, p.loss_agg, p.behaviour_weight) == ("batch", "token_mean", "mask")


def test_bad_objective_names_fail_before_any_write():
    import pytest

    from conf.schema import ConfigError

    with pytest.raises(
        ConfigError, match="rl.loss_agg='mean_of_means' is not supported; set rl.loss_agg to one of"
    ):
        load_config(["rl.loss_agg=mean_of_means"])


def _local(tmp_path, model, tok, prompts, params, **rl_kw):
    """The local driver on the micro model: one update per step, batches of ``prompts_per_step``."""
    from conf.schema import RLConfig
    from training.rl.drivers.local import LocalDriver

    rl = RLConfig(lr=1e-3, micro_batch_tokens=0, rollout_capacity=64, **rl_kw)
    return LocalDriver(
        saved_model(tmp_path, model, tok), prompts, ByPrompt(), params, RLSections(rl, seed=0), device="cpu"
    )


def test_dynamic_sampling_drops_constant_groups_and_refills(tmp_path):
    tok, model, prompts = micro_setup(["easy", "hard", "mixed", "mixed"] * 4)
    params = replace(PRESETS["dapo"], max_sampling_rounds=10, overlong_cache_len=1)
    kw = dict(steps=1, prompts_per_step=4, group_size=8, max_new_tokens=2)
    driver = _local(tmp_path / "dapo", model, tok, prompts, params, **kw)
    (got,) = driver.run().history
    assert got.trained_trajectories == 4 * 8 and got.sampling_rounds >= 2 and got.dropped_groups >= 4
    assert all(pid.startswith("mixed") for _, pid in driver.manager.trained_prompts)
    assert got.generated_trajectories >= (4 + got.dropped_groups) * 8
    driver = _local(tmp_path / "grpo", model, tok, prompts, PRESETS["grpo"], **kw)
    (plain,) = driver.run().history
    assert plain.sampling_rounds == 1 and plain.dropped_groups == 0 and plain.trained_trajectories == 4 * 8
    assert plain.generated_trajectories == 4 * 8


def test_dynamic_sampling_stops_at_the_round_cap_and_a_pool_without_signal_fails(tmp_path):
    from training.rl.manager import EMPTY_BATCH_LIMIT

    tok, model, prompts = micro_setup(["easy", "hard"] * 4)
    params = replace(PRESETS["dapo"], max_sampling_rounds=3, overlong_cache_len=1)
    driver = _local(
        tmp_path, model, tok, prompts, params, steps=1, prompts_per_step=4, group_size=4, max_new_tokens=2
    )
    with pytest.raises(RuntimeError, match="dynamic sampling kept no group in 10 batches"):
        driver.run()
    m = driver.manager
    assert m.counts["empty_batches"] == EMPTY_BATCH_LIMIT and m.version == 0 and m.trained_uids == []
    # every empty batch took exactly the cap's 3 rounds of 4 groups, all dropped
    assert (
        m.counts["extra_rounds"] == 2 * EMPTY_BATCH_LIMIT
        and m.buffer.stats.filtered == 12 * EMPTY_BATCH_LIMIT
    )


def test_overlong_shaping_changes_reward_not_correctness():
    tok, _, (p,) = micro_setup(["easy"])
    mk = lambda n: Trajectory("trajectory", p, 0, tuple([5] * n), tuple([0.0] * n), 0, n < 64, "7")  # noqa: E731
    params = PRESETS["dapo"]  # max 64, cache 16 below: 0 up to 48, linear to -1 at 64, -1 beyond
    from training.rl.loop import rl_reward

    reward = rl_reward(ByPrompt(), replace(params, overlong_cache_len=16))
    (g,) = score_phase([mk(40), mk(56), mk(64), mk(70)], reward, 64)
    assert g.correct == (True, True, True, True)
    assert g.rewards == (1.0, 0.5, 0.0, 0.0)
    assert g.terms["overlong"] == (0.0, -0.5, -1.0, -1.0)
    assert rl_reward(ByPrompt(), PRESETS["grpo"]).names == ("math_verify",)


def test_overlong_filter_and_kl_in_the_trainer():
    tok, model, (p,) = micro_setup(["mixed"])
    long_t = Trajectory("trajectory", p, 0, (5, 6, 7), (-1.0, -1.0, -1.0), 0, False, "567")
    short_t = Trajectory("trajectory", p, 1, (5, tok.eos_token_id), (-1.0, -1.0), 0, True, "5")
    group = ScoredGroup("scored_group", p.prompt_id, (long_t, short_t), (0.0, 1.0), (False, True))
    params = replace(PRESETS["grpo"], overlong_filter=True, kl_coef=0.1)
    trainer = cpu_trainer(model, params, tok, max_new_tokens=3)
    stats = trainer.update([group])
    assert stats.metrics["kl"] == 0.0  # first step: policy == reference
    assert stats.n_tokens == 2  # the truncated response is masked out
    stats2 = trainer.update([group])
    assert stats2.metrics["kl"] > 0.0 and stats2.version == 2


def test_minibatches_make_the_clip_bind():
    tok, model, prompts = micro_setup(["mixed"] * 4)
    requests = [GenRequest(prompt=p, sample_idx=i) for p in prompts for i in range(8)]
    trajectories = Engine(model, tok).generate(requests, 3, 1.0, torch.Generator().manual_seed(0))
    groups = score_phase(trajectories, ByPrompt())
    one = cpu_trainer(model, PRESETS["grpo"], tok, max_new_tokens=3, lr=5e-2, max_grad_norm=10.0)
    stats = one.update(groups)
    assert stats.metrics["clipfrac"] == 0.0 and stats.metrics["ratio"] == 1.0 and stats.version == 1
    four = cpu_trainer(
        model, PRESETS["grpo"], tok, max_new_tokens=3, lr=5e-2, max_grad_norm=10.0, minibatches=4
    )
    stats = four.update(groups)
    assert stats.version == 1 and stats.n_sequences == 32
    assert stats.metrics["clipfrac"] > 0.0 and stats.metrics["ratio"] != 1.0


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_give_the_gradient_of_one_batch(algorithm):
    """Length-sorted micro-batches with loss shares: the same update as one padded batch."""
    import copy

    from training.rl.trainer import micro_batches

    tok, model, _ = micro_setup()
    p = PromptItem("p", "1+2", "3", encode_problem(tok, "{problem}\n", "1+2"), 1)
    gen = torch.Generator().manual_seed(0)
    groups = []
    for g in range(3):
        trajs = []
        for i in range(4):
            n = [2, 3, 9, 17][(g + i) % 4]
            toks = tuple(int(x) for x in torch.randint(5, 40, (n,), generator=gen))
            trajs.append(
                Trajectory(
                    "trajectory",
                    p,
                    i,
                    toks,
                    tuple(float(-x) for x in torch.rand(n, generator=gen)),
                    0,
                    i != 3,
                    "3" if i % 2 else "4",
                )
            )
        groups.append(
            ScoredGroup(
                "scored_group",
                f"p{g}",
                tuple(trajs),
                tuple(float(i % 2) for i in range(4)),
                tuple(bool(i % 2) for i in range(4)),
            )
        )
    params = PRESETS[algorithm]
    kw = dict(max_new_tokens=20, lr=1e-2, max_grad_norm=100.0)
    whole = cpu_trainer(copy.deepcopy(model), params, tok, **kw)
    split = cpu_trainer(copy.deepcopy(model), params, tok, micro_batch_tokens=40, **kw)
    lengths = torch.tensor(
        [len(t.prompt.prompt_tokens) + len(t.response_tokens) for g in groups for t in g.trajectories]
    )
    assert len(micro_batches(lengths, torch.arange(12), 40)) >= 3
    a, b = whole.update(groups), split.update(groups)
    assert a.loss == pytest.approx(b.loss, abs=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    # the token-mean diagnostics too, whatever the loss's weights of the micro-batches (seq_mean: sequences)
    for k in ("entropy", "sampler_logprob_gap"):
        assert a.metrics[k] == pytest.approx(b.metrics[k], rel=1e-5), k
    for (name, x), (_, y) in zip(whole.model.named_parameters(), split.model.named_parameters()):
        # the accumulated gradient (left in .grad by the step); Adam would blow float noise up to lr
        assert torch.allclose(x.grad, y.grad, atol=1e-6, rtol=1e-4), name
