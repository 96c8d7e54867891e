"""Objectives against values worked out by hand (float64, tight tolerances)."""

import dataclasses
import math
import typing

import pytest
import torch

from conf.schema import RL_ALGORITHMS, Advantage, BehaviourWeight, LossAgg, RatioLevel
from training.objectives import (
    ADVANTAGES,
    AGGREGATIONS,
    BEHAVIOUR_WEIGHTS,
    PRESETS,
    RATIO_LEVELS,
    TOKEN_ADVANTAGES,
    ObjectiveParams,
    PolicyBatch,
    aggregate,
    batch_normalized_advantages,
    clipped_policy_loss,
    count_constant_groups,
    decoupled_ppo_loss,
    dr_grpo_advantages,
    entropy_from_logits,
    grpo_advantages,
    kl_k3,
    masked_is_weights,
    nonconstant_groups,
    overlong_filter_mask,
    policy_loss,
    staleness,
    truncated_is_weights,
)

ATOL = 1e-6
F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def logs(values):
    """Log-probs whose exp is exactly the given ratios (relative to 0)."""
    return torch.log(t(values))


# Groups of unequal size, interleaved labels, a group of one:
# group 5 -> rewards [1, 0, 0] (mean 1/3, unbiased std sqrt(1/3)), group 2 -> [3, 1] (mean 2, std
# sqrt(2)), group 9 -> [7] alone.
REWARDS = t([1.0, 3.0, 0.0, 7.0, 1.0, 0.0])
GROUPS = torch.tensor([5, 2, 5, 9, 2, 5])


# --------------------------------------------------------------------------- advantages


def test_grpo_unequal_groups_unbiased_std():
    adv = grpo_advantages(REWARDS, GROUPS, eps=0.0)
    # (2/3)/sqrt(1/3) = 2/sqrt(3); (-1/3)/sqrt(1/3) = -1/sqrt(3); +-1/sqrt(2); singleton 0
    close(
        adv,
        [
            1.1547005383792517,
            0.7071067811865476,
            -0.5773502691896258,
            0.0,
            -0.7071067811865476,
            -0.5773502691896258,
        ],
    )


def test_grpo_default_eps_in_denominator():
    adv = grpo_advantages(t([1.0, 0.0]), torch.tensor([0, 0]))
    close(adv, [0.7071057811879616, -0.7071057811879616])  # 0.5 / (sqrt(0.5) + 1e-6)


def test_grpo_constant_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point; the advantage must still be exactly 0, never NaN.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=torch.float32)
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1, 1]))
    assert torch.equal(adv[:3], torch.zeros(3))
    assert torch.isfinite(adv).all()
    close(adv[3:], [0.7071057811879616, -0.7071057811879616])


def test_grpo_integer_rewards_and_single_group_of_one():
    assert torch.equal(grpo_advantages(torch.tensor([1]), torch.tensor([0])), torch.zeros(1))
    close(
        grpo_advantages(torch.tensor([1, 0, 0, 1]), torch.tensor([3, 3, 3, 3]), eps=0.0).double(),
        [0.8660254037844386, -0.8660254037844386, -0.8660254037844386, 0.8660254037844386],
        atol=1e-6,
    )


def test_dr_grpo_is_centred_reward():
    close(dr_grpo_advantages(REWARDS, GROUPS), [2 / 3, 1.0, -1 / 3, 0.0, -1.0, -1 / 3])


def test_batch_normalized():
    # centred [2/3, 1, -1/3, 0, -1, -1/3]: sum of squares 8/3, unbiased batch std sqrt(8/15)=0.7302967
    adv = batch_normalized_advantages(REWARDS, GROUPS)
    close(
        adv,
        [
            0.9128696791769884,
            1.3693045187654826,
            -0.4564348395884942,
            0.0,
            -1.3693045187654826,
            -0.4564348395884942,
        ],
    )


def test_batch_normalized_all_constant_is_zero():
    adv = batch_normalized_advantages(t([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(adv, torch.zeros(4, dtype=F64))


def test_every_name_the_config_accepts_has_its_function():
    assert set(ADVANTAGES) | set(TOKEN_ADVANTAGES) == set(typing.get_args(Advantage))
    assert not set(ADVANTAGES) & set(TOKEN_ADVANTAGES)
    assert set(RATIO_LEVELS) == set(typing.get_args(RatioLevel))
    assert set(AGGREGATIONS) == set(typing.get_args(LossAgg))
    assert set(BEHAVIOUR_WEIGHTS) == set(typing.get_args(BehaviourWeight))
    assert set(PRESETS) == set(RL_ALGORITHMS)


def test_advantage_table():
    assert ADVANTAGES["grpo"] is grpo_advantages
    assert ADVANTAGES["dr_grpo"] is dr_grpo_advantages
    assert ADVANTAGES["batch"] is batch_normalized_advantages
    with pytest.raises(TypeError):
        ADVANTAGES["new"] = grpo_advantages  # read-only table


# --------------------------------------------------------------------------- clipped loss


def test_clipped_loss_decoupled_bounds():
    # ratios 1.5, 0.5, 1.1 for A=+1 (row 0) and A=-1 (row 1); clip range [0.8, 1.28]
    lp = logs([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
    loss, clipfrac = clipped_policy_loss(lp, torch.zeros(2, 3, dtype=F64), t([1.0, -1.0]))
    close(loss, [[-1.28, -0.5, -1.1], [1.5, 0.8, 1.1]])
    close(clipfrac, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])


def test_clipped_loss_symmetric_and_token_advantages():
    lp = logs([[1.5, 0.5]])
    adv = t([[2.0, -3.0]])  # per-token advantages
    loss, clipfrac = clipped_policy_loss(lp, torch.zeros(1, 2, dtype=F64), adv, clip_low=0.2, clip_high=0.2)
    close(loss, [[-2.4, 2.4]])  # -2*1.2 ; 3*max(0.5, 0.8)
    close(clipfrac, [[1.0, 1.0]])


def test_dual_clip_bounds_negative_advantages_only():
    lp = logs([[5.0, 2.0, 5.0], [5.0, 5.0, 5.0]])
    adv = t([[-1.0, -1.0, -2.0], [1.0, 1.0, 1.0]])
    loss, clipfrac = clipped_policy_loss(lp, torch.zeros(2, 3, dtype=F64), adv, dual_clip=3.0)
    # A<0: min(max(5, 1.28), 3)=3 ; min(2, 3)=2 ; min(10, 6)=6. A>0 unaffected: -1.28
    close(loss, [[3.0, 2.0, 6.0], [-1.28, -1.28, -1.28]])
    close(clipfrac, [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    plain, _ = clipped_policy_loss(lp, torch.zeros(2, 3, dtype=F64), adv)
    close(plain[0], [5.0, 2.0, 10.0])


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.dual_clip=0.5", "rl.dual_clip=0.5 must be > 1; verl uses 3.0"),
        ("rl.clip_low=1.0", r"rl.clip_low=1.0 must be in \[0, 1\)"),
        ("rl.gamma=1.5", r"rl.gamma=1.5 must be in \[0, 1\]"),
        ("rl.is_cap=0", "rl.is_cap=0.0 must be > 0"),
    ],
)
def test_objective_ranges_are_the_configs_checked_once_at_load(override, message):
    """One rule, one place: the ranges of what a config sets are ``RLConfig``'s field constraints."""
    from conf.loader import load_config
    from conf.schema import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config([override])


def test_clipped_loss_gradient_only_through_logprobs():
    lp = logs([[1.5, 0.5, 1.1]]).requires_grad_()
    old = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    adv = t([2.0]).requires_grad_()
    loss, _ = clipped_policy_loss(lp, old, adv)
    loss.sum().backward()
    # d(-A*rho)/dlp = -A*rho where unclipped, 0 where clipped (ratio 1.5 > 1.28)
    close(lp.grad, [[0.0, -1.0, -2.2]])
    assert old.grad is None and adv.grad is None


# --------------------------------------------------------------------------- aggregation

LOSS = t([[1.0, 2.0, 3.0, 4.0], [10.0, 100.0, 100.0, 100.0]])  # 100s are padding
MASK = t([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])


def test_aggregation_modes_differ_on_unequal_lengths():
    close(aggregate(LOSS, MASK, "token_mean"), 4.0)  # (10 + 10) / 5
    close(aggregate(LOSS, MASK, "seq_mean"), 6.25)  # (2.5 + 10) / 2
    close(aggregate(LOSS, MASK, "seq_sum_const", max_len=4), 2.5)  # 20 / (2 * 4)
    close(aggregate(LOSS, MASK, "seq_sum_const", max_len=10), 1.0)  # 20 / (2 * 10)
    close(aggregate(LOSS, MASK.bool(), "token_mean"), 4.0)


def test_padding_with_inf_does_not_leak():
    loss = LOSS.clone()
    loss[1, 1:] = float("inf")
    for mode in AGGREGATIONS:
        assert torch.isfinite(aggregate(loss, MASK, mode, max_len=4))


def test_seq_mean_skips_empty_sequences():
    close(aggregate(t([[1.0, 2.0], [5.0, 5.0]]), t([[1.0, 1.0], [0.0, 0.0]]), "seq_mean"), 1.5)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_empty_mask_gives_zero_with_grad(mode):
    loss = torch.ones(2, 3, dtype=F64, requires_grad=True)
    out = aggregate(loss * 2.0, torch.zeros(2, 3), mode, max_len=3)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3, dtype=F64))


def test_seq_sum_const_requires_max_len():
    with pytest.raises(ValueError, match="max_len"):
        aggregate(LOSS, MASK, "seq_sum_const")


def test_unknown_aggregation_names_choices():
    with pytest.raises(ValueError, match="token_mean"):
        aggregate(LOSS, MASK, "sum")


# --------------------------------------------------------------------------- DAPO shaping and sampling


def test_overlong_filter_mask():
    assert torch.equal(
        overlong_filter_mask(torch.tensor([True, False, False])), torch.tensor([0.0, 1.0, 1.0])
    )


def test_dynamic_sampling_groups():
    rewards = t([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 3])  # 0 mixed, 1 all zero, 2 and 3 singletons
    assert nonconstant_groups(rewards, groups).tolist() == [True, True, True, False, False, False, False]
    assert count_constant_groups(rewards, groups) == 3
    assert count_constant_groups(t([1.0, 0.0]), torch.tensor([4, 4])) == 0


# --------------------------------------------------------------------------- off-policy correction

# token ratios pi_old / pi_behave: 2, 0.5, 5, 1
OLD = logs([[2.0, 0.5], [5.0, 1.0]])
BEHAVE = torch.zeros(2, 2, dtype=F64)


def test_truncated_is_token_level():
    close(truncated_is_weights(OLD, BEHAVE, cap=3.0), [[2.0, 0.5], [3.0, 1.0]])


def test_truncated_is_sequence_level_uses_mask():
    old = logs([[2.0, 2.0, 100.0], [2.0, 0.5, 7.0]])  # third column is padding
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = truncated_is_weights(old, torch.zeros(2, 3, dtype=F64), cap=3.0, level="sequence", mask=mask)
    close(w, [[3.0, 3.0, 3.0], [1.0, 1.0, 1.0]])  # products 4 -> capped 3; 1
    w = truncated_is_weights(old, torch.zeros(2, 3, dtype=F64), cap=5.0, level="sequence", mask=mask)
    close(w, [[4.0, 4.0, 4.0], [1.0, 1.0, 1.0]])


def test_masked_is_weights_zero_outside_bounds():
    close(masked_is_weights(OLD, BEHAVE, low=0.6, high=3.0), [[2.0, 0.0], [0.0, 1.0]])
    close(masked_is_weights(OLD, BEHAVE), [[2.0, 0.5], [0.0, 1.0]])  # AReaL: cap above only
    mask = t([[1.0, 1.0], [1.0, 1.0]])
    close(masked_is_weights(OLD, BEHAVE, high=3.0, level="sequence", mask=mask), [[1.0, 1.0], [0.0, 0.0]])


def test_is_weights_are_detached():
    old = OLD.clone().requires_grad_()
    assert not truncated_is_weights(old, BEHAVE).requires_grad
    assert not masked_is_weights(old, BEHAVE).requires_grad


def test_behaviour_weight_table():
    assert set(BEHAVIOUR_WEIGHTS) == {"truncate", "mask", "none"}
    close(BEHAVIOUR_WEIGHTS["truncate"](OLD, BEHAVE, 3.0, None), [[2.0, 0.5], [3.0, 1.0]])
    close(BEHAVIOUR_WEIGHTS["mask"](OLD, BEHAVE, 3.0, None), [[2.0, 0.5], [0.0, 1.0]])
    close(BEHAVIOUR_WEIGHTS["none"](OLD, BEHAVE, 3.0, None), [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="level"):
        truncated_is_weights(OLD, BEHAVE, level="batch")


def test_decoupled_reduces_to_clipped_when_on_policy():
    lp = logs([[1.5, 0.5, 1.1], [0.9, 1.3, 1.0]])
    prox = logs([[1.1, 0.7, 1.0], [1.2, 0.8, 1.0]])
    adv = t([1.0, -0.5])
    expected, clipfrac = clipped_policy_loss(lp, prox, adv, clip_low=0.2, clip_high=0.28)
    for mode in BEHAVIOUR_WEIGHTS:
        loss, stats = decoupled_ppo_loss(
            lp, prox, prox, adv, clip_low=0.2, clip_high=0.28, behaviour_weight=mode
        )
        torch.testing.assert_close(loss, expected, atol=0, rtol=0)
        torch.testing.assert_close(stats["clipfrac"], clipfrac, atol=0, rtol=0)
        assert torch.equal(stats["behaviour_weight"], torch.ones(2, 3, dtype=F64))


def test_decoupled_weights_by_behaviour_ratio():
    lp = logs([[1.5, 1.1]])  # u = 1.5 (clipped at 1.28), 1.1
    prox = torch.zeros(1, 2, dtype=F64)
    behave = logs([[0.5, 0.25]])  # pi_prox / pi_behave = 2, 4
    kw = dict(clip_low=0.2, clip_high=0.28)
    loss, stats = decoupled_ppo_loss(lp, prox, behave, t([1.0]), **kw)
    close(loss, [[-2.56, -3.3]])  # 2 * -1.28 ; min(4, 3) * -1.1
    close(stats["ratio"], [[1.5, 1.1]])
    close(stats["behaviour_weight"], [[2.0, 3.0]])
    loss, _ = decoupled_ppo_loss(lp, prox, behave, t([1.0]), behaviour_weight="truncate", cap=1.5, **kw)
    close(loss, [[-1.92, -1.65]])
    loss, _ = decoupled_ppo_loss(lp, prox, behave, t([1.0]), behaviour_weight="mask", cap=3.0, **kw)
    close(loss, [[-2.56, 0.0]])
    loss, _ = decoupled_ppo_loss(lp, prox, behave, t([1.0]), behaviour_weight="none", **kw)
    close(loss, [[-1.28, -1.1]])


def test_decoupled_gradient_only_through_logprobs():
    lp = logs([[0.5, 1.1, 1.5]]).requires_grad_()
    prox = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    behave = logs([[0.5, 0.5, 0.5]]).requires_grad_()
    adv = t([1.0]).requires_grad_()
    loss, _ = decoupled_ppo_loss(lp, prox, behave, adv, clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    # w = 2; A>0: ratio 0.5 is not clipped (max(-0.5, -0.8)) -> 2 * -0.5; 1.1 -> 2 * -1.1; 1.5 clipped -> 0
    close(lp.grad, [[-1.0, -2.2, 0.0]])
    assert prox.grad is None and behave.grad is None and adv.grad is None


def test_staleness():
    assert staleness(7, torch.tensor([7, 5, 3])).tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="trainer_version"):
        staleness(2, torch.tensor([3]))


# --------------------------------------------------------------------------- KL and entropy


def test_kl_k3():
    lp = t([[0.0, math.log(2.0), -1.0]])
    ref = t([[math.log(2.0), 0.0, -1.0]])
    close(kl_k3(lp, ref), [[0.3068528194400546, 0.1931471805599454, 0.0]])  # 2-ln2-1 ; 0.5+ln2-1


def test_kl_k3_gradient_only_through_logprobs():
    lp = t([[0.0]]).requires_grad_()
    ref = t([[math.log(2.0)]]).requires_grad_()
    kl_k3(lp, ref).sum().backward()
    close(lp.grad, [[-1.0]])  # d/dlp (e^{ref-lp} - (ref-lp) - 1) = -e^{ref-lp} + 1 = -1
    assert ref.grad is None


def test_entropy_from_logits():
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0, float("-inf")]],
            [[0.0, float("-inf"), float("-inf"), 0.0], [1000.0, 0.0, 0.0, 0.0]],
        ]
    )
    ent = entropy_from_logits(logits).double()
    # uniform over 4: ln4 ; (1/2,1/4,1/4): 1.5 ln2 ; uniform over 2: ln2 ; near one-hot: ~0
    close(ent, [[1.3862943611198906, 1.0397207708399179], [0.6931471805599453, 0.0]], atol=1e-6)


def test_entropy_gradient_finite_with_masked_vocab():
    logits = torch.tensor([[[0.5, float("-inf"), 0.0]]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()


# --------------------------------------------------------------------------- presets and policy_loss


def test_presets():
    grpo, dapo, dr = PRESETS["grpo"], PRESETS["dapo"], PRESETS["dr_grpo"]
    assert (grpo.advantage, grpo.loss_agg, grpo.clip_low, grpo.clip_high) == ("grpo", "seq_mean", 0.2, 0.2)
    assert not (grpo.dynamic_sampling or grpo.overlong_shaping or grpo.overlong_filter)
    assert grpo.dual_clip is None and grpo.kl_coef == 0.0
    assert (dapo.advantage, dapo.loss_agg, dapo.clip_low, dapo.clip_high) == ("grpo", "token_mean", 0.2, 0.28)
    assert dapo.dynamic_sampling and dapo.max_sampling_rounds == 10
    assert dapo.overlong_shaping and dapo.overlong_cache_len == 4096 and not dapo.overlong_filter
    assert (dr.advantage, dr.loss_agg, dr.clip_low, dr.clip_high) == ("dr_grpo", "seq_sum_const", 0.2, 0.2)
    assert not (dr.dynamic_sampling or dr.overlong_shaping)
    with pytest.raises(dataclasses.FrozenInstanceError):
        grpo.clip_high = 0.3


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("advantage", "ppo", "grpo"),
        ("loss_agg", "sum", "token_mean"),
        ("behaviour_weight", "clip", "truncate"),
    ],
)
def test_params_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        ObjectiveParams(**{field: value})


def make_batch(**overrides):
    # ratios row 0 (A=+1): 1.5, 0.5, 1.1 ; row 1 (A=-1): 1.0, 1.5, padding
    lp = logs([[1.5, 0.5, 1.1], [1.0, 1.5, 1.0]]).requires_grad_()
    zeros = torch.zeros(2, 3, dtype=F64)
    fields = dict(
        logprobs=lp,
        old_logprobs=zeros,
        behaviour_logprobs=zeros,
        advantages=t([1.0, -1.0]),
        mask=t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        max_len=4,
    )
    fields.update(overrides)
    return PolicyBatch(**fields)


def test_policy_loss_dapo_token_mean():
    batch = make_batch()
    loss, metrics = policy_loss(batch, PRESETS["dapo"])
    # (-1.28 - 0.5 - 1.1 + 1.0 + 1.5) / 5
    close(loss, -0.076)
    expected = {"loss": -0.076, "clipfrac": 0.2, "ratio": 1.12, "behaviour_weight": 1.0}
    assert metrics == pytest.approx(expected, abs=1e-9)
    loss.backward()
    close(batch.logprobs.grad, [[0.0, -0.1, -0.22], [0.2, 0.3, 0.0]])  # -A*rho/5 where unclipped


def test_policy_loss_grpo_and_dr_grpo():
    # clip [0.8, 1.2]: row 0 -> -1.2, -0.5, -1.1 (sum -2.8) ; row 1 -> 1.0, 1.5 (sum 2.5)
    loss, _ = policy_loss(make_batch(), PRESETS["grpo"])
    close(loss, 0.15833333333333333)  # (-2.8/3 + 2.5/2) / 2
    loss, _ = policy_loss(make_batch(), PRESETS["dr_grpo"])
    close(loss, -0.0375)  # (-2.8 + 2.5) / (2 * 4)


def test_policy_loss_off_policy_weights_and_none():
    behave = t([[-math.log(2.0)] * 3, [0.0] * 3])  # row 0 behaviour weight 2
    batch = make_batch(behaviour_logprobs=behave)
    loss, metrics = policy_loss(batch, PRESETS["dapo"])
    close(loss, -0.652)  # (2 * (-2.88) + 2.5) / 5
    assert metrics["behaviour_weight"] == pytest.approx(1.6, abs=1e-9)  # (2*3 + 2) / 5
    loss, metrics = policy_loss(batch, dataclasses.replace(PRESETS["dapo"], behaviour_weight="none"))
    close(loss, -0.076)
    assert metrics["behaviour_weight"] == 1.0


def test_policy_loss_kl_and_staleness():
    batch = make_batch(
        ref_logprobs=logs([[1.5, 0.5, 1.1], [1.0, 1.5, 1.0]]) + math.log(2.0),
        versions=torch.tensor([5, 3]),
        trainer_version=7,
    )
    loss, metrics = policy_loss(batch, dataclasses.replace(PRESETS["dapo"], kl_coef=0.1))
    close(loss, -0.076 + 0.1 * 0.3068528194400546)  # k3 with ref - lp = ln2 on every token
    assert metrics["kl"] == pytest.approx(0.3068528194400546, abs=1e-9)
    assert (metrics["staleness_mean"], metrics["staleness_max"]) == (3.0, 4.0)  # lags 7-5=2 and 7-3=4
    loss, metrics = policy_loss(batch, PRESETS["dapo"])  # kl_coef 0: reported, not added
    close(loss, -0.076)
    assert metrics["kl"] == pytest.approx(0.3068528194400546, abs=1e-9)


def test_policy_loss_kl_without_reference_says_what_to_do():
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(make_batch(), dataclasses.replace(PRESETS["dapo"], kl_coef=0.1))


def test_policy_batch_validates_shapes():
    with pytest.raises(ValueError, match="old_logprobs"):
        make_batch(old_logprobs=torch.zeros(2, 4, dtype=F64))
    with pytest.raises(ValueError, match="advantages"):
        make_batch(advantages=t([1.0]))
    with pytest.raises(ValueError, match="trainer_version"):
        make_batch(versions=torch.tensor([1, 1]))
