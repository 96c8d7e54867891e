"""A policy loss by import path (``rl.loss``): the trainer calls it, its gradient is the one taken, its
parameters are validated by its own model, and a loss that does not fit fails before any write."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from rl_fakes import cpu_trainer, micro_setup

from conf.loader import load_config
from conf.schema import ConfigError
from generation.model import encode_prompt
from generation.records import PromptItem, ScoredGroup, Trajectory
from tasks.preflight import load_checked
from training.objectives import PRESETS, PolicyBatch, policy_loss
from training.rl.stage import objective_params

CALLS = {"n": 0}


@dataclass
class Params:
    scale: float = 1.0


def reinforce(batch: PolicyBatch, params, own: Params):
    """Plain REINFORCE per token, scaled: ``-scale * A * log pi``; counts its calls."""
    CALLS["n"] += 1
    adv = batch.advantages[:, None] if batch.advantages.dim() == 1 else batch.advantages
    return -own.scale * adv * batch.logprobs, {"scale": own.scale}


reinforce.Params = Params


def not_a_loss(batch):
    return batch


def make_batch():
    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -0.7, -1.0]], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    return PolicyBatch(lp, zeros, zeros, adv, mask, max_len=3)


def test_the_custom_loss_replaces_the_ppo_term_and_its_params_reach_it():
    params = objective_params(
        load_config([f"rl.loss={__name__}:reinforce", "rl.loss_params={scale: 2.0}"]).rl
    )
    assert params.loss == f"{__name__}:reinforce" and params.loss_params == (("scale", 2.0),)
    batch = make_batch()
    before = CALLS["n"]
    loss, metrics = policy_loss(batch, params)
    assert CALLS["n"] == before + 1 and metrics["loss/scale"] == 2.0
    loss.backward()
    # seq_mean (GRPO): d/dlp of mean over rows of (row token mean of -2*A*lp)
    expected = torch.tensor([[-1 / 3, -1 / 3, -1 / 3], [0.5, 0.5, 0.0]], dtype=torch.float64)
    assert torch.allclose(batch.logprobs.grad, expected)
    ppo = make_batch()
    policy_loss(ppo, PRESETS["grpo"])[0].backward()
    assert not torch.allclose(ppo.logprobs.grad, expected)  # the gradient is the custom loss's


def test_the_trainer_updates_with_the_custom_loss():
    tok, model, _ = micro_setup()
    p = PromptItem("p0", "1+1", "2", encode_prompt(tok, "1+1\n"))
    a = Trajectory("trajectory", p, 0, (5, tok.eos_token_id), (-1.0, -1.0), 0, True, "5")
    b = Trajectory("trajectory", p, 1, (6, tok.eos_token_id), (-1.0, -1.0), 0, True, "6")
    group = ScoredGroup("scored_group", "p0", (a, b), (1.0, 0.0), (True, False))
    params = replace(PRESETS["grpo"], loss=f"{__name__}:reinforce", loss_params=(("scale", 1.0),))
    trainer = cpu_trainer(model, params, tok, max_new_tokens=2)
    before = CALLS["n"]
    stats = trainer.update([group])
    assert CALLS["n"] > before and stats.metrics["loss/scale"] == 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.loss=no_such_pkg.losses:mine", r"rl.loss: plug-in 'no_such_pkg.losses:mine' cannot be imported"),
        (f"rl.loss={__name__}:not_a_loss", r"rl.loss: plug-in '.*:not_a_loss' has the wrong signature"),
        ("rl.loss=mine", r"rl.loss: plug-in target 'mine' is not an import path"),
    ],
)
def test_a_loss_that_does_not_fit_fails_before_any_write(override, message):
    with pytest.raises(ConfigError, match=message):
        load_checked([override])


def test_params_the_loss_does_not_take_are_refused():
    with pytest.raises(ConfigError, match=r"unknown params \['scal'\]; it takes \['scale'\]"):
        load_checked([f"rl.loss={__name__}:reinforce", "rl.loss_params={scal: 2.0}"])
