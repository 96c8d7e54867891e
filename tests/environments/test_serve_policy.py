"""``laminar serve-policy``: the agent endpoint over a checkpoint, outside training. The real ``openai``
client sends per-request ``temperature``, ``top_p``, ``max_tokens``, ``stop`` and ``n`` on
``/v1/chat/completions`` and ``/v1/completions``, and each is applied (checked against the model
itself: greedy decoding, the log-probs of the distribution sampled from, the length cap, the stop
string cut, n independent choices)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from environments.agents.serve import PolicyServer, _sampling_logprobs
from tests.environments import agent_fixtures as fx
from tests.environments.bpe import bpe_tokenizer, random_qwen2

ROOT = Path(__file__).resolve().parents[2]
MSGS = [{"role": "user", "content": "What is 4 * 5?"}]


@pytest.fixture(scope="module")
def server():
    tok = bpe_tokenizer()
    model = random_qwen2(tok, eos_scale=0.0)  # no EOS: turns run to their cap
    with torch.no_grad():  # nor blank tokens: the greedy text is " 16 16 ..." (it would be newlines)
        model.get_input_embeddings().weight[[i for i in range(len(tok)) if not tok.decode([i]).strip()]] = 0
    srv = PolicyServer(model, tok, max_tokens=12, seed=1)
    yield srv
    srv.close()


def _client(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.base_url, api_key=srv.token, max_retries=0)


def _greedy(srv, ids, k):
    out = []
    with torch.no_grad():
        for _ in range(k):
            nxt = int(torch.argmax(srv.model(torch.tensor([ids + out])).logits[0, -1]))
            out.append(nxt)
    return out


def test_each_sampling_parameter_is_applied_per_request(server):
    tok = server.tokenizer
    ids = list(server.format.first([{"role": "user", "content": MSGS[0]["content"]}], []))
    greedy = _greedy(server, ids, 12)

    async def go():
        c = _client(server)
        # temperature 0: greedy; n=3 choices, each the same greedy text; log-probs 0 (a point mass)
        r = await c.chat.completions.create(model="m", messages=MSGS, temperature=0, n=3, logprobs=True)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        texts = {ch.message.content for ch in r.choices}
        assert texts == {tok.decode(greedy, skip_special_tokens=True).strip()}
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3 * 12
        assert all(x.logprob == 0.0 for x in r.choices[0].logprobs.content)
        # max_tokens: the cap of each choice
        r = await c.chat.completions.create(model="m", messages=MSGS, max_tokens=3, n=2)
        assert r.usage.completion_tokens == 6 and {ch.finish_reason for ch in r.choices} == {"length"}
        # top_p tiny: the nucleus is the one most likely token, so sampling at temperature 1 is greedy
        r = await c.chat.completions.create(model="m", messages=MSGS, top_p=1e-9, max_tokens=5, logprobs=True)
        assert [x.token for x in r.choices[0].logprobs.content] == [tok.decode([t]) for t in greedy[:5]]
        # temperature 0.5: the log-probs are the tempered distribution's, checked against the model (on a
        # reply whose token texts name their ids: byte tokens that decode to U+FFFD alone do not)
        ids_of: dict[str, list[int]] = {}
        for i in range(len(tok)):
            ids_of.setdefault(tok.decode([i]), []).append(i)
        for _ in range(40):
            r = await c.chat.completions.create(
                model="m", messages=MSGS, temperature=0.5, max_tokens=3, logprobs=True
            )
            content = r.choices[0].logprobs.content
            if all(len(ids_of[x.token]) == 1 for x in content):
                break
        toks = [ids_of[x.token][0] for x in content]
        with torch.no_grad():
            logits = server.model(torch.tensor([ids + toks])).logits[0, len(ids) - 1 : -1]
        want = [float(torch.log_softmax(logits[i] / 0.5, -1)[t]) for i, t in enumerate(toks)]
        assert [x.logprob for x in content] == pytest.approx(want, abs=1e-4)
        # sampled choices differ (n independent samples at temperature 2)
        r = await c.chat.completions.create(model="m", messages=MSGS, temperature=2.0, n=4)
        assert len({ch.message.content for ch in r.choices}) > 1
        # stop: decoding ends at the stop string, which is cut from the text
        assert tok.decode(greedy[:3], skip_special_tokens=True) == " 16 16 16"
        r = await c.chat.completions.create(model="m", messages=MSGS, temperature=0, stop=["6 1"])
        ch = r.choices[0]
        assert (ch.finish_reason, ch.message.content, r.usage.completion_tokens) == ("stop", "1", 2)
        # /v1/completions: n choices, max_tokens, temperature 0
        r = await c.completions.create(model="m", prompt="What is", n=2, max_tokens=4, temperature=0)
        assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
        assert r.usage.completion_tokens == 8
        # still refused: what the endpoint does not implement, a bad value, no token
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="m", messages=MSGS, n=17)
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model="m", messages=MSGS, top_p=1.5)
        bad = openai.AsyncOpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="m", messages=MSGS)
        await c.close(), await bad.close()

    asyncio.run(go())


def test_a_streamed_request_with_tools_and_n_choices(server):
    async def go():
        c = _client(server)
        chunks = await c.chat.completions.create(
            model="m", messages=MSGS, tools=[fx.CALC], n=2, max_tokens=4, stream=True, temperature=0
        )
        by_choice: dict[int, str] = {}
        async for ch in chunks:
            for x in ch.choices:
                by_choice[x.index] = by_choice.get(x.index, "") + (x.delta.content or "")
        assert set(by_choice) == {0, 1} and by_choice[0] == by_choice[1]
        await c.close()

    asyncio.run(go())


def test_the_nucleus_keeps_the_most_likely_tokens_up_to_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    lp = _sampling_logprobs(logits, 1.0, 0.7)  # 0.5 then 0.8 >= 0.7: the first two
    assert torch.isinf(lp[2:]).all() and lp[:2].exp().tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8])
    assert _sampling_logprobs(logits, 1.0, 1.0).exp().tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])


def test_the_cli_serves_a_checkpoint_folder(tmp_path):
    """``laminar serve-policy FOLDER --seconds S``: prints the base URL and the token, answers a real
    client, and stops after S seconds."""
    from generation.model import save_model

    tok = bpe_tokenizer()
    folder = tmp_path / "ckpt"
    save_model(random_qwen2(tok), tok, folder)
    cmd = [sys.executable, "-m", "flows.cli", "serve-policy", str(folder), "--seconds", "90",
           "--max-tokens", "4", "--workspace", str(tmp_path / "ws")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = {}
        for line in proc.stdout:
            key, _, value = line.strip().partition("=")
            lines[key] = value
            if "OPENAI_API_KEY" in lines:
                break
        assert lines["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")

        async def ask():
            c = openai.AsyncOpenAI(
                base_url=lines["OPENAI_BASE_URL"], api_key=lines["OPENAI_API_KEY"], max_retries=0
            )
            r = await c.chat.completions.create(model="m", messages=MSGS, n=2)
            await c.close()
            return r

        r = asyncio.run(ask())
        assert len(r.choices) == 2 and r.usage.completion_tokens <= 8
    finally:
        proc.terminate()
        proc.wait(timeout=30)
