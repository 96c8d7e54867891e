"""One batch-independent sampler (``generation.sampler``) on every decode path: a request's tokens are
a function of (seed, request, step), not of the batch it runs in, its order, the decode shards, the
padding, or whether the batch call or the continuous ``step()`` loop samples it."""

import random

import pytest
import torch

import generation.wave as wave_mod
from generation import kernels
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import GenRequest, PromptItem
from generation.sampler import row_keys, sample
from tests.generation.test_engine_static import SMALL, _assert_same, _frequent_token
from conf.schema import EngineOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def _requests(tok, n, samples, tag="p"):
    items = [
        PromptItem(f"{tag}{i}", "", "", encode_prompt(tok, f"What is {i}+{i % 3}?\n" + "y" * (2 * i % 7)))
        for i in range(n)
    ]
    return [GenRequest(p, s, group_uid=i) for i, p in enumerate(items) for s in range(samples)]


def _by_key(trajs):
    return {(t.prompt.prompt_id, t.sample_idx): t for t in trajs}


@pytest.fixture(scope="module")
def setup():
    tok = build_char_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    reqs = _requests(tok, 8, 4)
    eos = _frequent_token(Engine(model, tok), reqs)  # rows finish at many steps
    return tok, model, reqs, eos


def _engine(model, tok, eos, capacity: int | None = None, **kw):
    engine = Engine(
        model, tok, EngineOptions() if capacity is None else EngineOptions(capacity=capacity), **kw
    )
    engine.eos_id = eos
    return engine


def test_batch_composition_order_and_batch_size_do_not_change_the_tokens(setup):
    tok, model, reqs, eos = setup
    want = _engine(model, tok, eos, capacity=64).generate(reqs, 32, 1.0, seed=7)
    lengths = sorted(len(t.response_tokens) for t in want)
    assert lengths[0] < lengths[-1]  # early stops: rows leave the batch at different steps
    mixed = reqs[::3] + _requests(tok, 5, 3, tag="other")  # other prompts, longer padding, fewer rows
    shuffled = list(reqs)
    random.Random(0).shuffle(shuffled)
    for batch, size in ((mixed, 64), (shuffled, 64), (reqs, 5), (list(reversed(reqs)), 11)):
        got = _by_key(_engine(model, tok, eos, capacity=size).generate(batch, 32, 1.0, seed=7))
        mine = [t for t in want if (t.prompt.prompt_id, t.sample_idx) in got]
        _assert_same(mine, [got[(t.prompt.prompt_id, t.sample_idx)] for t in mine])
    other = _engine(model, tok, eos).generate(reqs, 32, 1.0, seed=8)
    assert [t.response_tokens for t in other] != [t.response_tokens for t in want]  # the seed matters


@pytest.mark.parametrize("fused", [True, False])
def test_shard_counts_do_not_change_the_tokens(setup, monkeypatch, fused):
    tok, model, reqs, eos = setup
    monkeypatch.setattr(wave_mod, "MIN_SHARD_ROWS", 4)
    engine = _engine(model, tok, eos, fused_decode=fused)
    runs = []
    for k in (1, 3, 5):
        engine.decode_threads = k
        runs.append(engine.generate(reqs, 24, 0.8, seed=3))
    assert len(wave_mod.shard_rows(len(reqs), "cpu", engine.decode_threads)) == 5
    _assert_same(runs[0], runs[1])
    _assert_same(runs[0], runs[2])


def test_the_batch_call_and_the_continuous_step_loop_sample_the_same(setup):
    tok, model, reqs, eos = setup
    want = _by_key(_engine(model, tok, eos).generate(reqs, 24, 1.0, seed=11))
    for capacity, steps in ((5, 3), (32, 24)):
        cont = Engine(model, tok, EngineOptions(capacity=capacity, max_new_tokens=24, seed=11))
        cont.eos_id = eos
        cont.submit(list(reversed(reqs)))
        out = []
        while cont.status()["active"] or cont.status()["queued"]:
            out.extend(cont.step(steps))
        got = _by_key(out)
        assert sorted(got) == sorted(want)
        keys = sorted(want)
        _assert_same([want[k] for k in keys], [got[k] for k in keys])


@pytest.mark.skipif(kernels.load() is None, reason="the native kernels are not available here")
def test_the_native_sampling_step_draws_what_the_torch_sampler_draws():
    torch.manual_seed(0)
    n, vocab, t = 64, 300, 5
    logits = torch.randn(n, vocab) * 3
    requests = _requests(build_char_tokenizer(), 16, 4)
    keys = row_keys(4, requests)
    rows = torch.arange(n).flip(0)  # batch rows in another order than the logits' rows
    want, lp, ent = sample(logits, 0.7, keys[rows], torch.full((n,), t))
    out = wave_mod.Outputs(n, 8)
    nxt, keep = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.bool)
    k = kernels.load()
    k.sample_step(
        logits, 0.7, keys, rows, t, -1, out.tokens, out.logps, out.ent_sum, out.lengths, out.done, nxt, keep
    )
    assert torch.equal(nxt, want)
    assert torch.allclose(out.logps[rows, t], lp, atol=1e-5)
    assert torch.allclose(out.ent_sum[rows], ent.float(), atol=1e-4)


def _drain(engine, steps=3):
    out = []
    while engine.status()["active"] or engine.status()["queued"]:
        out.extend(engine.step(steps))
    return out


def test_a_wave_handed_over_dissolved_or_reloaded_midway_samples_the_same(setup, monkeypatch):
    tok, model, reqs, eos = setup
    want = _by_key(_engine(model, tok, eos).generate(reqs, 24, 1.0, seed=2))
    keys = sorted(want)

    def check(trajs):
        got = _by_key(trajs)
        assert sorted(got) == keys
        _assert_same([want[k] for k in keys], [got[k] for k in keys])

    def engine(capacity: int):
        e = Engine(model, tok, EngineOptions(capacity=capacity, max_new_tokens=24, seed=2))
        e.eos_id = eos
        return e

    # handed over midway: extract from a wave, inject into another engine
    a, b = engine(capacity=64), engine(capacity=64)
    a.submit(reqs)
    early = a.step(5)
    assert not a._batch.joins and a.status()["active"] > 0  # a wave was running
    partials, queued = a.extract()
    assert queued == [] and a.status()["active"] == 0 and partials
    b.inject(partials)
    check(early + _drain(b))
    # dissolved: a wave of half the requests, the rest queued; once a few of its rows are done the
    # others continue beside the queued ones
    dissolved = []
    original = Engine._dissolve_wave
    monkeypatch.setattr(Engine, "_dissolve_wave", lambda self: dissolved.append(1) or original(self))
    d = engine(capacity=16)
    d.wave_refill = 0.9
    check(_drain_submitted(d, reqs))
    assert dissolved
    # new weights (the same values) midway: the rows continue by re-prefill, the version moves
    c = engine(capacity=64)
    c.submit(reqs)
    early = c.step(5)
    c.load_weights(1, state={k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
    late = _drain(c)
    check(early + late)
    assert all(t.version == 0 for t in late) and any(t.last_version == 1 for t in late)


def _drain_submitted(engine, reqs):
    engine.submit(reqs)
    return _drain(engine)
