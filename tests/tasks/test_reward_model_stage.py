"""``reward=reward_model``: the option composes, the preferences and reward_model stages run only under
it (the default run's stages and keys stay as they were), RL reads the reward model (the lineage edge),
summary.json names its accuracy, and bad reward-model folders are refused before any write."""

from __future__ import annotations

import pytest

from conf.loader import load_config
from conf.schema import ConfigError, ModelConfig
from core.artifacts import ArtifactRef
from generation.model import build_char_tokenizer, build_tiny_model, save_model
from tasks.dag import STAGE_BY_NAME, STAGES, Selection, stage_inputs
from tasks.stages.common import reward_key
from tasks.stages.data import data_key
from tasks.preflight import preflight
from training.reward_model import train_reward_model

DEFAULT_STAGES = [
    "data", "ingest", "decontaminate", "base_model", "warmup", "eval_warmup", "difficulty", "dart", "rft",
    "eval_rft", "difficulty_rft", "select", "rl", "eval_rl",
]  # fmt: skip


def _ref(name: str) -> ArtifactRef:
    return ArtifactRef(kind="model", sha256=name * 8, path=f"/store/{name}")


def test_the_option_composes_the_verifier_and_the_reward_model():
    cfg = load_config(["reward=reward_model"])
    rm = cfg.reward.components[1]
    assert [(c.name, c.weight) for c in cfg.reward.components] == [
        ("math_verify", 1.0),
        ("reward_model", 0.5),
    ]
    assert (rm.params_of().normalize, rm.params_of().clip) == ("fixed", 2.0)
    assert cfg.data.demo_full_stop_rate == 0.5
    assert reward_key(cfg)[1] == {
        "name": "reward_model",
        "weight": 0.5,
        "correctness": False,
        "params": {"normalize": "fixed", "clip": 2.0},
    }


def test_the_reward_model_stages_run_only_under_the_option():
    default, rm = load_config([]), load_config(["reward=reward_model"])
    assert [s.name for s in Selection(None, []).stages_to_run(default)] == DEFAULT_STAGES
    assert [s.name for s in Selection(None, []).stages_to_run(rm)] == [
        *DEFAULT_STAGES[:5], "preferences", "reward_model", *DEFAULT_STAGES[5:],
    ]  # fmt: skip
    assert "demo_full_stop_rate" not in data_key(default)  # the default data key is as it was
    assert data_key(rm)["demo_full_stop_rate"] == 0.5


def test_rl_reads_the_reward_model_only_under_the_option():
    rl = STAGE_BY_NAME["rl"]
    produced = {
        "rft": {"model": _ref("a")},
        "select": {"selection": _ref("b")},
        "data": {"dataset": _ref("c")},
    }
    default, rm = load_config([]), load_config(["reward=reward_model"])
    assert set(stage_inputs(rl, produced, default)) == {"model", "selection", "dataset"}
    assert stage_inputs(rl, produced, rm) is None  # the reward model must be made first
    produced["reward_model"] = {"model": _ref("d")}
    inputs = stage_inputs(rl, produced, rm)
    assert inputs["reward_model"].sha256 == "d" * 8  # the edge lineage walks from the RL checkpoint
    assert rl.key(default, stage_inputs(rl, produced, default)) != rl.key(rm, inputs)
    assert rl.key(default, stage_inputs(rl, produced, default)) == rl.key(
        default, {k: v for k, v in inputs.items() if k != "reward_model"}
    )


def test_every_stage_that_reads_a_gated_stage_is_listed_after_it():
    order = [s.name for s in STAGES]
    for stage in STAGES:
        for src, _ in stage.inputs.values():
            assert order.index(src) < order.index(stage.name)


def test_summary_names_the_reward_model_and_its_accuracy():
    from tasks.summary import build_summary
    from tasks.records import StageOutcome, StageResult
    from tasks.cache import CacheKey

    m = {
        "rm_heldout_accuracy": 0.8,
        "baseline_random_accuracy": 0.5,
        "baseline_longer_wins_accuracy": 0.6,
        "baseline_shorter_wins_accuracy": 0.4,
        "baseline_policy_logprob_accuracy": 0.55,
        "agreement_ceiling": 0.85,
    }
    key = CacheKey("reward_model", "c", "i", "s", 0)
    out = StageOutcome("reward_model", "ran", 1.0, key, StageResult({"model": _ref("d")}, m), None)
    summary = build_summary("r", [out], 1.0)
    assert summary.metrics["reward_model_heldout_accuracy"] == 0.8
    assert summary.metrics["reward_model_agreement_ceiling"] == 0.85
    assert "reward_model_heldout_accuracy" not in build_summary("r", [], 1.0).metrics


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A causal LM, a reward model with the policy's tokenizer and one with another tokenizer."""
    root = tmp_path_factory.mktemp("rm_folders")
    cfg = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    rows = [{"prompt": "1+1=", "chosen": "2.", "rejected": "2"}] * 2
    for name, tok in (("policy", build_char_tokenizer()), ("other", build_char_tokenizer("0123456789+=."))):
        save_model(build_tiny_model(cfg, tok, 0), tok, root / f"lm_{name}")
        train_reward_model(root / f"lm_{name}", rows, root / f"rm_{name}", steps=0)
    return root


def test_a_reward_model_path_is_used_when_it_fits(folders):
    preflight(load_config(["reward=reward_model", f"reward_model.path={folders / 'rm_policy'}"]))


@pytest.mark.parametrize(
    "override,message",
    [
        ("reward_model.path={}/lm_policy", r"reward_model.path=.*not a sequence-classification checkpoint"),
        ("reward_model.path={}/rm_other", r"reward_model.path=.*tokenizer that differs from the policy's"),
        ("reward_model.path={}/missing", r"reward_model.path=.*has no config.json"),
        ("reward_model.backbone={}/lm_other", r"reward_model.backbone=.*tokenizer that differs"),
    ],
)
def test_a_bad_reward_model_folder_is_refused_before_any_write(folders, tmp_path, override, message):
    cfg = load_config(["reward=reward_model", override.format(folders)])
    with pytest.raises(ConfigError, match=message):
        preflight(cfg)


def test_a_reward_model_folder_is_not_checked_when_no_component_uses_it(folders):
    preflight(load_config([f"reward_model.path={folders / 'lm_policy'}"]))


def test_no_held_out_share_is_refused_at_compose_time():
    with pytest.raises(ConfigError, match="reward_model.heldout_share=0"):
        load_config(["reward=reward_model", "reward_model.heldout_share=0"])


def test_dart_reads_the_reward_model_only_when_it_ranks():
    from tasks.dag import downstream_of
    from tasks.stages.dart import dart_headline, dart_key

    dart = STAGE_BY_NAME["dart"]
    produced = {
        "warmup": {"model": _ref("a")},
        "decontaminate": {"prompts": _ref("b")},
        "difficulty": {"attempts": _ref("c")},
        "reward_model": {"model": _ref("d")},
    }
    default, rm = load_config([]), load_config(["reward=reward_model"])
    ranks = load_config(["reward=reward_model", "curation.dart.select=reward_model"])
    assert "select" not in dart_key(default) and "reward_model" not in dart_key(default)  # key as it was
    assert dart_key(rm) == dart_key(default)  # verifier selection: the reward model is not read
    assert set(stage_inputs(dart, produced, rm)) == {"model", "prompts", "attempts"}
    assert "dart" not in downstream_of(["reward_model"], rm)
    inputs = stage_inputs(dart, produced, ranks)
    assert inputs["reward_model"].sha256 == "d" * 8  # the edge lineage walks from the RFT checkpoint
    assert dart_key(ranks)["select"] == "reward_model"
    assert dart_key(ranks)["reward_model"] == {"normalize": "fixed", "clip": 2.0}
    assert {"dart", "rft", "rl"} <= downstream_of(["reward_model"], ranks)
    m = {"trials": 40, "rft_examples": 10, "rm_kept_verified": 0.3}
    assert dart_headline(m) == "40 trials  10 responses ranked top by the reward model (30% of them verified)"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["curation.dart.select=reward_model"],
            r"curation.dart.select=reward_model .* add reward=reward_model",
        ),
        (["reward=reward_model", "curation.dart.select=rm"], r"curation.dart.select"),
    ],
)
def test_dart_ranking_without_a_reward_model_or_a_misspelt_selector_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)
