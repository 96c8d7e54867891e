"""The calculator tool (an AST walker, never eval), the text call format on the tiny character
tokenizer, and the env config section."""

import pytest

from conf.loader import load_config
from conf.schema import ConfigError
from environments.base import ToolError, Turn
from environments.calculator import Calculator, evaluate
from environments.registry import make_environment
from generation.model import build_char_tokenizer


@pytest.mark.parametrize(
    "expr, value", [("3+4-2", "5"), ("12*(7-5)", "24"), ("-3+10", "7"), ("7/2", "7/2"), ("8/4", "2")]
)
def test_the_calculator_evaluates_integer_arithmetic_exactly(expr, value):
    assert Calculator()(expr) == value


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "2**10", "1.5+1", "x+1", "1/0", "", "9" * 30 + "*" + "9" * 30, "1+"],
)
def test_the_calculator_refuses_anything_but_integer_arithmetic(expr):
    with pytest.raises(ToolError):
        evaluate(expr)


def test_the_text_format_calls_the_tool_and_appends_its_result_as_tokens():
    tok = build_char_tokenizer()
    cfg = load_config(["env=calculator"]).env
    env = make_environment(cfg, tok)
    assert env.format.name == "text"  # no chat template: the documented line format
    res = env.step(None, Turn("3+4+5+6+7\ncalc: 3+4+5+6+7", ()))
    assert res.tool_call and not res.done and not res.tool_error
    assert tok.decode(list(res.observation)) == "\n= 25\n"
    bad = env.step(None, Turn("calc: 3+x", ()))
    assert bad.tool_error and tok.decode(list(bad.observation)).startswith("\n= error: ")
    answer = env.step(None, Turn("calc: 1+2 gives 3\n#### 3", ()))
    assert answer.done and answer.reason == "answer"


def test_env_config_composes_and_typos_fail_before_any_write():
    assert load_config([]).env.target == "single_turn"
    cfg = load_config(["env=calculator"]).env
    assert cfg.target == "calculator" and cfg.max_turns >= 2
    with pytest.raises(ConfigError, match="env.max_turn"):
        load_config(["env.max_turn=3"])
    with pytest.raises(ConfigError, match="env.on_error"):
        load_config(["env=calculator", "env.on_error=ignore"])
    with pytest.raises(ConfigError, match="single_turn"):
        load_config(["env.max_turns=2"])


def test_calculator_recipe_keeps_rft_and_hive_now_that_curation_samples_episodes():
    """conf/env/calculator.yaml: curation samples whole episodes under ``env`` and RFT trains on them
    with their loss masks (tests/data_curation/test_episode_curation.py), so the tool recipe keeps
    the default RFT and HIVE instead of passing RFT through and selecting uniformly."""
    tool, default = load_config(["env=calculator"]), load_config([])
    assert (tool.curation.rft.steps, tool.curation.select.strategy) == (30, "hive")
    assert tool.curation == default.curation
    assert load_config(["env=calculator", "curation.rft.steps=0"]).curation.rft.steps == 0


def test_warm_up_demonstrations_use_the_tool_with_the_observation_masked():
    import torch

    from training.sft import SFTExample, collate, pack
    from training.warmup import tool_demonstrations

    tok = build_char_tokenizer()
    env = load_config(["env=calculator"]).env
    rows = [{"prompt_id": f"p{i}", "problem": f"What is {i}+9-3+1?", "answer": str(i + 7)} for i in range(40)]
    plain = [SFTExample((1, 2), (3, tok.eos_token_id)) for _ in rows]
    out = tool_demonstrations(plain, rows, env, tok)
    tools = [(ex, r) for ex, r in zip(out, rows) if ex.loss_mask]
    assert 10 < len(tools) < 30  # about env.demo_tool_share of them
    ex, r = tools[0]
    text = tok.decode(list(ex.response_tokens), skip_special_tokens=True)
    assert text == f"calc: {r['problem'][8:-1]}\n= {r['answer']}\n#### {r['answer']}"
    assert ex.response_tokens.count(tok.eos_token_id) == 2 and ex.response_tokens[-1] == tok.eos_token_id
    masked = [t for t, m in zip(ex.response_tokens, ex.loss_mask) if m == 0]
    assert tok.decode(masked) == f"\n= {r['answer']}\n"
    for _ids, labels in (collate([ex], 0)[::2], pack([ex], 0)[::2]):
        n = len(ex.prompt_tokens)
        got = labels[0, n : n + len(ex.response_tokens)]
        assert (got == -100).sum() == len(masked) and torch.equal(
            got[got != -100], torch.tensor([t for t, m in zip(ex.response_tokens, ex.loss_mask) if m])
        )
