"""``reward.components``: options of the ``reward`` group, CLI lists, and bad input failing at load
with a message naming the key."""

import pytest

from conf.loader import load_config
from conf.schema import ConfigError, CosineLengthParams, RepetitionParams


def test_the_default_is_the_verifier_alone():
    cfg = load_config([])
    assert [(s.name, s.weight) for s in cfg.reward.components] == [("math_verify", 1.0)]


def test_long_cot_is_one_switch_and_its_parameters_are_the_papers():
    cfg = load_config(["reward=long_cot"])
    names = [(s.name, s.weight) for s in cfg.reward.components]
    assert names == [("math_verify", 0.0), ("cosine_length", 1.0), ("repetition", 1.0)]
    assert cfg.reward.components[1].params_of() == CosineLengthParams(
        r0_correct=2.0, rl_correct=1.0, r0_wrong=-10.0, rl_wrong=0.0, r_exceed=-10.0, max_len=None
    )


def test_components_come_from_the_cli_with_parameters():
    cfg = load_config(["reward.components=[{name: math_verify}, {name: repetition, weight: 0.5, ngram: 3}]"])
    rep = cfg.reward.components[1]
    assert rep.weight == 0.5 and rep.params_of() == RepetitionParams(ngram=3, max_penalty=-1.0)
    cfg = load_config(["reward=long_cot", "reward.components.1.max_len=32"])
    assert cfg.reward.components[1].params_of().max_len == 32


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "[{name: math_verify}, {name: cosine}]",
            r"reward.components\[1\].name='cosine' is not a reward component \(did you mean 'cosine_length",
        ),
        (
            "[{name: math_verify}, {name: cosine_length, max_len: -4}]",
            r"reward.components\[1\].max_len=-4 must be > 0",
        ),
        ("[{name: math_verify, weight: nan}]", r"reward.components\[0\].weight=nan is not a finite number"),
        (
            "[{name: math_verify}, {name: repetition, ngram: 0}]",
            r"reward.components\[1\].ngram=0 must be > 0",
        ),
        ("[{name: math_verify}, {name: repetition, max_penalty: 1}]", r"max_penalty=1.0 must be <= 0"),
        (
            "[{name: math_verify}, {name: repetition, cache_len: 4}]",
            r"cache_len is not a parameter of repetition",
        ),
        ("[{name: repetition}]", r"lacks math_verify"),
        (
            "[{name: math_verify}, {name: repetition, ngrams: 2}]",
            r"reward.components\[1\].ngrams is not a parameter of repetition "
            r"\(did you mean 'reward.components\[1\].ngram'\?\)",
        ),
        ("[{name: math_verify}, {name: format}, {name: format}]", r"names a component twice"),
        (
            "[{name: math_verify}, {name: overlong, cache_len: 64}]",
            r"cache_len=64 must be below the length limit 64",
        ),
    ],
)
def test_bad_components_fail_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([f"reward.components={override}"])


def test_the_old_overlong_key_beside_an_overlong_component_names_the_new_one():
    with pytest.raises(ConfigError, match="drop rl.overlong_shaping and set cache_len"):
        load_config(["rl.overlong_shaping=true", "reward.components=[{name: math_verify}, {name: overlong}]"])
    assert load_config(["rl.overlong_shaping=true"]).rl.overlong_shaping is True  # alone it still works
