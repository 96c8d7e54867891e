"""Reward components against values computed by hand, their composition, and the fallback of a
component that raises."""

import math

import pytest
import torch

from conf.schema import (
    CosineLengthParams,
    FormatParams,
    OverlongParams,
    RepetitionParams,
    RewardComponentConfig,
    RewardConfig,
)
from rewards.components import (
    CosineLength,
    Format,
    Overlong,
    Repetition,
    Sample,
    overlong_penalty,
    repeated_ngram_rate,
)
from rewards.compose import Reward, as_reward
from rewards.verifier import Verdict


class EndsWith:
    """A real fake of the verifier: correct when the response ends with the gold answer."""

    def verify_batch(self, texts, golds):
        return [Verdict(t.strip().endswith(str(g)), None) for t, g in zip(texts, golds)]


def S(text="#### 7", n=10, limit=100, answer="7"):
    return Sample(text, answer, n, limit)


# --------------------------------------------------------------------------- cosine_length


def test_cosine_at_both_ends_the_middle_and_past_the_limit_with_the_papers_values():
    c = CosineLength(CosineLengthParams())  # r0c 2, rLc 1, r0w -10, rLw 0, re -10
    assert c.value(0, True, 100) == pytest.approx(2.0)
    assert c.value(50, True, 100) == pytest.approx(1.5)  # cos(pi/2) = 0: the midpoint
    assert c.value(99, True, 100) == pytest.approx(1.0 + 0.5 * (1 + math.cos(math.pi * 0.99)))
    assert c.value(0, False, 100) == pytest.approx(-10.0)
    assert c.value(50, False, 100) == pytest.approx(-5.0)
    assert c.value(25, False, 100) == pytest.approx(0.5 * -10 * (1 + math.cos(math.pi / 4)))
    assert c.value(100, True, 100) == -10.0 and c.value(150, False, 100) == -10.0  # r_e at or past L


def test_cosine_shorter_correct_scores_higher_and_longer_wrong_is_punished_less():
    c = CosineLength(CosineLengthParams())
    right = [c.value(n, True, 64) for n in range(64)]
    wrong = [c.value(n, False, 64) for n in range(64)]
    assert right == sorted(right, reverse=True) and wrong == sorted(wrong)
    assert min(right) > max(wrong)


def test_cosine_length_limit_defaults_to_the_generation_limit_and_max_len_overrides_it():
    default = CosineLength(CosineLengthParams())
    assert default.score([S(n=32, limit=64)], [True]) == [pytest.approx(1.5)]
    fixed = CosineLength(CosineLengthParams(max_len=32))
    assert fixed.score([S(n=32, limit=64)], [True]) == [-10.0]


# --------------------------------------------------------------------------- repetition


def test_repetition_on_a_known_string():
    text = "a b c a b c a b c"  # 7 word trigrams, 3 distinct: 1 - 3/7 repeated
    assert repeated_ngram_rate(text, 3) == pytest.approx(4 / 7)
    r = Repetition(RepetitionParams(ngram=3, max_penalty=-0.5))
    assert r.score([S(text=text)], [True]) == [pytest.approx(-0.5 * 4 / 7)]


def test_repetition_is_zero_for_unique_or_short_text_and_case_insensitive():
    r = Repetition(RepetitionParams())
    assert r.score([S(text="one two three four"), S(text="a b"), S(text="")], [True] * 3) == [0.0, 0.0, 0.0]
    assert repeated_ngram_rate("Go go GO go", 1) == pytest.approx(0.75)


# --------------------------------------------------------------------------- overlong


def _old_overlong_penalty(lengths, max_len, cache_len):
    """The torch form ``training.objectives.overlong_penalty`` had before it moved into the layer."""
    lengths = lengths.to(torch.float32)
    ramp = ((max_len - cache_len) - lengths) / cache_len
    return torch.where(lengths > max_len, -1.0, ramp.clamp(max=0.0))


def test_overlong_regions_and_boundaries():
    lengths = [0, 10, 16, 17, 18, 19, 20, 21, 30]  # max 20, cache 4: free up to 16, ramp, -1 beyond
    assert [overlong_penalty(n, 20, 4) for n in lengths] == [
        0.0,
        0.0,
        0.0,
        -0.25,
        -0.5,
        -0.75,
        -1.0,
        -1.0,
        -1.0,
    ]
    assert [overlong_penalty(n, 16384, 4096) for n in (12288, 14336, 16384, 16385)] == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(1, 10, 0)


@pytest.mark.parametrize("max_len,cache_len", [(64, 16), (20, 4), (16384, 4096), (50, 7)])
def test_overlong_is_identical_to_the_old_overlong_penalty(max_len, cache_len):
    lengths = list(range(0, max_len + 10))
    old = _old_overlong_penalty(torch.tensor(lengths), max_len, cache_len).tolist()
    comp = Overlong(OverlongParams(cache_len=cache_len))
    new = comp.score([S(n=n, limit=max_len) for n in lengths], [True] * len(lengths))
    assert new == pytest.approx(old, abs=1e-6)


# --------------------------------------------------------------------------- format


def test_format_scores_a_present_parseable_answer_whatever_its_correctness():
    f = Format(FormatParams())
    texts = ["so \\boxed{12}", "#### 3", "no answer", "\\boxed{}", "#### $ $", "\\boxed{\\frac{1}{2}}"]
    assert f.score([S(text=t) for t in texts], [False] * len(texts)) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


# --------------------------------------------------------------------------- composition


def _reward(*specs):
    return Reward.of(EndsWith(), RewardConfig(components=[RewardComponentConfig.of(**s) for s in specs]))


def test_total_is_the_weighted_sum_and_correct_the_verdict():
    r = _reward(
        {"name": "math_verify"},
        {"name": "cosine_length", "weight": 0.5},
        {"name": "repetition", "weight": 2.0, "ngram": 1, "max_penalty": -1.0},
    )
    samples = [S(text="x x 7", n=0, limit=10), S(text="y z 8", n=5, limit=10)]
    scores = r.score(samples)
    assert scores.correct == (True, False)
    assert scores.terms["math_verify"] == (1.0, 0.0)
    assert scores.terms["cosine_length"] == pytest.approx((2.0, -5.0))
    assert scores.terms["repetition"] == pytest.approx((-1 / 3, 0.0))
    assert scores.total == pytest.approx((1.0 + 0.5 * 2.0 + 2.0 * (-1 / 3), 0.0 + 0.5 * -5.0 + 0.0))
    assert scores.errors == {"math_verify": 0, "cosine_length": 0, "repetition": 0}
    assert scores.means()["reward/total"] == pytest.approx(sum(scores.total) / 2)


def test_the_default_reward_is_the_verifier_alone_with_the_old_rewards():
    texts = ["#### 7", "#### 8", "", "7"]
    verdicts = EndsWith().verify_batch(texts, ["7"] * 4)
    scores = Reward.of(EndsWith()).score([S(text=t) for t in texts])
    assert scores.total == tuple(v.reward for v in verdicts) == (1.0, 0.0, 0.0, 1.0)
    assert list(scores.terms) == ["math_verify"]
    assert as_reward(EndsWith()).names == ("math_verify",)


def test_a_verdict_error_counts_as_a_math_verify_error():
    class Flaky:
        def verify_batch(self, texts, golds):
            return [Verdict(False, None, "timeout") if "slow" in t else Verdict(True, "7") for t in texts]

    scores = Reward.of(Flaky()).score([S(text="slow"), S(text="#### 7")])
    assert scores.errors == {"math_verify": 1} and scores.total == (0.0, 1.0)


class Boom:
    """A shaping component that raises on one sample (text "boom") and returns NaN on another."""

    name, correctness, fallback = "format", False, -0.25

    def score(self, samples, correct):
        out = []
        for s in samples:
            if s.text == "boom":
                raise RuntimeError("cannot score")
            out.append(float("nan") if s.text == "nan" else 1.0)
        return out


def test_a_component_that_raises_on_one_sample_gives_its_fallback_and_a_counted_error():
    r = Reward(EndsWith(), {"math_verify": 1.0, "format": 1.0}, [Boom()])
    scores = r.score([S(text="#### 7"), S(text="boom"), S(text="nan"), S(text="ok 7")])
    assert scores.terms["format"] == (1.0, -0.25, -0.25, 1.0)
    assert scores.errors["format"] == 2
    assert scores.failed["format"] == (False, True, True, False)
    assert scores.total == (2.0, -0.25, -0.25, 2.0)


def test_the_overlong_component_is_added_once():
    r = _reward({"name": "math_verify"}, {"name": "overlong", "cache_len": 4})
    same = r.with_component(Overlong(OverlongParams(cache_len=8)))
    assert same is r and [c.params.cache_len for c in r.shaping] == [4]


def test_spec_names_each_component_its_weight_and_parameters():
    r = _reward({"name": "math_verify", "weight": 0.0}, {"name": "repetition", "ngram": 4})
    assert r.spec() == [
        {"name": "math_verify", "weight": 0.0, "correctness": True, "params": {}},
        {
            "name": "repetition",
            "weight": 1.0,
            "correctness": False,
            "params": {"ngram": 4, "max_penalty": -1.0},
        },
    ]


def test_a_length_term_without_a_limit_falls_back_and_counts_the_error():
    r = _reward({"name": "math_verify"}, {"name": "cosine_length"})
    scores = r.score([S(limit=0)])
    assert scores.terms["cosine_length"] == (0.0,) and scores.errors["cosine_length"] == 1


def test_ends_with_scores_the_style_the_verifier_strips():
    from conf.schema import EndsWithParams
    from rewards.components import EndsWith, Sample

    samples = [Sample("#### 7.\n", "7", 3, 8), Sample("#### 7", "7", 2, 8), Sample("#### 7!", "7", 3, 8)]
    assert EndsWith(EndsWithParams()).score(samples, [True] * 3) == [1.0, 0.0, 0.0]
    assert EndsWith(EndsWithParams(suffix="!")).score(samples, [True] * 3) == [0.0, 0.0, 1.0]
