import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from conf.schema import ModelConfig
from generation.model import build_char_tokenizer, build_tiny_model, save_model
from training.reward_model import (
    bradley_terry_loss,
    check_reward_model_path,
    length_baselines,
    pairwise_accuracy,
    train_reward_model,
)


@pytest.fixture
def backbone(tmp_path):
    tok = build_char_tokenizer()
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    save_model(build_tiny_model(cfg, tok, 0), tok, tmp_path / "lm")
    return tmp_path / "lm", tok


def test_bradley_terry_loss_matches_the_formula_by_hand():
    rc, rr = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    want = -(torch.log(torch.sigmoid(torch.tensor(1.0))) + torch.log(torch.sigmoid(torch.tensor(-1.0)))) / 2
    assert bradley_terry_loss(rc, rr).item() == pytest.approx(want.item())
    with_margin = -torch.log(torch.sigmoid(torch.tensor([0.5, -1.5]))).mean()
    assert bradley_terry_loss(rc, rr, torch.tensor([0.5, 0.5])).item() == pytest.approx(with_margin.item())


def test_pairwise_accuracy_and_length_baselines():
    assert pairwise_accuracy([1, 2, 3], [0, 2, 4]) == pytest.approx(0.5)
    b = length_baselines([{"chosen": "long answer", "rejected": "x"}, {"chosen": "y", "rejected": "zz"}])
    assert b == {"random": 0.5, "longer_wins": 0.5, "shorter_wins": 0.5}


def test_a_reward_model_learns_a_style_rubric_beyond_the_length_baselines(backbone, tmp_path):
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        good = f"{a + b}."  # the rubric: the answer ends with a full stop
        bad = f"{a + b}" + " " * rng.choice([0, 1])  # as long or one longer, without it
        rows.append({"prompt": f"{a}+{b}=", "chosen": good, "rejected": bad})
    m = train_reward_model(backbone[0], rows, tmp_path / "rm", steps=60, batch_size=16, lr=3e-3)
    assert m["rm_loss_last"] < m["rm_loss_first"]
    assert m["rm_heldout_accuracy"] > max(
        m["baseline_longer_wins_accuracy"], m["baseline_shorter_wins_accuracy"]
    )
    assert m["rm_heldout_accuracy"] >= 0.9
    rm = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"), use_safetensors=True)
    assert rm.config.num_labels == 1
    check_reward_model_path(tmp_path / "rm", backbone[1])


def test_a_causal_lm_folder_is_refused_as_a_reward_model(backbone):
    with pytest.raises(ValueError, match="not a sequence-classification checkpoint; pass a folder"):
        check_reward_model_path(backbone[0])


def test_a_reward_model_with_another_tokenizer_is_refused(backbone, tmp_path):
    rows = [{"prompt": "1+1=", "chosen": "2.", "rejected": "3"}] * 4
    train_reward_model(backbone[0], rows, tmp_path / "rm", steps=1, batch_size=2)
    other = build_char_tokenizer("0123456789+=")
    with pytest.raises(ValueError, match="tokenizer that differs from the policy's"):
        check_reward_model_path(tmp_path / "rm", other)
