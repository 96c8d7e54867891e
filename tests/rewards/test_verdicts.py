"""The verdict is a role: one component per run judges correctness (the pool's default or the one
marked ``verdict: true``), and every stage asks it; plug-in rewards and verdicts by import path."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from conf.loader import load_config
from conf.schema import ConfigError, RewardComponentConfig, RewardConfig
from environments.code import CodeSpec
from environments.sandbox import BubblewrapBackend
from rewards.components import Sample
from rewards.compose import Reward
from rewards.verdicts import ComponentVerdict, open_verdict
from rewards.verifier import Verdict, Verifier
from tasks.preflight import load_checked

SPEC = CodeSpec(("assert add(1, 2) == 3", "assert add(2, 2) == 4"), "add")
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return 3\n```"
CODE_POOL = ["data.source=files", "data.sources=[{name: c, path: x.jsonl, format: code}]"]

CALLS: list[str] = []


def counted(sample: Sample) -> float:
    """A plug-in verdict: the share of the text's characters that are digits, counted per call."""
    CALLS.append(sample.text)
    if sample.text == "boom":
        raise RuntimeError("the plug-in breaks on this one")
    return sum(c.isdigit() for c in sample.text) / max(1, len(sample.text))


def says(sample: Sample) -> Verdict:
    return Verdict(sample.text.endswith("!"), "said")


def two_args(sample, extra):
    return 1.0


class Suffix:
    """A class plug-in with a pydantic ``Params``: scores a batch, returns bools."""

    from pydantic import BaseModel

    class Params(BaseModel):
        suffix: str = "!"

    def __init__(self, params):
        self.suffix = params.suffix

    def score(self, samples, correct):
        return [s.text.endswith(self.suffix) for s in samples]


def bwrap():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


def test_the_pools_format_chooses_the_default_verdict():
    assert load_config([]).reward.verdict().name == "math_verify"
    cfg = load_config([*CODE_POOL, "reward=code"])
    assert cfg.reward.verdict().name == "code_tests" and cfg.reward.verdict().verdict is True
    with pytest.raises(ConfigError, match=r"lacks code_tests: it gives the correctness verdict"):
        load_config(CODE_POOL)  # the default reward (math_verify alone) cannot judge a code pool
    marked = load_config([*CODE_POOL, "reward.components=[{name: math_verify, verdict: true}]"])
    assert marked.reward.verdict().name == "math_verify"


def test_a_code_pool_is_judged_by_its_tests_not_by_the_math_verifier():
    """Fails when the math verifier judges code again: it scores a program against the JSON of its
    tests as wrong, right or not."""
    bwrap()
    cfg = load_config([*CODE_POOL, "reward=code"])
    with open_verdict(cfg.reward, 5.0) as verdict:
        assert not isinstance(verdict, Verifier)
        got = verdict.verify_batch([RIGHT, WRONG], [SPEC.to_answer()] * 2)
    assert [v.correct for v in got] == [True, False]


def test_dapo_keeps_a_code_group_its_tests_split():
    """DAPO's dynamic sampling drops a group whose verdicts agree; under the code verdict a group of a
    right and a wrong program is kept (under the math verifier both are wrong and it is dropped)."""
    bwrap()
    from training.objectives import PRESETS
    from training.rl.loop import keep_filter, score_phase

    cfg = load_config([*CODE_POOL, "reward=code"])
    prompt = SimpleNamespace(answer=SPEC.to_answer(), text="add", prompt_id="p0")
    trajs = [
        SimpleNamespace(text=t, prompt=prompt, longest_turn=lambda: 10, sample_idx=i, env_state=None)
        for i, t in enumerate([RIGHT, WRONG])
    ]
    with open_verdict(cfg.reward, 5.0) as verdict:
        (group,) = score_phase(trajs, Reward.of(verdict, cfg.reward), 64)
    assert group.correct == (True, False) and group.terms["code_tests"] == (1.0, 0.5)
    assert keep_filter(PRESETS["dapo"])(group)


def test_a_plugin_verdict_judges_by_threshold_and_a_raising_sample_falls_back_counted():
    CALLS.clear()
    spec = RewardComponentConfig.of(target=f"{__name__}:counted", verdict=True, threshold=0.5)
    reward_cfg = RewardConfig(components=[spec, RewardComponentConfig.of(name="format", weight=0.5)])
    verdict = open_verdict(reward_cfg, 5.0)
    assert isinstance(verdict, ComponentVerdict)
    samples = [Sample(t, "", 1, 8) for t in ("12a", "abc", "boom", "#### 7")]
    scores = Reward.of(verdict, reward_cfg).score(samples)
    assert scores.correct == (True, False, False, False)
    assert scores.terms["counted"] == (2 / 3, 0.0, 0.0, 1 / 6)
    assert scores.errors["counted"] == 1 and scores.means()["reward_errors/counted"] == 1.0
    assert scores.verdicts[2].error and "RuntimeError" in scores.verdicts[2].error
    assert "boom" in CALLS and verdict.calls == 4
    assert Reward.of(verdict, reward_cfg).spec()[0] == {
        "name": "counted",
        "weight": 1.0,
        "correctness": True,
        "params": {},
        "target": f"{__name__}:counted",
        "threshold": 0.5,
    }


def test_a_verdict_may_return_its_own_verdict():
    verdict = open_verdict(
        RewardConfig(components=[RewardComponentConfig.of(name=f"{__name__}:says", verdict=True)]), 5.0
    )
    got = verdict.verify_batch(["yes!", "no"], ["", ""])
    assert [(v.correct, v.pred) for v in got] == [(True, "said"), (False, "said")]


def test_a_class_plugin_with_pydantic_params_judges_and_scores():
    spec = RewardComponentConfig.of(target=f"{__name__}:Suffix", verdict=True, params={"suffix": "?"})
    other = RewardComponentConfig.of(name="exclaims", target=f"{__name__}:Suffix", weight=0.5)
    cfg = RewardConfig(components=[spec, other])
    scores = Reward.of(open_verdict(cfg, 5.0), cfg).score([Sample("why?", "", 1, 8), Sample("no!", "", 1, 8)])
    assert scores.correct == (True, False) and scores.terms["exclaims"] == (0.0, 1.0)
    assert scores.total == (1.0, 0.5)


@pytest.mark.parametrize(
    "components, message",
    [
        (
            f"[{{target: '{__name__}:counted', verdict: true}}, {{name: math_verify, verdict: true}}]",
            r"marks \['counted', 'math_verify'\] as verdict: one component judges correctness",
        ),
        (
            "[{target: 'no_such_pkg.rewards:judge', verdict: true}]",
            r"reward.components\[0\]: plug-in 'no_such_pkg.rewards:judge' cannot be imported",
        ),
        (
            f"[{{target: '{__name__}:two_args', verdict: true}}]",
            r"plug-in '.*:two_args' has the wrong signature \(sample, extra\)",
        ),
        (
            f"[{{target: '{__name__}:counted', verdict: true, params: {{x: 1}}}}]",
            r"declares no Params, yet params \['x'\] were given",
        ),
        ("[{target: 'not a path', verdict: true}]", r"target='not a path' is not supported"),
    ],
)
def test_bad_verdicts_fail_before_any_write_in_one_line(components, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_checked([f"reward.components={components}"])
    assert "\n" not in str(err.value)


def test_a_file_benchmark_names_its_verdict_by_target():
    from tasks.stages.evaluate import open_judges
    from contextlib import ExitStack

    bench = f"{{name: mine, path: {__file__}, verdict: '{__name__}:says'}}"
    cfg = load_config([f"eval.benchmarks=[arith_heldout,{bench}]"])
    with ExitStack() as stack:
        judges = open_judges(cfg, stack)
    assert set(judges) == {"mine"}  # the held-out set keeps the math verifier, as the run's verdict
    assert judges["mine"].verify_batch(["ok!"], ["x"])[0].pred == "said"
    assert sys.modules[__name__].says is judges["mine"].component.fn
