"""Host decode shards (``TorchEngine.decode_threads``): a batch's rows decoded side by side in several
threads sample exactly what one shard samples (the same noise per row, drawn in step order from the
one generator, which ends in the same state), with log-probs within float rounding."""

import pytest
import torch

import generation.engine as engine_mod
from generation.engine import TorchEngine
from generation.model import build_char_tokenizer, build_tiny_model
from tests.generation.test_engine_static import SMALL, _assert_same, _frequent_token, _requests


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(engine_mod, "MIN_SHARD_ROWS", 4)


@pytest.mark.parametrize("fused", [True, False])
def test_shards_sample_what_one_shard_samples(small_shards, fused):
    tok = build_char_tokenizer()
    engine = TorchEngine(build_tiny_model(SMALL, tok, seed=0), tok, batch_size=20, fused_decode=fused)
    reqs = _requests(tok)  # 36 rows: batches of 20 and 16
    engine.eos_id = _frequent_token(engine, reqs)
    threads = torch.get_num_threads()
    for seed in (0, 1):
        runs = {}
        for k in (1, 3):
            engine.decode_threads = k
            runs[k] = engine.generate(reqs, 40, 1.0, seed=seed)
        assert len(engine._shards(20)) == 3
        one, three = runs[1], runs[3]
        lengths = sorted(len(t.response_tokens) for t in three)
        assert lengths[0] < lengths[-1] and any(not t.finished for t in three)
        _assert_same(one, three)
        ref = [
            t
            for s in range(0, len(reqs), 20)
            for t in engine._generate_batch_reference(reqs[s : s + 20], 40, 1.0, seed)
        ]
        assert [t.response_tokens for t in ref[:20]] == [t.response_tokens for t in three[:20]]
    assert torch.get_num_threads() == threads
    assert engine.model.config._attn_implementation == "sdpa"  # switched back once, not per shard


def test_a_failing_shard_raises_and_the_engine_stays_usable(small_shards, monkeypatch):
    tok = build_char_tokenizer()
    engine = TorchEngine(build_tiny_model(SMALL, tok, seed=0), tok, batch_size=36)
    engine.decode_threads = 2
    reqs = _requests(tok)
    original = TorchEngine._decode_rows

    def failing(self, rows, *a, **kw):
        if int(rows[0]) > 0:
            raise RuntimeError("shard died")
        return original(self, rows, *a, **kw)

    monkeypatch.setattr(TorchEngine, "_decode_rows", failing)
    with pytest.raises(RuntimeError, match="shard died"):
        engine.generate(reqs, 16, 1.0, seed=0)
    monkeypatch.setattr(TorchEngine, "_decode_rows", original)
    got = engine.generate(reqs, 16, 1.0, seed=0)
    engine.decode_threads = 1
    _assert_same(engine.generate(reqs, 16, 1.0, seed=0), got)
