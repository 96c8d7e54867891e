"""Host decode shards (``Engine.decode_threads``): a wave's rows decoded side by side in several
threads sample exactly what one shard samples (the sampler's noise is per row), with log-probs within
float rounding; a shard that fails raises and leaves the engine usable."""

import pytest
import torch

import generation.wave as wave_mod
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model
from tests.generation.oracle import reference_generate
from tests.generation.test_engine_static import SMALL, _assert_same, _frequent_token, _requests
from conf.schema import EngineOptions


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(wave_mod, "MIN_SHARD_ROWS", 4)


@pytest.mark.parametrize("fused", [True, False])
def test_shards_sample_what_one_shard_samples(small_shards, fused):
    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(SMALL, tok, seed=0), tok, EngineOptions(capacity=20), fused_decode=fused)
    reqs = _requests(tok)  # 36 rows: batches of 20 and 16
    engine.eos_id = _frequent_token(engine, reqs)
    threads = torch.get_num_threads()
    for seed in (0, 1):
        runs = {}
        for k in (1, 3):
            engine.decode_threads = k
            runs[k] = engine.generate(reqs, 40, 1.0, seed=seed)
        assert len(wave_mod.shard_rows(20, "cpu", engine.decode_threads)) == 3
        one, three = runs[1], runs[3]
        lengths = sorted(len(t.response_tokens) for t in three)
        assert lengths[0] < lengths[-1] and any(not t.finished for t in three)
        _assert_same(one, three)
        ref = [
            t
            for s in range(0, len(reqs), 20)
            for t in reference_generate(engine, reqs[s : s + 20], 40, 1.0, seed)
        ]
        assert [t.response_tokens for t in ref[:20]] == [t.response_tokens for t in three[:20]]
    assert torch.get_num_threads() == threads
    assert engine.model.config._attn_implementation == "sdpa"  # switched back once, not per shard


def test_a_failing_shard_raises_and_the_engine_stays_usable(small_shards, monkeypatch):
    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(SMALL, tok, seed=0), tok, EngineOptions(capacity=36))
    engine.decode_threads = 2
    reqs = _requests(tok)
    original = wave_mod.Wave._decode

    def failing(self, shard, *a):
        loop = original(self, shard, *a)
        if int(shard.rows[0]) == 0:
            return loop

        def dies():
            next(loop)
            raise RuntimeError("shard died")
            yield

        return dies()

    monkeypatch.setattr(wave_mod.Wave, "_decode", failing)
    with pytest.raises(RuntimeError, match="shard died"):
        engine.generate(reqs, 16, 1.0, seed=0)
    assert engine.status()["active"] == 0 and engine.status()["queued"] == 0
    monkeypatch.setattr(wave_mod.Wave, "_decode", original)
    got = engine.generate(reqs, 16, 1.0, seed=0)
    engine.decode_threads = 1
    _assert_same(engine.generate(reqs, 16, 1.0, seed=0), got)
