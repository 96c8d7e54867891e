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


def test_the_batched_sampler_draws_each_row_from_its_own_distribution(server):
    """One ``_sample`` over rows of mixed settings: each row's log-prob is that of its token under its
    own ``_sampling_logprobs`` (greedy rows: the argmax, log-prob 0; a tiny nucleus: the argmax)."""
    from environments.agents.serve import _Job, _Row

    settings = [(0.0, 1.0), (1.0, 1.0), (0.5, 0.9), (2.0, 1e-9), (1.0, 0.3), (0.0, 0.5)]
    calls = [type("C", (), {"request": {"stop": []}})() for _ in settings]
    rows = [_Row(_Job(c, [1], 10, t, p, [None]), 0) for c, (t, p) in zip(calls, settings)]
    logits = torch.randn(len(rows), len(server.tokenizer), generator=torch.Generator().manual_seed(0)) * 3
    for _ in range(20):
        toks = server._sample(rows, logits).tolist()
    for row, lg, (t, p) in zip(rows, logits, settings):
        want = _sampling_logprobs(lg, t, p)
        assert row.lps == pytest.approx([float(want[tok]) for tok in row.tokens], abs=1e-5)
        assert all(torch.isfinite(want[tok]) for tok in row.tokens) and len(row.tokens) == 20
    argmax = int(logits[0].argmax())
    assert rows[0].tokens == [argmax] * 20 and rows[0].lps == [0.0] * 20 and toks[0] == argmax
    assert rows[3].tokens == [int(logits[3].argmax())] * 20 and len(set(rows[1].tokens)) > 1


def test_the_cli_serves_a_checkpoint_folder(tmp_path):
    """``laminar serve-policy FOLDER --seconds S --max-batch B``: prints the base URL and the token,
    answers a real client, and stops after S seconds; ``--max-batch 0`` is refused."""
    from generation.model import save_model

    tok = bpe_tokenizer()
    folder = tmp_path / "ckpt"
    save_model(random_qwen2(tok), tok, folder)
    cmd = [sys.executable, "-m", "flows.cli", "serve-policy", str(folder), "--seconds", "90",
           "--max-tokens", "4", "--workspace", str(tmp_path / "ws")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run(cmd + ["--max-batch", "0"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--max-batch >= 1" in bad.stderr
    cmd += ["--max-batch", "3"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = {}
        for line in proc.stdout:
            key, _, value = line.strip().partition("=")
            lines[key] = value
            if "OPENAI_API_KEY" in lines:
                break
        assert lines["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
        assert any(k.startswith("# serving") and "3 rows batched" in k for k in lines)

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


# ------------------------------------------------------------------------------ continuous batching
def _untied_qwen2(tok):
    """A random Qwen2 with its own output head: its greedy text depends on the whole context (a tied
    random model mostly repeats the last token), and EOS is unlikely (its logit is 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        model.lm_head.weight[tok.eos_token_id] = 0.0
        for layer in model.model.layers:  # sharp attention: a wrong position or mask changes the text
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def untied():
    tok = bpe_tokenizer()
    srv = PolicyServer(_untied_qwen2(tok), tok, max_tokens=900, max_batch=8, seed=2)
    yield srv
    srv.close()


PROMPTS = ["What is 4 * 5?", "the quick brown fox", "12 + 7 - 3", "numbers 0123", "Let me compute", "#### 16"]


def _until(pred, timeout: float = 60.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out waiting"
        time.sleep(0.005)


async def _greedy_reply(c, i: int, prompt: str, n: int = 1):
    """Greedy, ``6 + 2 i`` tokens; chat for even ``i``, completions for odd: (texts, token texts)."""
    if i % 2 == 0:
        msgs = [{"role": "user", "content": prompt}]
        r = await c.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=6 + 2 * i,
                                            n=n, logprobs=True)  # fmt: skip
        return [(ch.message.content, [x.token for x in ch.logprobs.content]) for ch in r.choices]
    r = await c.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=6 + 2 * i, n=n,
                                   logprobs=1)  # fmt: skip
    return [(ch.text, ch.logprobs.tokens) for ch in r.choices]


def test_concurrent_greedy_requests_get_the_answers_they_get_alone(untied):
    """Six requests of different prompts, lengths and kinds (one with n=2), sent at once, decode in one
    batch (padding, positions, joins and leaves) and get exactly the tokens each gets alone."""

    async def go():
        c = _client(untied)
        untied.peak_rows = 0
        alone = [await _greedy_reply(c, i, p) for i, p in enumerate(PROMPTS)]
        assert untied.peak_rows == 1 and len({tuple(a[0][1]) for a in alone}) == len(PROMPTS)
        asks = [_greedy_reply(c, i, p, n=1 + (i == 3)) for i, p in enumerate(PROMPTS)]
        together = await asyncio.gather(*asks)
        await c.close()
        return alone, together

    alone, together = asyncio.run(go())
    assert untied.peak_rows >= 4  # they did decode together
    for i, (one, both) in enumerate(zip(alone, together)):
        assert len(one[0][1]) == 6 + 2 * i
        assert both == one * len(both)


def test_a_request_joins_a_batch_that_is_decoding(untied):
    """A short request sent while a long one decodes joins it at the next step and is answered first;
    the long one's tokens are those it gets alone."""
    msgs = [{"role": "user", "content": "the quick brown fox"}]

    async def go():
        c = _client(untied)
        kw = dict(model="m", messages=msgs, temperature=0, max_tokens=800)
        alone = (await c.chat.completions.create(**kw)).choices[0].message.content
        untied.peak_rows = 0
        steps = untied.steps
        long = asyncio.ensure_future(c.chat.completions.create(**kw))
        while untied.steps < steps + 5:  # the long request is decoding
            await asyncio.sleep(0.002)
        short = await c.completions.create(model="m", prompt="12 + 7", temperature=0, max_tokens=3)
        assert not long.done() and short.usage.completion_tokens == 3
        r = await long
        await c.close()
        return alone, r

    alone, r = asyncio.run(go())
    assert r.choices[0].message.content == alone and r.usage.completion_tokens == 800
    assert untied.peak_rows == 2


def test_mixed_settings_in_one_batch_each_honour_their_own(server):
    """Greedy n=3, a length cap, a tiny nucleus, tempered samples, hot samples n=4, a stop string and
    completions n=2, all at once: every row samples under its own request's settings."""
    tok = server.tokenizer
    ids = list(server.format.first(MSGS, []))
    greedy = _greedy(server, ids, 12)

    async def go():
        c = _client(server)
        chat = c.chat.completions.create
        asks = [chat(model="m", messages=MSGS, temperature=0, n=3, logprobs=True),
                chat(model="m", messages=MSGS, max_tokens=3, n=2),
                chat(model="m", messages=MSGS, top_p=1e-9, max_tokens=5, logprobs=True),
                chat(model="m", messages=MSGS, temperature=2.0, n=4),
                chat(model="m", messages=MSGS, temperature=0, stop=["6 1"]),
                c.completions.create(model="m", prompt="What is", n=2, max_tokens=4,
                                     temperature=0)]  # fmt: skip
        tempered = dict(model="m", messages=MSGS, temperature=0.5, max_tokens=3, logprobs=True)
        asks += [chat(**tempered) for _ in range(24)]  # some have only tokens whose text names their id
        server.peak_rows = 0
        out = await asyncio.gather(*asks)
        await c.close()
        return out

    out = asyncio.run(go())
    assert server.peak_rows > 3
    r = out[0]
    assert {ch.message.content for ch in r.choices} == {tok.decode(greedy, skip_special_tokens=True).strip()}
    assert r.usage.completion_tokens == 36 and all(x.logprob == 0.0 for x in r.choices[0].logprobs.content)
    assert out[1].usage.completion_tokens == 6 and {ch.finish_reason for ch in out[1].choices} == {"length"}
    assert [x.token for x in out[2].choices[0].logprobs.content] == [tok.decode([t]) for t in greedy[:5]]
    assert len({ch.message.content for ch in out[3].choices}) > 1
    ch = out[4].choices[0]
    assert (ch.finish_reason, ch.message.content, out[4].usage.completion_tokens) == ("stop", "1", 2)
    assert out[5].choices[0].text == out[5].choices[1].text and out[5].usage.completion_tokens == 8
    ids_of: dict[str, list[int]] = {}
    for i in range(len(tok)):
        ids_of.setdefault(tok.decode([i]), []).append(i)
    checked = 0
    for r in out[6:]:
        content = r.choices[0].logprobs.content
        if not all(len(ids_of[x.token]) == 1 for x in content):
            continue  # a byte token that decodes to U+FFFD does not name its id
        toks = [ids_of[x.token][0] for x in content]
        with torch.no_grad():
            logits = server.model(torch.tensor([ids + toks])).logits[0, len(ids) - 1 : -1]
        want = [float(torch.log_softmax(logits[i] / 0.5, -1)[t]) for i, t in enumerate(toks)]
        assert [x.logprob for x in content] == pytest.approx(want, abs=1e-4)
        checked += 1
    assert checked >= 1


def test_an_abandoned_request_frees_its_row():
    """A request the endpoint gives up on (504 past ``request_timeout_s``) leaves the batch, and a queued
    one leaves the queue, without being decoded to its cap."""
    from environments.agents.server import parse_request
    from environments.agents.session import Call

    tok = bpe_tokenizer()
    srv = PolicyServer(_untied_qwen2(tok), tok, max_tokens=900, max_batch=1, request_timeout_s=0.3)
    try:
        # through the endpoint: a 504, then the row is gone
        async def ask():
            c = _client(srv)
            try:
                await c.completions.create(model="m", prompt="What is", max_tokens=900, temperature=0)
            finally:
                await c.close()

        with pytest.raises(openai.InternalServerError) as err:
            asyncio.run(ask())
        assert err.value.status_code == 504
        _until(lambda: srv.active() == 0)
        assert srv.dropped_rows == 1 and not srv.waiting
        # directly: one row decoding (max_batch=1), one queued behind it; both abandoned
        calls = [Call(parse_request("completion", {"prompt": p, "max_tokens": 900})) for p in ("a", "b")]
        srv.post(calls[0])
        _until(lambda: srv.active() == 1)
        srv.post(calls[1])
        _until(lambda: len(srv.waiting) == 1)
        srv.abandon(calls[1])
        _until(lambda: not srv.waiting)
        assert srv.dropped_rows == 2 and srv.active() == 1
        srv.abandon(calls[0])
        _until(lambda: srv.active() == 0)
        assert srv.dropped_rows == 3 and not any(c.done.is_set() for c in calls)
    finally:
        srv.close()


def test_errors_are_still_4xx_and_end_only_their_own_request(untied):
    """A prompt past the model's context, and a conversation the chat template refuses, are each a 400
    from the decoder while a request beside them is served; ``max_batch`` below 1 is refused."""
    from environments.agents.chat import ChatFormat

    class Strict(ChatFormat):
        def first(self, messages, tools, prompt=None):
            if messages[-1]["content"] == "boom":
                raise RuntimeError("the template refuses this conversation")
            return super().first(messages, tools, prompt)

    srv = PolicyServer(untied.model, untied.tokenizer, max_tokens=8)
    srv.format = Strict(untied.tokenizer)

    async def go():
        c = _client(srv)
        long = c.completions.create(model="m", prompt="What is 4 * 5? " * 400, max_tokens=4)
        boom = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "boom"}])
        fine = c.chat.completions.create(model="m", messages=MSGS, max_tokens=4)
        out = await asyncio.gather(long, boom, fine, return_exceptions=True)
        await c.close()
        return out

    try:
        long, boom, fine = asyncio.run(go())
    finally:
        srv.close()
    assert isinstance(long, openai.BadRequestError) and "context is 1024" in str(long)
    assert isinstance(boom, openai.BadRequestError) and "refuses this conversation" in str(boom)
    assert fine.usage.completion_tokens == 4
    with pytest.raises(ValueError, match="max_batch"):
        PolicyServer(untied.model, untied.tokenizer, max_batch=0)


def test_a_failed_forward_fails_its_batch_and_the_server_goes_on(untied):
    """A forward that raises (here: a prefill of a prompt holding one token) answers the rows it was
    computing with a 500; the decoder keeps serving the requests after it."""
    tok = untied.tokenizer
    bad = tok("zebra")["input_ids"][0]

    class Flaky(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, **kw):
            if input_ids.shape[1] > 1 and bool((input_ids == bad).any()):
                raise RuntimeError("simulated: out of memory")
            return self.inner(input_ids=input_ids, **kw)

    srv = PolicyServer(Flaky(untied.model), tok, max_tokens=6)

    async def go():
        c = _client(srv)
        with pytest.raises(openai.InternalServerError, match="out of memory") as err:
            await c.completions.create(model="m", prompt="zebra", max_tokens=4)
        r = await c.completions.create(model="m", prompt="What is", max_tokens=4, temperature=0)
        await c.close()
        return err.value.status_code, r

    try:
        status, r = asyncio.run(go())
    finally:
        srv.close()
    assert status == 500 and r.usage.completion_tokens == 4 and srv.active() == 0
