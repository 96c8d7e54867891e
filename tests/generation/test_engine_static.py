"""The engine's wave decode (static cache, finished rows compacted away) against the reference loop
(``tests.generation.oracle``: a DynamicCache grown by concatenation, every row decoded to the end of
the batch): the same tokens at a fixed seed, behaviour log-probs and entropies within float rounding."""

import torch

import generation.wave as wave_mod

from conf.schema import EngineOptions, ModelConfig
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from tests.generation.oracle import reference_generate
from generation.records import GenRequest, PromptItem

SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128
)


def _requests(tok, n=12):
    items = [
        PromptItem(f"p{i}", "", "", encode_prompt(tok, f"What is {i}+{i % 3}?\n" + "x" * (i % 5)))
        for i in range(n)
    ]
    return [GenRequest(p, s) for p in items for s in range(3)]


def _frequent_token(engine, reqs) -> int:
    """A token the model samples often, used as EOS so rows finish at many different steps."""
    out = reference_generate(engine, reqs, 8, 1.0, 0)
    counts = torch.bincount(torch.tensor([t for tr in out for t in tr.response_tokens]))
    return int(counts.argmax())


def _assert_same(a, b, tol=1e-5):
    assert [t.response_tokens for t in a] == [t.response_tokens for t in b]
    assert [t.finished for t in a] == [t.finished for t in b]
    for x, y in zip(a, b):
        assert (
            max((abs(p - q) for p, q in zip(x.behaviour_logprobs, y.behaviour_logprobs)), default=0.0) < tol
        )
        assert abs(x.mean_entropy - y.mean_entropy) < tol


def test_static_decode_matches_reference_with_early_stops():
    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(SMALL, tok, seed=0), tok, EngineOptions(capacity=16))
    reqs = _requests(tok)
    engine.eos_id = _frequent_token(engine, reqs)
    for seed in (0, 1, 2):
        ref = [
            t
            for s in range(0, len(reqs), 16)
            for t in reference_generate(engine, reqs[s : s + 16], 40, 1.0, seed)
        ]
        got = engine.generate(reqs, 40, 1.0, seed=seed)
        lengths = sorted(len(t.response_tokens) for t in got)
        assert lengths[0] < lengths[-1] and any(t.finished for t in got) and any(not t.finished for t in got)
        _assert_same(ref, got)
    assert engine.model.config._attn_implementation == "sdpa"  # the decode attention is switched back


def test_static_decode_matches_reference_to_the_cap_and_at_temperature():
    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(SMALL, tok, seed=1), tok)
    engine.eos_id = -1  # no row stops: every step runs the whole batch
    reqs = _requests(tok, 6)
    ref = reference_generate(engine, reqs, 24, 0.7, 3)
    got = engine.generate(reqs, 24, 0.7, seed=3)
    assert all(len(t.response_tokens) == 24 and not t.finished for t in got)
    _assert_same(ref, got)


def test_eager_attention_and_waves_off_decode_through_the_joinable_rows(monkeypatch):
    tok = build_char_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    model.config._attn_implementation = "eager"
    engine = Engine(model, tok)
    waves = []
    monkeypatch.setattr(wave_mod.Wave, "advance", lambda self, k: waves.append(k))
    reqs = _requests(tok, 4)
    _assert_same(reference_generate(engine, reqs, 16, 1.0, 0), engine.generate(reqs, 16, 1.0, seed=0))
    off = Engine(build_tiny_model(SMALL, tok, seed=0), tok, waves=False)
    _assert_same(reference_generate(off, reqs, 16, 1.0, 0), off.generate(reqs, 16, 1.0, seed=0))
    assert waves == []  # neither took the wave path
