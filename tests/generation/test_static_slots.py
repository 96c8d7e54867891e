"""The static-slot engine (fixed-shape decode for CUDA graphs) samples what ``Engine``
samples: joins into a running batch, cache compaction and growth, lazy retirement, extract/inject
and weight loads with sequences in flight. Runs on the CPU without graphs (the captured forward is
the same eager forward)."""

import numpy as np
import pytest
import torch

from generation.engine import Engine
from generation.sampler import request_key

from test_continuous import MAX_NEW, _drain, _key, _model, _requests, _staggered
from conf.schema import EngineOptions, RolloutConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    from generation.model import build_char_tokenizer

    return build_char_tokenizer()


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].response_tokens == b[k].response_tokens and a[k].finished == b[k].finished
        np.testing.assert_allclose(a[k].behaviour_logprobs, b[k].behaviour_logprobs, atol=1e-5)
        assert a[k].mean_entropy == pytest.approx(b[k].mean_entropy, abs=1e-5)
        assert (a[k].version, a[k].last_version) == (b[k].version, b[k].last_version)


def _reference(model, tok, reqs, capacity: int) -> dict:
    """What the dynamic engine samples for ``reqs``, by request key."""
    ref = Engine(model, tok, EngineOptions(capacity=capacity, max_new_tokens=MAX_NEW))
    ref.submit(reqs)
    return {_key(t): t for t in _drain(ref)}


@pytest.mark.parametrize("sync_every", [1, 3])
def test_static_slots_match_the_dynamic_engine_through_compaction_and_growth(tok, sync_every):
    model = _model(tok)
    reqs = _requests(tok, 12, 2)
    waves = [reqs[:3], reqs[3:9], reqs[9:]]
    ref = {
        _key(t): t
        for t in _staggered(Engine(model, tok, EngineOptions(capacity=3, max_new_tokens=MAX_NEW)), waves)
    }
    eng = Engine(
        model,
        tok,
        EngineOptions(
            capacity=3,
            max_new_tokens=MAX_NEW,
            rollout=RolloutConfig(static_cache=True, sync_every=sync_every),
        ),
        static_width=20,
    )
    got = {_key(t): t for t in _staggered(eng, waves)}
    _same(ref, got)
    assert eng._batch._width > 20 and eng._batch.compactions >= 1  # the cache grew and was compacted
    assert eng.status() == {
        "version": 0,
        "queued": 0,
        "active": 0,
        "capacity": 3,
        "kv_tokens": 0,
        "admitting": True,
    }
    assert not eng.cuda_graphs  # CPU: eager forward


def test_static_slots_hand_over_and_load_weights_like_the_dynamic_engine(tok):
    model = _model(tok)
    reqs = _requests(tok, 6, 2)
    expected = _reference(model, tok, reqs, capacity=4)

    eng = Engine(
        model,
        tok,
        EngineOptions(capacity=4, max_new_tokens=MAX_NEW, rollout=RolloutConfig(static_cache=True)),
        static_width=24,
    )
    eng.submit(reqs)
    done = eng.step(3)
    running = [r.request for r in eng._batch._rows]
    one, _ = eng.extract(include_queued=False, only={request_key(running[0])})
    assert len(one) == 1 and eng.status()["active"] == len(running) - 1
    partials, queued = eng.extract()
    assert eng.status()["active"] == 0 and eng.status()["kv_tokens"] == 0
    other = Engine(
        model,
        tok,
        EngineOptions(capacity=3, max_new_tokens=MAX_NEW, rollout=RolloutConfig(static_cache=True)),
        static_width=24,
    )
    other.submit(_requests(tok, 2, 1, offset=40))  # busy with other work when the partials arrive
    other.step(2)
    other.inject(one + partials)
    other.submit(queued)
    ours = {r.prompt.prompt_id for r in reqs}
    got = {_key(t): t for t in done + [t for t in _drain(other) if t.prompt.prompt_id in ours]}
    _same(expected, got)

    # a weight load with sequences in flight: the same continuation as the dynamic engine's
    new = _model(tok, seed=1)
    state = {k: v.detach().numpy().copy() for k, v in new.state_dict().items()}
    runs = []
    for cls, kw in ((Engine, {}), (Engine, {"static_width": 24})):
        e = cls(_model(tok), tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW), **kw)
        e.submit(reqs[:6])
        out = e.step(3)
        e.load_state(state, 1)
        runs.append({_key(t): t for t in out + _drain(e)})
    _same(runs[0], runs[1])
    assert any(t.last_version == 1 and t.version == 0 for t in runs[1].values())


def test_static_decode_step_reads_no_tensor_value_on_the_host(tok):
    """CUDA-graph capture (and a GPU that never waits on Python) needs a decode step whose host code
    never reads a tensor's value. On the meta device any such read raises, so one whole decode step
    (model forward over the slot cache with the 4-D mask, Gumbel sampling, masked updates) running
    there shows the step is capturable as far as the CPU can tell."""
    from conf.schema import ModelConfig
    from generation.model import build_tiny_model

    model = build_tiny_model(
        ModelConfig(
            hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64
        ),
        tok,
        seed=0,
    ).to("meta")
    eng = Engine(
        model,
        tok,
        EngineOptions(capacity=4, max_new_tokens=8, rollout=RolloutConfig(static_cache=True)),
        device="meta",
        static_width=16,
    )

    class _Layer:
        keys = torch.empty((1, 2, 1, 8), device="meta")
        values = torch.empty((1, 2, 1, 8), device="meta")

    eng._batch._ensure_kv(type("_Cache", (), {"layers": [_Layer(), _Layer()]})(), 16)
    eng._batch._c = 5
    with torch.inference_mode():
        eng._batch.decode()
    assert eng._batch._c == 6 and eng._batch._next.device.type == "meta"


def test_narrowed_cpu_step_moves_stragglers_down_and_samples_the_same(tok):
    """On the CPU the eager step runs over the occupied slot prefix and the live columns only; in the
    long tail (nothing queued) the stragglers move down to the lowest free slots. Neither changes
    what is sampled: the same trajectories as the dynamic engine's."""
    model = _model(tok)
    reqs = _requests(tok, 8, 2)
    expected = _reference(model, tok, reqs, capacity=8)
    eng = Engine(
        model,
        tok,
        EngineOptions(capacity=8, max_new_tokens=MAX_NEW, rollout=RolloutConfig(static_cache=True)),
        static_width=24,
    )
    assert eng._batch.narrow
    eng.submit(reqs)
    _same(expected, {_key(t): t for t in _drain(eng)})
    assert eng._batch.slot_moves > 0  # rows finished below running ones, which then moved down
