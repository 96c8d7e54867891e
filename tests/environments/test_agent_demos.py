"""Warm-up demonstrations for an agent environment (``env.target=...:solve``): the agent's own episode
with scripted policy turns, token for token what the endpoint records when the policy makes those
turns, in the format the endpoint renders and parses for the agent's ``tools=`` requests; a tiny
model warmed up on them makes calls the endpoint hands to the ``openai`` client as ``tool_calls``."""

from __future__ import annotations

import pytest

from conf.loader import load_config
from conf.schema import EngineOptions, EnvConfig, ModelConfig
from environments.agents.chat import ChatFormat
from environments.registry import make_environment, wrap_engine
from environments.tool_use import ToolCall
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model, encode_problem
from generation.records import GenRequest, PromptItem
from tests.environments import agent_fixtures as fx
from tests.environments.bpe import CHAT_TEMPLATE, bpe_tokenizer
from tests.environments.test_agents import _consumed_matches, _training_row
from training.sft import SFTExample, train_sft
from training.warmup import tool_demonstrations

EXAMPLE = "examples.agents.react_calc:solve"
# a Qwen2.5-style template: an assistant message's tool_calls rendered as <tool_call> blocks
QWEN_LIKE = CHAT_TEMPLATE.replace(
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n",
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n",
)
ROWS = [
    {"prompt_id": f"p{i}", "problem": f"What is {i}+{i + 2}-1?", "answer": str(2 * i + 1), "level": 1}
    for i in range(1, 7)
]


def _env(target=EXAMPLE, **kw) -> EnvConfig:
    return EnvConfig(target=target, max_turns=4, tool_timeout_s=20.0, demo_tool_share=1.0, **kw)


class Replay(fx.Scripted):
    """``fx.Scripted`` whose turns are token sequences (a demonstration's turns, replayed)."""

    def turn(self, i: int) -> tuple[tuple[int, ...], str]:
        toks = self.script[i]
        return toks, self.tokenizer.decode(list(toks), skip_special_tokens=True)


def _bpe(template: str):
    tok = bpe_tokenizer()
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [QWEN_LIKE, CHAT_TEMPLATE], ids=["renders_tool_calls", "content_only"])
def test_a_demonstration_is_the_episode_the_endpoint_records_for_those_turns(template):
    tok = _bpe(template)
    cfg = _env()
    item = PromptItem("q0", "What is 3+4*2?", "11", tuple(tok("What is 3+4*2?")["input_ids"]))
    env = make_environment(cfg, tok)
    try:
        prompt, tokens, mask = env.demonstrate(item, ToolCall("calc", "3+4*2"), "#### 11")
        assert env.hub.live() == 0
    finally:
        env.close()
    turns, cut = [], 0
    for i in range(1, len(mask) + 1):  # the policy's turns: the runs of mask 1
        if i == len(mask) or mask[i] != mask[i - 1]:
            if mask[i - 1]:
                turns.append(tokens[cut:i])
            cut = i
    assert len(turns) == 2 and all(t[-1] == tok.eos_token_id for t in turns)
    text = tok.decode(list(turns[0]), skip_special_tokens=True)
    assert "<tool_call>" in text and '"3+4*2"' in text
    _, calls = ChatFormat(tok).parse(text, [{"type": "function", "function": {"name": "calc"}}])
    assert [c["name"] for c in calls] == ["calc"]
    # the endpoint, the agent answered by exactly these turns: the same prompt, tokens and mask
    engine = Replay(tok, turns)
    runner = wrap_engine(engine, cfg, tok)
    try:
        (t,) = runner.generate([GenRequest(item, 0, 0)])
    finally:
        runner.close()
    assert t.end_reason == "answer" and t.tool_calls == 1 and t.env_state["mismatches"] == 0
    assert t.env_state["result"] == {"answer": "#### 11", "tool_calls": 1}
    assert (t.prompt.prompt_tokens, t.response_tokens, t.loss_mask) == (prompt, tokens, mask)
    assert _consumed_matches(_training_row(t, tok), t, engine)
    assert "<tool_response>\n11\n</tool_response>" in tok.decode(list(tokens))  # the agent's own tool ran


def test_the_tiny_tokenizer_demonstration_is_the_calculators_and_an_agent_without_the_tool_has_none():
    tok = build_char_tokenizer()
    plain = [SFTExample(encode_problem(tok, "{problem}\n", r["problem"]), (tok.eos_token_id,)) for r in ROWS]
    agent = tool_demonstrations(plain, ROWS, _env(), tok)
    calculator = tool_demonstrations(plain, ROWS, _env("calculator"), tok)
    assert all(0 in ex.loss_mask for ex in agent)
    assert agent == calculator  # the line format: the in-process calculator's episode, token for token
    # an agent that offers no calc tool (and one that fails) leaves the examples as they are
    for target in (f"{fx.__name__}:raises", f"{__name__}:asks_without_tools"):
        assert tool_demonstrations(plain, ROWS, _env(target), tok) == plain
    none = load_config([f"env.target={EXAMPLE}", "env.max_turns=4", "env.demo_tool_share=0.0"]).env
    assert tool_demonstrations(plain, ROWS, none, tok) == plain


async def asks_without_tools(client, task):
    """Asks without ``tools=``: there is no tool to demonstrate."""
    r = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": task["prompt"]}]
    )
    return {"answer": r.choices[0].message.content or ""}


@pytest.mark.slow
def test_after_a_short_warm_up_the_tiny_models_agent_episodes_call_the_tool_through_the_client():
    """The tiny model warmed up (SFT) on the example agent's demonstrations, then sampled through the
    endpoint: its turns parse into tool calls, which the agent gets as ``message.tool_calls`` from the
    ``openai`` client (the count the agent returns), runs, and answers after."""
    tok = build_char_tokenizer()
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=64
    )
    model = build_tiny_model(cfg, tok, 0)
    plain = [SFTExample(encode_problem(tok, "{problem}\n", r["problem"]), (tok.eos_token_id,)) for r in ROWS]
    demos = tool_demonstrations(plain, ROWS, _env(), tok)
    m = train_sft(
        model, demos, steps=60, batch_size=6, lr=3e-2, warmup_steps=5, weight_decay=0.0,
        max_grad_norm=1.0, pad_id=tok.pad_token_id, seed=0,
    )  # fmt: skip
    assert m["sft_loss_ema"] < 0.3
    engine = Engine(model.eval(), tok, EngineOptions(max_new_tokens=24, capacity=8, seed=0, temperature=0.3))
    runner = wrap_engine(engine, _env(), tok)
    reqs = [GenRequest(PromptItem(r["prompt_id"], r["problem"], r["answer"], ex.prompt_tokens), 0, i)
            for i, (r, ex) in enumerate(zip(ROWS, plain))]  # fmt: skip
    try:
        trajs = runner.generate(reqs)
    finally:
        runner.close()
    returned = [t.env_state.get("result", {}).get("tool_calls", 0) for t in trajs]
    assert sum(c > 0 for c in returned) >= len(trajs) // 2, [t.env_state for t in trajs]
    assert all(t.tool_calls == c for t, c in zip(trajs, returned))  # the endpoint's count is the client's
    assert all(t.env_state["mismatches"] == 0 for t in trajs)
