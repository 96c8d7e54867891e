"""The ``code_tests`` reward component: the response's program against the gold answer's unit tests
in the sandbox, built through the reward layer's registry; and the Python tool."""

from __future__ import annotations

import pytest

from conf.loader import load_config
from conf.schema import (
    CodeTestsParams,
    ConfigError,
    RewardComponentConfig,
    SandboxConfig,
    SandboxLimits,
)
from environments.code import CodeSpec, CodeTests, extract_program
from environments.sandbox import BubblewrapBackend
from environments.tools import PythonTool, python_tool
from rewards.components import Sample
from rewards.compose import Reward, build_component
from rewards.verifier import Verdict

SPEC = CodeSpec(("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"), "add")
RIGHT = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"


@pytest.fixture(autouse=True)
def bwrap_or_skip():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


def sample(text: str, spec: CodeSpec = SPEC) -> Sample:
    return Sample(text, spec.to_answer(), 10, 64)


def test_the_last_code_block_is_the_program():
    assert extract_program("a\n```py\nx = 1\n```\nb\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_program("```\nz = 3\n") == "z = 3\n"  # unclosed: to the end
    assert extract_program("    return a + b\n```\nmore", completion=True) == "    return a + b\n"
    assert extract_program("```python\nx = 5\n```", completion=True) == "x = 5\n"
    assert extract_program("x = 4") == "x = 4"


def test_pass_fraction_and_all_pass_score_the_same_run():
    texts = [RIGHT, "```python\ndef add(a, b):\n    return 3\n```", "no program"]
    fraction = CodeTests(CodeTestsParams()).score([sample(t) for t in texts], [False] * 3)
    assert fraction == [2 / 3, 1 / 3, 0.0]
    all_pass = CodeTests(CodeTestsParams(score="all_pass"))
    spec = CodeSpec(SPEC.tests[:2], "add")
    assert all_pass.score([sample(RIGHT, spec), sample(texts[1], spec)], [False] * 2) == [1.0, 0.0]


@pytest.mark.parametrize(
    "cheat",
    [
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "print('deadbeef 3 3')\nraise SystemExit",
        "def add(a, b):\n    raise SystemExit(0)",
        "while True:\n    pass",
    ],
)
def test_a_program_that_ends_early_or_fakes_the_report_scores_zero(cheat):
    assert CodeTests(CodeTestsParams(timeout_s=3)).score([sample(cheat)], [False]) == [0.0]


def test_humaneval_style_tests_with_a_prefix_run_a_completion():
    spec = CodeSpec(
        ("def check(f):\n    assert f(2) == 4\ncheck(double)",), "double", 'def double(x):\n    """2x"""\n'
    )
    assert CodeTests(CodeTestsParams()).score([sample("    return 2 * x\n```", spec)], [False]) == [1.0]


class Nothing:
    def verify_batch(self, texts, golds):
        return [Verdict(False, None) for _ in texts]


def test_the_reward_layer_builds_code_tests_from_config_and_falls_back_on_a_bad_answer():
    items = "{name: math_verify, weight: 0}, {name: code_tests, score: all_pass, timeout_s: 5}"
    cfg = load_config([f"reward.components=[{items}]"])
    assert cfg.reward.components[1].params_of() == CodeTestsParams(score="all_pass", timeout_s=5.0)
    reward = Reward.of(Nothing(), cfg.reward)
    scores = reward.score([sample(RIGHT, CodeSpec(SPEC.tests[:2], "add")), Sample(RIGHT, "42", 10, 64)])
    assert scores.terms["code_tests"] == (1.0, 0.0) and scores.failed["code_tests"] == (False, True)
    assert reward.spec()[1]["params"] == {"score": "all_pass", "timeout_s": 5.0}
    assert isinstance(build_component(RewardComponentConfig.of(name="code_tests")), CodeTests)
    with pytest.raises(ConfigError, match="score"):
        load_config(["reward.components=[{name: math_verify}, {name: code_tests, score: most}]"])
    with pytest.raises(ConfigError, match="not a parameter of code_tests"):
        load_config(["reward.components=[{name: math_verify}, {name: code_tests, ngram: 3}]"])


def test_the_python_tool_returns_output_and_says_how_a_run_failed():
    assert python_tool.name == "python" and "Python" in python_tool.description
    assert python_tool("print(2 ** 10)") == "1024\n"
    assert python_tool('{"code": "print(sum(range(5)))"}') == "10\n"
    failed = python_tool("print('a')\n1 / 0")
    assert failed.startswith("a\n[exit status 1]") and "ZeroDivisionError" in failed
    quick = SandboxConfig(limits=SandboxLimits(cpu_s=1))
    assert "[killed by the CPU time limit]" in PythonTool(quick)("while True:\n    pass")
    long = PythonTool(max_chars=100)("print('x' * 5000)")
    assert len(long) < 130 and "[cut]" in long
    assert python_tool("pass") == "[no output]\n"
