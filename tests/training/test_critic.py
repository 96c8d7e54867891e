"""The trainer's critic and exploration controls on the micro model: the critic learns the returns,
value pre-training leaves the policy where it is, the adaptive entropy coefficient moves the right
way, the ProRL reset makes the reference the current policy, and all of it survives a checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_worker import TRAIN_KW, lora_micro_model, random_groups
from rl_fakes import MICRO

from generation.model import build_char_tokenizer, build_tiny_model, save_model
from training.objectives import PRESETS
from training.rl.checkpoint import load_trainer_extras, save_trainer_extras
from training.rl.critic import ValueModel, build_critic, vocab_mismatch
from training.rl.trainer import PolicyTrainer


def _trainer(preset="ppo", lora=False, **params):
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = lora_micro_model(tok) if lora else build_tiny_model(MICRO, tok, seed=0)
    p = dataclasses.replace(PRESETS[preset], **params)
    return PolicyTrainer(model, p, pad_id=tok.pad_token_id, critic_lr=1e-2, **TRAIN_KW), tok


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("lora", [False, True])
def test_the_critic_learns_the_returns_of_a_fixed_batch(lora):
    trainer, tok = _trainer(lora=lora, value_warmup_steps=12)
    groups = random_groups(tok, seed=0)
    stats = [trainer.update(groups) for _ in range(12)]
    losses = [s.metrics["value_loss"] for s in stats]
    assert losses[-1] < 0.5 * losses[0]
    assert stats[-1].metrics["explained_variance"] > stats[0].metrics["explained_variance"] + 0.2
    assert isinstance(trainer.critic, ValueModel) and not hasattr(trainer.critic, "lm_head")


def test_value_pretraining_keeps_the_policy_fixed_then_the_policy_moves():
    trainer, tok = _trainer(value_warmup_steps=2)
    start, critic_start = _weights(trainer.model), _weights(trainer.critic)
    for s in range(2):
        st = trainer.update(random_groups(tok, seed=s))
        assert st.grad_norm == 0.0 and "value_loss" in st.metrics
    assert all(torch.equal(start[k], v) for k, v in _weights(trainer.model).items())
    assert any(not torch.equal(critic_start[k], v) for k, v in _weights(trainer.critic).items())
    assert trainer.version == 2
    trainer.update(random_groups(tok, seed=2))
    assert any(not torch.equal(start[k], v) for k, v in _weights(trainer.model).items())


def test_the_critic_is_a_separate_copy_trained_apart_from_the_policy():
    trainer, tok = _trainer()
    policy_embed = trainer.model.get_input_embeddings().weight
    critic_embed = trainer.critic.backbone.get_input_embeddings().weight
    assert policy_embed.data_ptr() != critic_embed.data_ptr()
    assert not set(map(id, trainer.critic.parameters())) & set(map(id, trainer.model.parameters()))


def test_adaptive_entropy_coefficient_rises_below_its_target_and_falls_above():
    up, tok = _trainer("grpo", entropy_coef=0.01, entropy_target=10.0)
    up.update(random_groups(tok, seed=0))
    down, _ = _trainer("grpo", entropy_coef=0.01, entropy_target=0.5)
    st = down.update(random_groups(tok, seed=0))
    h = st.metrics["entropy"]  # the micro model's entropy: about 4.4 nats
    assert up.entropy_coef == pytest.approx(0.01 + 0.01 * (10.0 - h), rel=1e-3)
    assert down.entropy_coef == 0.0 and st.metrics["entropy_coef"] == 0.0


def test_the_entropy_bonus_changes_the_update():
    plain, tok = _trainer("grpo")
    bonus, _ = _trainer("grpo", entropy_coef=0.5)
    a, b = plain.update(random_groups(tok, seed=0)), bonus.update(random_groups(tok, seed=0))
    assert b.loss < a.loss - 0.5 * 3.0  # minus 0.5 x an entropy of about 4.4
    assert a.metrics["entropy"] == pytest.approx(b.metrics["entropy"], rel=1e-6)  # same start weights


def test_prorl_reset_makes_the_reference_the_current_policy():
    trainer, tok = _trainer("grpo", kl_coef=0.1, ref_reset_every=2)
    ref_start = _weights(trainer.ref_model)
    trainer.update(random_groups(tok, seed=0))
    assert all(torch.equal(ref_start[k], v) for k, v in _weights(trainer.ref_model).items())
    st = trainer.update(random_groups(tok, seed=1))
    assert st.metrics["reference_reset"] == 1.0 and not trainer.opt.state
    policy = _weights(trainer.model)
    assert all(torch.equal(policy[k], v) for k, v in _weights(trainer.ref_model).items())


def test_no_reset_keeps_the_rl_start_weights_as_the_reference():
    trainer, tok = _trainer("grpo", kl_coef=0.1)
    ref_start = _weights(trainer.ref_model)
    for s in range(3):
        trainer.update(random_groups(tok, seed=s))
    assert all(torch.equal(ref_start[k], v) for k, v in _weights(trainer.ref_model).items())


def test_critic_reference_and_entropy_coefficient_round_trip_through_a_checkpoint(tmp_path):
    trainer, tok = _trainer(kl_coef=0.1, ref_reset_every=1, entropy_coef=0.01, entropy_target=9.0)
    for s in range(2):
        trainer.update(random_groups(tok, seed=s))
    save_trainer_extras(tmp_path, trainer)
    fresh, _ = _trainer(kl_coef=0.1, ref_reset_every=1, entropy_coef=0.01, entropy_target=9.0)
    load_trainer_extras(tmp_path, fresh)
    for a, b in ((trainer.critic, fresh.critic), (trainer.ref_model, fresh.ref_model)):
        wa = _weights(a)
        assert all(torch.equal(wa[k], v) for k, v in _weights(b).items())
    sa, sb = trainer.critic_opt.state_dict(), fresh.critic_opt.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    assert all(torch.equal(sa["state"][i]["exp_avg"], sb["state"][i]["exp_avg"]) for i in sa["state"])
    assert fresh.entropy_coef == trainer.entropy_coef > 0.01
    # the next update is the same from the restored state
    assert fresh.update(random_groups(tok, seed=5)).metrics["value_loss"] == pytest.approx(
        trainer.update(random_groups(tok, seed=5)).metrics["value_loss"], rel=1e-6
    )
    grpo, _ = _trainer("grpo")
    with pytest.raises(ValueError, match="critic"):
        load_trainer_extras(tmp_path, grpo)


def test_a_critic_folder_must_share_the_policys_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = build_char_tokenizer()
    save_model(build_tiny_model(MICRO, tok, seed=1), tok, tmp_path / "same")
    assert vocab_mismatch(tok, tmp_path / "same") is None
    critic = build_critic(build_tiny_model(MICRO, tok, seed=0), tmp_path / "same", "cpu")
    assert isinstance(critic, ValueModel)
    other = build_char_tokenizer("abc0123456789")
    assert isinstance(other, PreTrainedTokenizerFast)
    save_model(build_tiny_model(MICRO, other, seed=1), other, tmp_path / "other")
    assert "tokenizer differs" in vocab_mismatch(tok, tmp_path / "other")
