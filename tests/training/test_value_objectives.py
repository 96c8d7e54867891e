"""RLOO, REINFORCE++, GAE (fixed and length-adaptive lambda), the clipped value loss, GSPO's sequence
ratio and the exploration terms, against values worked out by hand; each estimator also gets a
negative control (an input where it must give no signal, or where a wrong formula would pass)."""

import dataclasses
import math

import pytest
import torch

from training.objectives import (
    PRESETS,
    ObjectiveParams,
    PolicyBatch,
    TokenInputs,
    adaptive_lambda,
    advantages_of,
    clipped_policy_loss,
    clipped_value_loss,
    dr_grpo_advantages,
    explained_variance,
    gae,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    value_targets,
)

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


MASK = t([[1, 1, 1, 0], [1, 1, 0, 0]])
VALUES = t([[0.5, 0.2, 0.1, 9.0], [0.3, 0.4, 9.0, 9.0]])  # 9.0: padding, must never be read


# ------------------------------------------------------------------------------------------- RLOO
def test_rloo_is_reward_minus_the_mean_of_the_others():
    adv = rloo_advantages(t([1.0, 0.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]))
    # group 0: 1 - (0+0)/2 = 1, 0 - (1+0)/2 = -0.5; group 1: 3 - 1 = 2, 1 - 3 = -2
    torch.testing.assert_close(adv, t([1.0, -0.5, -0.5, 2.0, -2.0]), rtol=0, atol=1e-12)


def test_rloo_negative_control_constant_groups_and_singletons_get_zero_and_it_is_not_the_group_mean():
    adv = rloo_advantages(t([1.0, 1.0, 0.5]), torch.tensor([0, 0, 1]))
    assert torch.equal(adv, torch.zeros(3, dtype=F64))
    r, g = t([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0])
    assert not torch.allclose(rloo_advantages(r, g), dr_grpo_advantages(r, g))  # k/(k-1) = 1.5 apart
    torch.testing.assert_close(rloo_advantages(r, g), 1.5 * dr_grpo_advantages(r, g))


# ------------------------------------------------------------------------------------ REINFORCE++
def test_reinforce_pp_normalises_returns_over_every_token_of_the_batch():
    adv = reinforce_pp_advantages(t([1.0, 0.0]), MASK)
    # 5 tokens: returns 1,1,1,0,0; mean 0.6, unbiased var (3*0.16 + 2*0.36)/4 = 0.3
    s = math.sqrt(0.3)
    want = t([[0.4 / s, 0.4 / s, 0.4 / s, 0.0], [-0.6 / s, -0.6 / s, 0.0, 0.0]])
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-7)


def test_reinforce_pp_folds_the_token_kl_into_the_returns():
    kl = t([[0.2, 0.2, 0.2, 5.0], [0.0, 0.0, 5.0, 5.0]])
    adv = reinforce_pp_advantages(t([1.0, 0.0]), MASK, kl=kl, kl_coef=0.5)
    returns = torch.tensor([0.7, 0.8, 0.9, 0.0, 0.0], dtype=F64)  # 1 - 0.5 * (sum of kl from t on)
    want = (returns - returns.mean()) / returns.std()
    got = adv[MASK.bool()]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_reinforce_pp_negative_control_equal_rewards_give_zero():
    adv = reinforce_pp_advantages(t([1.0, 1.0]), MASK)
    assert torch.equal(adv, torch.zeros_like(adv))


# ------------------------------------------------------------------------------------------- GAE
def test_gae_by_hand():
    adv, ret = gae(VALUES, t([1.0, 0.0]), MASK, gamma=1.0, lam=0.5)
    # row 0: deltas -0.3, -0.1, 0.9; A2 = 0.9, A1 = -0.1 + 0.5*0.9, A0 = -0.3 + 0.5*0.35
    # row 1: deltas 0.1, -0.4;        A1 = -0.4, A0 = 0.1 + 0.5*(-0.4)
    torch.testing.assert_close(adv, t([[-0.125, 0.35, 0.9, 0.0], [-0.1, -0.4, 0.0, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, t([[0.375, 0.55, 1.0, 0.0], [0.2, 0.0, 0.0, 0.0]]), rtol=0, atol=1e-12)


def test_gae_discount_and_the_lambda_limits():
    a, _ = gae(VALUES, t([1.0, 0.0]), MASK, gamma=0.5, lam=1.0)
    # lam 1: A_t = sum gamma^l r_{t+l} - V_t; row 0: 0.25 - 0.5, 0.5 - 0.2, 1 - 0.1
    torch.testing.assert_close(a[0, :3], t([-0.25, 0.3, 0.9]), rtol=0, atol=1e-12)
    a0, _ = gae(VALUES, t([1.0, 0.0]), MASK, gamma=1.0, lam=0.0)  # lam 0: the one-step TD error
    torch.testing.assert_close(a0[0, :3], t([-0.3, -0.1, 0.9]), rtol=0, atol=1e-12)


def test_gae_negative_control_a_perfect_critic_leaves_no_advantage():
    values = t([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # V = the return (gamma 1) everywhere
    adv, ret = gae(values, t([1.0, 0.0]), MASK, gamma=1.0, lam=0.95)
    assert torch.equal(adv, torch.zeros_like(adv))
    torch.testing.assert_close(ret, values * MASK)


def test_length_adaptive_lambda_by_hand():
    # 1 - 1/(0.05 * l): l = 40 -> 0.5, l = 200 -> 0.9, l = 10 -> 1 - 2 < 0 -> 0
    torch.testing.assert_close(adaptive_lambda(t([40.0, 200.0, 10.0]), 0.05), t([0.5, 0.9, 0.0]))
    with pytest.raises(ValueError, match="lambda_alpha"):
        adaptive_lambda(t([4.0]), 0.0)


def test_per_sequence_lambda_equals_running_each_row_with_its_own():
    lam = t([0.5, 0.0])
    adv, _ = gae(VALUES, t([1.0, 0.0]), MASK, gamma=1.0, lam=lam)
    for i in range(2):
        row, _ = gae(VALUES[i : i + 1], t([[1.0, 0.0][i]]), MASK[i : i + 1], gamma=1.0, lam=float(lam[i]))
        torch.testing.assert_close(adv[i : i + 1], row)


def test_vapo_uses_the_length_adaptive_lambda_for_the_policy_and_lambda_one_for_the_critic():
    p = dataclasses.replace(PRESETS["vapo"], lambda_alpha=0.05)  # the paper's alpha
    mask = torch.ones(2, 40, dtype=F64)
    mask[1, 10:] = 0  # lengths 40 (lambda 0.5) and 10 (lambda 0)
    values = torch.linspace(0, 1, 80, dtype=F64).reshape(2, 40)
    inp = TokenInputs(rewards=t([1.0, 0.0]), mask=mask, values=values)
    raw = torch.cat(
        [
            gae(values[i : i + 1], inp.rewards[i : i + 1], mask[i : i + 1], gamma=1.0, lam=lam)[0]
            for i, lam in enumerate([0.5, 0.0])
        ]
    )
    m = mask.bool()
    want = torch.where(m, (raw - raw[m].mean()) / (raw[m].std() + 1e-8), 0.0)
    torch.testing.assert_close(advantages_of(p, inp.rewards, torch.tensor([0, 0]), inp), want)
    # the critic's targets: lambda 1, gamma 1 -> the reward on every token
    torch.testing.assert_close(value_targets(inp, p), mask * t([1.0, 0.0])[:, None])
    # the preset's alpha 1.0 gives 30 tokens the lambda the paper's 0.05 gives 600
    torch.testing.assert_close(
        adaptive_lambda(t([30.0]), PRESETS["vapo"].lambda_alpha), adaptive_lambda(t([600.0]), 0.05)
    )


# ----------------------------------------------------------------------------------- value loss
def test_clipped_value_loss_by_hand():
    v = t([[0.9, 0.6, 0.2]]).requires_grad_()
    loss, frac = clipped_value_loss(v, t([[0.5, 0.5, 0.5]]), t([[1.0, 1.0, 0.0]]), clip=0.2)
    # 0.9: clipped to 0.7 -> 0.5*0.3^2 (the larger); 0.6: inside -> 0.5*0.4^2; 0.2: clipped to 0.3,
    # 0.5*max(0.04, 0.09)
    torch.testing.assert_close(loss, t([[0.045, 0.08, 0.045]]), rtol=0, atol=1e-12)
    assert frac.tolist() == [[1.0, 0.0, 1.0]]
    loss.sum().backward()
    torch.testing.assert_close(v.grad, t([[0.0, -0.4, 0.0]]), rtol=0, atol=1e-12)  # clipped: no grad


def test_value_loss_negative_control_values_at_their_targets_cost_nothing():
    v = t([[0.3, -1.0]])
    loss, frac = clipped_value_loss(v, v, v, clip=0.5)
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(frac, torch.zeros_like(frac))


def test_explained_variance():
    r, m = t([[1.0, 0.0, 1.0, 5.0]]), t([[1, 1, 1, 0]])
    assert explained_variance(r, r, m) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2 / 3), r, m) == pytest.approx(0.0)
    assert math.isnan(explained_variance(r, torch.ones_like(r), m))


# ------------------------------------------------------------------------------------------ GSPO
def test_gspo_ratio_is_the_geometric_mean_over_the_sequence():
    lp = t([[0.1, 0.3, 7.0], [0.2, 0.2, 0.2]]).requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 1]])
    loss, frac = clipped_policy_loss(
        lp,
        torch.zeros(2, 3, dtype=F64),
        t([1.0, -1.0]),
        clip_low=0.5,
        clip_high=0.5,
        ratio_level="sequence",
        mask=mask,
    )
    # row 0: exp(mean(0.1, 0.3)) = exp(0.2) on every token (the padded 7.0 is not read)
    torch.testing.assert_close(loss[0], -torch.full((3,), math.exp(0.2), dtype=F64))
    torch.testing.assert_close(loss[1], torch.full((3,), math.exp(0.2), dtype=F64))
    assert frac.sum() == 0
    tight, frac = clipped_policy_loss(
        lp,
        torch.zeros(2, 3, dtype=F64),
        t([1.0, -1.0]),
        clip_low=3e-4,
        clip_high=4e-4,
        ratio_level="sequence",
        mask=mask,
    )
    torch.testing.assert_close(tight[0], torch.full((3,), -(1 + 4e-4), dtype=F64))  # clipped high
    assert frac[0].tolist() == [1.0, 1.0, 1.0]


def test_gspo_negative_control_the_token_ratio_differs():
    lp, mask = t([[0.1, 0.3]]), t([[1, 1]])
    seq, _ = clipped_policy_loss(lp, torch.zeros_like(lp), t([1.0]), ratio_level="sequence", mask=mask)
    tok, _ = clipped_policy_loss(lp, torch.zeros_like(lp), t([1.0]), clip_low=0.9, clip_high=9.0)
    assert not torch.allclose(seq, tok)
    torch.testing.assert_close(tok, -torch.exp(lp))


def test_gspo_preset_is_sequence_level_with_the_papers_clip():
    p = PRESETS["gspo"]
    assert (p.ratio_level, p.clip_low, p.clip_high, p.advantage) == ("sequence", 3e-4, 4e-4, "grpo")


# ------------------------------------------------------------------------- exploration terms
def _batch(**kw):
    lp = t([[-1.0, -2.0], [-0.5, -3.0]]).requires_grad_()
    base = dict(
        logprobs=lp,
        old_logprobs=lp.detach(),
        behaviour_logprobs=lp.detach(),
        advantages=t([0.0, 0.0]),
        mask=t([[1, 1], [1, 0]]),
        max_len=2,
    )
    return PolicyBatch(**{**base, **kw})


def test_entropy_bonus_subtracts_coef_times_entropy():
    ent = t([[1.0, 2.0], [3.0, 9.0]])
    p = dataclasses.replace(PRESETS["grpo"], loss_agg="token_mean")
    loss, _ = policy_loss(_batch(entropy=ent), p, entropy_coef=0.1)
    assert float(loss.detach()) == pytest.approx(-0.1 * (1 + 2 + 3) / 3)
    none, _ = policy_loss(_batch(entropy=ent), p)  # negative control: coefficient 0, no bonus
    assert float(none.detach()) == 0.0
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(_batch(), p, entropy_coef=0.1)


def test_positive_example_nll_counts_only_rewarded_responses():
    p = dataclasses.replace(PRESETS["grpo"], loss_agg="token_mean", nll_coef=0.1)
    loss, m = policy_loss(_batch(positive=torch.tensor([True, False])), p)
    assert float(loss.detach()) == pytest.approx(0.1 * (1.0 + 2.0) / 3)  # row 1 (not rewarded) adds nothing
    zero, _ = policy_loss(_batch(positive=torch.tensor([False, False])), p)
    assert float(zero.detach()) == 0.0


def test_kl_in_reward_keeps_the_kl_out_of_the_loss():
    ref = t([[0.0, 0.0], [0.0, 0.0]])
    p = dataclasses.replace(PRESETS["reinforce_pp"], kl_coef=0.5)
    loss, m = policy_loss(_batch(ref_logprobs=ref), p)
    assert float(loss.detach()) == 0.0 and m["kl"] > 0
    in_loss, _ = policy_loss(_batch(ref_logprobs=ref), dataclasses.replace(p, kl_in_reward=False))
    assert float(in_loss.detach()) > 0


def test_critic_presets_and_bad_values():
    assert PRESETS["ppo"].needs_critic and PRESETS["vapo"].needs_critic
    assert not any(PRESETS[a].needs_critic for a in ("grpo", "rloo", "reinforce_pp", "gspo"))
    v = PRESETS["vapo"]
    assert (v.critic_lambda, v.lambda_alpha, v.clip_high, v.loss_agg, v.nll_coef) == (
        1.0,
        1.0,
        0.28,
        "token_mean",
        0.1,
    )
    assert PRESETS["ppo"].critic_lambda == PRESETS["ppo"].gae_lambda == 0.95
    # the ranges are the config's (conf.schema.RLConfig's fields), checked once at load, before any write
    from conf.loader import load_config
    from conf.schema import ConfigError

    with pytest.raises(ConfigError, match="rl.gae_lambda=1.5"):
        load_config(["rl.algorithm=ppo", "rl.gae_lambda=1.5"])
    with pytest.raises(ConfigError, match="rl.value_coef"):
        load_config(["rl.algorithm=ppo", "rl.value_coef=-1.0"])
    with pytest.raises(ValueError, match="has none"):
        ObjectiveParams(value_warmup_steps=3)
