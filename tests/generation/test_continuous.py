"""The continuous-batching rollout engine: admission and slot refill, batch-independent sampling,
KV-cache merging (checked against a plain full-sequence forward), hand-over by extract/inject, the
admission switch and weight loads with sequences in flight."""

import numpy as np
import pytest
import torch

from conf.schema import EngineOptions, ModelConfig, RolloutConfig
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.engine import Engine
from generation.sampler import _mix, _mix_py, _signed, gumbel_uniforms
from generation.records import GenRequest, Partial, PromptItem, ScoredGroup
from training.rl.trainer import build_batch, response_logits, token_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128
)
MAX_NEW = 16


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _model(tok, seed=0):
    """A random tiny model whose EOS embedding (tied with the output row) is scaled up, so responses
    end at varied lengths and rows leave the running batch at different steps."""
    model = build_tiny_model(SMALL, tok, seed=seed)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] *= 40
    return model.eval()


def _requests(tok, n_prompts=10, k=2, offset=0):
    items = [
        PromptItem(
            f"p{i}", f"What is {i}+1?", str(i + 1), encode_prompt(tok, f"What is {i}+1?" + "x" * (i % 7))
        )
        for i in range(offset, offset + n_prompts)
    ]
    return [GenRequest(p, s, group_uid=100 + j) for j, p in enumerate(items) for s in range(k)]


def _key(t):
    return (t.prompt.prompt_id, t.group_uid, t.sample_idx)


def _drain(engine, max_steps=3):
    out = []
    for _ in range(1000):
        st = engine.status()
        if st["active"] == 0 and (st["queued"] == 0 or not st["admitting"]):
            break
        out.extend(engine.step(max_steps))
    return out


def _staggered(engine, waves, steps_between=3):
    """Submit ``waves`` one at a time with a few decode steps in between, so new rows join a
    running batch of a different width (prompts of several lengths, rows at several depths)."""
    out = []
    for wave in waves:
        engine.submit(wave)
        out.extend(engine.step(steps_between))
    return out + _drain(engine)


def _recompute(model, tok, trajs, temperature=1.0):
    """Behaviour log-probs and mean entropies recomputed by one plain forward over prompt+response."""
    group = ScoredGroup(
        "scored_group", "all", tuple(trajs), tuple(0.0 for _ in trajs), tuple(False for _ in trajs)
    )
    batch = build_batch([group], tok.pad_token_id)
    with torch.no_grad():
        logits = response_logits(model, batch, "cpu")
        lp = token_logprobs(logits, batch.targets, temperature)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        ent = -(logp.exp() * logp).nan_to_num().sum(-1)
    mean_ent = (ent * batch.mask).sum(1) / batch.mask.sum(1).clamp(min=1)
    return batch, lp, mean_ent


def _check_trajectory(t, tok):
    assert t.kind == "trajectory" and len(t.response_tokens) == len(t.behaviour_logprobs) >= 1
    eos = tok.eos_token_id
    assert (t.finished and t.response_tokens[-1] == eos and eos not in t.response_tokens[:-1]) or (
        not t.finished and len(t.response_tokens) == MAX_NEW and eos not in t.response_tokens
    )
    body = t.response_tokens[:-1] if t.finished else t.response_tokens
    assert t.text == tok.decode(list(body), skip_special_tokens=True)
    assert all(lp <= 0 for lp in t.behaviour_logprobs) and t.mean_entropy > 0


def test_counter_hash_matches_reference_and_ignores_batch_composition():
    xs = [0, 1, 2**63 - 1, -1, -(2**63), 12345678901234567, -987654321]
    assert _mix(torch.tensor(xs)).tolist() == [_signed(_mix_py(x)) for x in xs]
    vocab = torch.arange(50)
    keys, t = torch.tensor([7, -3, 2**40]), torch.tensor([0, 5, 9])
    u = gumbel_uniforms(keys, t, vocab)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u[1:2], gumbel_uniforms(keys[1:2], t[1:2], vocab))  # a row's noise is its own
    assert not torch.equal(u[0], gumbel_uniforms(keys[:1], t[:1] + 1, vocab)[0])  # depends on t
    big = gumbel_uniforms(torch.arange(64), torch.arange(64), torch.arange(500))
    assert abs(big.mean().item() - 0.5) < 0.01 and abs(big.var().item() - 1 / 12) < 0.005


def test_every_request_finishes_once_and_slots_are_refilled(tok):
    engine = Engine(_model(tok), tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW))
    reqs = _requests(tok, 7, 2)
    engine.submit(reqs)
    st = engine.status()
    assert st == {"version": 0, "queued": 14, "active": 0, "capacity": 4, "kv_tokens": 0, "admitting": True}
    out, queued_seen = [], []
    while engine.status()["active"] or engine.status()["queued"]:
        out.extend(engine.step(2))
        st = engine.status()
        assert st["active"] <= 4
        queued_seen.append(st["queued"])
        if st["active"]:
            assert st["kv_tokens"] >= st["active"] * (len(reqs[0].prompt.prompt_tokens) + 1)
    assert queued_seen[0] <= 10 and queued_seen == sorted(queued_seen, reverse=True) and queued_seen[-1] == 0
    assert sorted(_key(t) for t in out) == sorted(
        (r.prompt.prompt_id, r.group_uid, r.sample_idx) for r in reqs
    )
    for t in out:
        _check_trajectory(t, tok)
        assert t.version == 0 and t.last_version == 0
    assert any(t.finished for t in out) and any(not t.finished for t in out)
    assert engine.step(5) == [] and engine.status()["kv_tokens"] == 0


def test_tokens_do_not_depend_on_batching(tok):
    model = _model(tok)
    reqs = _requests(tok, 10, 2)
    alone = Engine(model, tok, EngineOptions(capacity=1, max_new_tokens=MAX_NEW, seed=3))
    alone.submit(reqs)
    a = {_key(t): t for t in _drain(alone)}
    full = Engine(model, tok, EngineOptions(capacity=8, max_new_tokens=MAX_NEW, seed=3))
    b = {_key(t): t for t in _staggered(full, [reqs[:3], reqs[3:9], reqs[9:]])}
    assert a.keys() == b.keys() and len(a) == len(reqs)
    for k in a:
        assert a[k].response_tokens == b[k].response_tokens
        np.testing.assert_allclose(a[k].behaviour_logprobs, b[k].behaviour_logprobs, atol=1e-5)
        assert a[k].mean_entropy == pytest.approx(b[k].mean_entropy, abs=1e-5)
    # the same prompt's two samples differ, and another seed draws other tokens
    assert (
        sum(
            a[(f"p{i}", 100 + i, 0)].response_tokens != a[(f"p{i}", 100 + i, 1)].response_tokens
            for i in range(10)
        )
        >= 8
    )
    other = Engine(model, tok, EngineOptions(capacity=8, max_new_tokens=MAX_NEW, seed=4))
    other.submit(reqs)
    c = {_key(t): t for t in _drain(other)}
    assert sum(c[k].response_tokens != a[k].response_tokens for k in a) >= len(a) - 2


def test_logprobs_match_full_recomputation_after_joins(tok):
    model = _model(tok)
    engine = Engine(
        model, tok, EngineOptions(capacity=5, max_new_tokens=MAX_NEW, temperature=0.8), waves=False
    )
    calls = []
    prefill = engine._prefill

    def spy(seqs):  # the running rows at each prefill, and how many rows the prefill covers
        calls.append((len(engine._batch._rows), len(seqs)))
        return prefill(seqs)

    engine._prefill = spy
    reqs = _requests(tok, 12, 2)
    trajs = _staggered(engine, [reqs[i : i + 4] for i in range(0, len(reqs), 4)], steps_between=2)
    assert sorted(_key(t) for t in trajs) == sorted(
        (r.prompt.prompt_id, r.group_uid, r.sample_idx) for r in reqs
    )
    # new rows joined a running batch, and only the new rows were prefilled
    assert any(running > 0 for running, _ in calls)
    assert all(running + n <= 5 for running, n in calls)
    batch, lp, mean_ent = _recompute(model, tok, trajs, temperature=0.8)
    assert torch.allclose(lp * batch.mask, batch.behaviour * batch.mask, atol=1e-4)
    np.testing.assert_allclose([t.mean_entropy for t in trajs], mean_ent.numpy(), atol=1e-4)


def test_extract_and_inject_continue_the_same_trajectory(tok):
    model = _model(tok)
    reqs = _requests(tok, 6, 2)
    ref = Engine(model, tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW))
    ref.submit(reqs)
    expected = {_key(t): t for t in _drain(ref)}

    a = Engine(model, tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW))
    a.submit(reqs)
    done = a.step(4)
    partials, queued = a.extract()
    assert a.status()["active"] == 0 and a.status()["queued"] == 0 and a.step(3) == []
    assert 1 <= len(partials) <= a.capacity and len(queued) >= len(reqs) - 4 - len(done)
    assert len(done) + len(partials) + len(queued) == len(reqs)
    assert all(len(p.tokens) == len(p.logprobs) >= 1 and p.version == 0 for p in partials)

    b = Engine(model, tok, EngineOptions(capacity=3, max_new_tokens=MAX_NEW))
    b.submit(_requests(tok, 2, 1, offset=50))  # B is busy with other work when the partials arrive
    b.step(2)
    b.inject(partials)
    b.submit(queued)
    ours = {r.prompt.prompt_id for r in reqs}
    got = {_key(t): t for t in done + [t for t in _drain(b) if t.prompt.prompt_id in ours]}
    assert got.keys() == expected.keys()
    for k, t in expected.items():
        assert got[k].response_tokens == t.response_tokens and got[k].finished == t.finished
        np.testing.assert_allclose(got[k].behaviour_logprobs, t.behaviour_logprobs, atol=1e-5)
        assert got[k].mean_entropy == pytest.approx(t.mean_entropy, abs=1e-5)
        assert got[k].text == t.text and got[k].version == 0


def test_admission_switch_and_injected_partials(tok):
    model = _model(tok)
    engine = Engine(model, tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW))
    engine.admitting = False
    engine.submit(_requests(tok, 3, 1))
    assert engine.step(5) == [] and engine.status()["active"] == 0 and engine.status()["queued"] == 3

    donor = Engine(model, tok, EngineOptions(capacity=2, max_new_tokens=MAX_NEW))
    donor.submit(_requests(tok, 2, 1, offset=20))
    donor.step(2)
    partials, _ = donor.extract()
    done_req = _requests(tok, 1, 1, offset=30)[0]
    complete = Partial(done_req, (5, 6, tok.eos_token_id), (-1.0, -2.0, -0.5), version=0, entropy_sum=3.0)
    engine.inject(partials + [complete])
    out = engine.step(1)
    assert [t.prompt.prompt_id for t in out if t.prompt.prompt_id == "p30"] == [
        "p30"
    ]  # nothing left to sample
    finished = [t for t in out if t.prompt.prompt_id == "p30"][0]
    assert finished.finished and finished.response_tokens == complete.tokens and finished.mean_entropy == 1.0
    assert engine.status()["queued"] == 3 and engine.status()["active"] <= len(partials)
    out += _drain(engine)
    assert partials and {t.prompt.prompt_id for t in out} == {"p30"} | {
        p.request.prompt.prompt_id for p in partials
    }
    assert engine.status()["queued"] == 3 and engine.status()["active"] == 0
    engine.admitting = True
    rest = _drain(engine)
    assert sorted(t.prompt.prompt_id for t in rest) == ["p0", "p1", "p2"]
    partials, queued = engine.extract()
    assert partials == [] and queued == []


def test_load_state_with_active_sequences_continues_them_under_new_weights(tok):
    old = _model(tok)
    new = _model(tok, seed=1)
    state = {k: v.detach().numpy().copy() for k, v in new.state_dict().items()}
    for v in state.values():
        v.setflags(write=False)  # arrays from an object store are read-only
    reqs = _requests(tok, 4, 1)
    engine = Engine(_model(tok), tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW), waves=False)
    engine.submit(reqs)
    before = engine.step(3)
    n_before = {
        (r.request.prompt.prompt_id, r.request.group_uid, r.request.sample_idx): n
        for r, n in zip(engine._batch._rows, engine._batch._ngen.tolist())
    }
    assert n_before, "some sequences should still be active"
    twin = Engine(
        _model(tok), tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW)
    )  # the same run, handed over
    twin.submit(reqs)
    twin.step(3)
    handed, _ = twin.extract()
    assert {(p.request.prompt.prompt_id, p.request.group_uid, p.request.sample_idx) for p in handed} == set(
        n_before
    )

    with pytest.raises(KeyError):
        engine.load_state({k: v for k, v in list(state.items())[1:]}, 9)
    assert engine.version == 0
    engine.load_state(state, 1)
    assert engine.status()["version"] == 1 and engine.status()["active"] == len(n_before)
    after = _drain(engine)
    assert {_key(t) for t in before + after} == {
        (r.prompt.prompt_id, r.group_uid, r.sample_idx) for r in reqs
    }
    for t in after:
        n = n_before[_key(t)]
        assert t.version == 0
        assert t.last_version == (1 if len(t.response_tokens) > n else 0)
    assert any(t.last_version == 1 for t in after)
    # tokens sampled before the load match the old weights, later ones the new weights
    batch, lp_old, _ = _recompute(old, tok, after)
    _, lp_new, _ = _recompute(new, tok, after)
    for i, t in enumerate(after):
        n = n_before[_key(t)]
        r = len(t.response_tokens)
        assert torch.allclose(lp_old[i, :n], batch.behaviour[i, :n], atol=1e-4)
        assert torch.allclose(lp_new[i, n:r], batch.behaviour[i, n:r], atol=1e-4)
    # continuing in place equals handing the partials to a fresh engine holding the new weights
    fresh = Engine(new, tok, EngineOptions(capacity=2, max_new_tokens=MAX_NEW))
    fresh.version = 1
    fresh.inject(handed)
    cont = {_key(t): t for t in _drain(fresh)}
    for t in after:
        assert cont[_key(t)].response_tokens == t.response_tokens


def test_lazy_retirement_gives_the_same_trajectories(tok):
    """The GPU decode loop (finished rows masked on the device, leaving only every ``sync_every``
    steps) samples exactly what the step-by-step loop samples."""
    model = _model(tok)
    reqs = _requests(tok, 8, 2)
    eager = Engine(model, tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW))
    assert eager.sync_every == 1  # the CPU default
    a = {_key(t): t for t in _staggered(eager, [reqs[:5], reqs[5:]])}
    lazy = Engine(
        model, tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW, rollout=RolloutConfig(sync_every=5))
    )
    b = {_key(t): t for t in _staggered(lazy, [reqs[:5], reqs[5:]])}
    assert a.keys() == b.keys() and len(a) == len(reqs)
    for k in a:
        assert a[k].response_tokens == b[k].response_tokens and a[k].finished == b[k].finished
        np.testing.assert_allclose(a[k].behaviour_logprobs, b[k].behaviour_logprobs, atol=1e-5)
        assert a[k].mean_entropy == pytest.approx(b[k].mean_entropy, abs=1e-5)
        assert (a[k].version, a[k].last_version) == (b[k].version, b[k].last_version)
        _check_trajectory(b[k], tok)
    assert lazy.status()["active"] == 0 and lazy.status()["kv_tokens"] == 0


@pytest.mark.parametrize("waves", [True, False])
def test_extract_only_some_requests_keeps_the_others_running(tok, waves):
    from generation.sampler import request_key

    model = _model(tok)
    reqs = _requests(tok, 4, 1)
    ref = Engine(model, tok, EngineOptions(capacity=4, max_new_tokens=MAX_NEW))
    ref.submit(reqs)
    expected = {_key(t): t for t in _drain(ref)}
    engine = Engine(model, tok, EngineOptions(capacity=3, max_new_tokens=MAX_NEW), waves=waves)
    engine.submit(reqs)
    done = engine.step(2)
    running = [r.request for r in engine._batch._rows if r is not None]
    assert len(running) >= 2, "the test needs two running rows"
    pick = {request_key(running[0]), request_key(reqs[3])}  # one running, one queued
    partials, queued = engine.extract(only=pick)
    assert [request_key(p.request) for p in partials] == [request_key(running[0])]
    assert [request_key(r) for r in queued] == [request_key(reqs[3])]
    assert engine.status()["active"] == len(running) - 1 and engine.status()["queued"] == 0
    rest = _drain(engine)
    other = Engine(model, tok, EngineOptions(capacity=3, max_new_tokens=MAX_NEW))
    other.inject(partials)
    other.submit(queued)
    got = {_key(t): t for t in done + rest + _drain(other)}
    assert got.keys() == expected.keys()
    for k, t in expected.items():
        assert got[k].response_tokens == t.response_tokens
