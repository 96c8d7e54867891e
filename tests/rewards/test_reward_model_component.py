import pytest

from conf.schema import ModelConfig
from generation.model import build_char_tokenizer, build_tiny_model, save_model
from rewards.compose import Reward
from rewards.components import Sample
from rewards.reward_model import RewardModelScorer, load_sequence_classifier
from training.reward_model import train_reward_model


class _Verifier:
    def verify_batch(self, texts, golds):
        from types import SimpleNamespace

        return [
            SimpleNamespace(correct=t.split("=")[-1].rstrip(".") == g, error=None)
            for t, g in zip(texts, golds)
        ]


@pytest.fixture
def rm_dir(tmp_path):
    tok = build_char_tokenizer()
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    save_model(build_tiny_model(cfg, tok, 0), tok, tmp_path / "lm")
    rows = [{"prompt": f"{a}+1=", "chosen": f"{a + 1}.", "rejected": f"{a + 1}"} for a in range(40)]
    train_reward_model(tmp_path / "lm", rows, tmp_path / "rm", steps=40, batch_size=16, lr=3e-3)
    return tmp_path


def test_the_reward_model_mixes_with_the_verifier_normalised_and_clipped(rm_dir):
    model, tok = load_sequence_classifier(rm_dir / "rm")
    texts = [f"{a}+1={a + 1}" + ("." if a % 2 else "") for a in range(20)]
    rm = RewardModelScorer(model, tok, clip=1.5).calibrate(texts)
    reward = Reward(_Verifier(), {"math_verify": 1.0, "reward_model": 0.5}, [rm])
    s = reward.score([Sample("3+1=4.", "4", 2, 8), Sample("3+1=4", "4", 1, 8)])
    assert s.terms["math_verify"] == (1.0, 1.0)
    assert s.terms["reward_model"][0] > s.terms["reward_model"][1]
    assert all(abs(x) <= 1.5 for x in s.terms["reward_model"])
    assert s.total[0] == pytest.approx(1.0 + 0.5 * s.terms["reward_model"][0])


def test_a_causal_lm_folder_is_refused_by_the_component(rm_dir):
    with pytest.raises(ValueError, match="not a sequence-classification checkpoint"):
        load_sequence_classifier(rm_dir / "lm")


def test_the_config_component_scores_prompt_and_response_with_the_stages_statistics(rm_dir):
    import json

    from conf.schema import RewardComponentConfig, RewardConfig
    from rewards.reward_model import STATS_FILE

    stats = json.loads((rm_dir / "rm" / STATS_FILE).read_text())
    cfg = RewardConfig(
        components=[
            RewardComponentConfig.of(),
            RewardComponentConfig.of(name="reward_model", weight=0.5, clip=0.5),
        ]
    )
    reward = Reward.of(_Verifier(), cfg, str(rm_dir / "rm"), "{problem}=")
    (comp,) = reward.shaping
    samples = [Sample("4.", "4", 2, 8, prompt="3+1"), Sample("4", "4", 1, 8, prompt="3+1")]
    raw = comp.raw(samples)
    model, tok = load_sequence_classifier(rm_dir / "rm")
    assert raw == pytest.approx(
        RewardModelScorer(model, tok).raw(["3+1=4.", "3+1=4"])
    )  # the template's prompt
    s = reward.score(samples)
    expected = [max(-0.5, min(0.5, (x - stats["mean"]) / stats["std"])) for x in raw]
    assert s.terms["reward_model"] == pytest.approx(expected)
    assert s.errors["reward_model"] == 0


def test_a_component_without_a_checkpoint_describes_itself_and_refuses_to_score():
    from conf.schema import RewardComponentConfig, RewardConfig
    from rewards.reward_model import RewardModelUnavailable

    cfg = RewardConfig(
        components=[
            RewardComponentConfig.of(),
            RewardComponentConfig.of(name="reward_model", normalize="none"),
        ]
    )
    reward = Reward.of(_Verifier(), cfg)
    assert reward.spec()[1]["params"] == {"normalize": "none", "clip": None}
    with pytest.raises(RewardModelUnavailable, match="laminar run reward=reward_model"):
        reward.shaping[0].score([Sample("4", "4", 1, 8, prompt="3+1")], [True])
