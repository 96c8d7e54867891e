"""``generation.kernels``: the native decode step (one C call per step over torch's own sgemm, the
prompt's keys/values shared by its rows) and the native sampling step sample what the torch ops
sample: the same tokens at a fixed seed, behaviour log-probs and entropies within 1e-5, through early
stops (compaction), left padding, grouped-query attention with odd groups, q/k/v biases, head dims
16 and 32, and host decode shards. The build is cached per machine; without a compiler, or with
``LAMINAR_NATIVE_KERNELS=0``, the engine runs on torch ops; bad inputs raise instead of reaching C."""

import pytest
import torch

import generation.wave as wave_mod
from conf.schema import EngineOptions, ModelConfig
from generation import kernels
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from tests.generation.oracle import reference_generate
from generation.records import GenRequest, PromptItem
from tests.generation.test_engine_static import _assert_same, _frequent_token
from tests.generation.test_fused_decode import _qwen2

pytestmark = pytest.mark.usefixtures("one_thread")

if kernels.load() is None:  # no C compiler or no exported sgemm_ on this platform
    pytest.skip("the native decode kernels are not available here", allow_module_level=True)


def _llama(tok, hidden, heads, kv):
    cfg = ModelConfig(
        hidden_size=hidden,
        intermediate_size=96,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv,
        max_seq_len=160,
    )
    return build_tiny_model(cfg, tok, seed=0)


MODELS = {  # head_dim, query heads per KV head
    "llama-d16-g2": lambda tok: _llama(tok, 64, 4, 2),
    "llama-d16-g3": lambda tok: _llama(tok, 48, 3, 1),
    "llama-d32-g1": lambda tok: _llama(tok, 64, 2, 2),
    "qwen2-bias-d16-g2": lambda tok: _qwen2(tok, hidden_size=32, max_positions=160),
}


def _requests(tok, n=11, samples=4):
    # prompts of several lengths (left padding), each sampled by a group of consecutive rows
    items = [
        PromptItem(f"p{i}", "", "", encode_prompt(tok, f"What is {i}+{i % 3}?\n" + "x" * (3 * i % 7)))
        for i in range(n)
    ]
    return [GenRequest(p, s) for p in items for s in range(samples)]


def _count_native_steps(monkeypatch) -> list:
    calls = []
    step = kernels.NativeModel.step

    def counted(self, *a, **kw):
        calls.append(a[0].shape[0])
        return step(self, *a, **kw)

    monkeypatch.setattr(kernels.NativeModel, "step", counted)
    return calls


@pytest.mark.parametrize("name", list(MODELS))
def test_native_step_samples_what_the_torch_ops_sample(name, monkeypatch):
    tok = build_char_tokenizer()
    model = MODELS[name](tok)
    native = Engine(
        model, tok, EngineOptions(capacity=20)
    )  # batches of 20, 20, 4: buffers reused and regrown
    torch_ops = Engine(model, tok, EngineOptions(capacity=20))
    torch_ops.native_kernels = False
    reqs = _requests(tok)
    native.eos_id = torch_ops.eos_id = _frequent_token(native, reqs)  # rows finish at many steps: compaction
    calls = _count_native_steps(monkeypatch)
    for temperature in (1.0, 0.7):
        got = native.generate(reqs, 48, temperature, seed=3)
        _assert_same(torch_ops.generate(reqs, 48, temperature, seed=3), got)
        lengths = sorted(len(t.response_tokens) for t in got)
        assert lengths[0] < lengths[-1] and any(t.finished for t in got) and any(not t.finished for t in got)
    assert calls and min(calls) < 20  # the native step ran, also after rows left the batch
    # and the model's own forward (the reference loop) samples the same
    ref = [
        t for s in range(0, len(reqs), 20) for t in reference_generate(native, reqs[s : s + 20], 48, 1.0, 3)
    ]
    assert [t.response_tokens for t in ref[:20]] == [
        t.response_tokens for t in native.generate(reqs, 48, 1.0, seed=3)[:20]
    ]


def test_native_shards_sample_what_one_shard_samples(monkeypatch):
    monkeypatch.setattr(wave_mod, "MIN_SHARD_ROWS", 4)
    tok = build_char_tokenizer()
    engine = Engine(_llama(tok, 64, 4, 2), tok, EngineOptions(capacity=44))
    reqs = _requests(tok)
    engine.eos_id = _frequent_token(engine, reqs)
    calls = _count_native_steps(monkeypatch)
    runs = {}
    for k in (1, 3):
        engine.decode_threads = k
        runs[k] = engine.generate(reqs, 40, 1.0, seed=1)
    _assert_same(runs[1], runs[3])
    assert 44 in calls and {14, 15} <= set(calls)  # one shard of 44 rows, then three of 14-15


def test_switched_off_or_without_a_compiler_the_engine_runs_on_torch_ops(monkeypatch, tmp_path):
    tok = build_char_tokenizer()
    model = _llama(tok, 64, 4, 2)
    reqs = _requests(tok, 4, 2)
    want = Engine(model, tok).generate(reqs, 20, 1.0, seed=0)
    calls = _count_native_steps(monkeypatch)
    monkeypatch.setenv("LAMINAR_NATIVE_KERNELS", "0")
    _assert_same(want, Engine(model, tok).generate(reqs, 20, 1.0, seed=0))
    monkeypatch.delenv("LAMINAR_NATIVE_KERNELS")
    # a compiler that fails (and an empty cache): a warning, torch ops, the same samples
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setenv("LAMINAR_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")
    assert kernels.load() is None
    _assert_same(want, Engine(model, tok).generate(reqs, 20, 1.0, seed=0))
    assert calls == [] and not list((tmp_path / "cache").glob("*.so"))


def test_the_build_is_cached_per_source_compiler_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("LAMINAR_KERNEL_CACHE", str(tmp_path))
    cc = kernels._compiler()
    path = kernels.build(cc)
    assert path.parent == tmp_path and kernels.build_seconds > 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    stamp = path.stat().st_mtime_ns
    assert kernels.build(cc) == path and kernels.build_seconds == 0.0 and path.stat().st_mtime_ns == stamp
    monkeypatch.setattr(kernels, "FLAGS", kernels.FLAGS + ("-DLAMINAR_OTHER_BUILD",))
    assert kernels.library_path(cc) != path  # other flags (or source, compiler, CPU): another library


def test_bad_inputs_raise_before_reaching_the_kernels():
    tok = build_char_tokenizer()
    engine = Engine(_llama(tok, 64, 4, 2), tok)
    dec = engine._fused(64)
    model = dec.native_model()
    prompt = wave_mod.PromptKV(_prefill(engine, tok), torch.ones(2, 5, dtype=torch.long))
    rows = wave_mod.CompletionKV(prompt, torch.tensor([0, 0, 1]), 10, None)
    caches = model.cache_pointers(prompt, rows)
    pos = torch.tensor([5, 5, 5])
    ok = model.step(torch.tensor([3, 4, 5]), pos, dec._cos, dec._sin, caches, 0)
    assert ok.shape == (3, len(tok)) and torch.isfinite(ok).all()
    with pytest.raises(ValueError, match="out of range"):  # a token id past the vocabulary
        model.step(torch.tensor([3, len(tok), 5]), pos, dec._cos, dec._sin, caches, 1)
    with pytest.raises(ValueError, match="out of range"):  # a position past the rotary tables
        model.step(torch.tensor([3, 4, 5]), torch.tensor([5, 5, 64]), dec._cos, dec._sin, caches, 1)
    with pytest.raises(ValueError, match="out of range"):  # a prompt that is not there
        stray = wave_mod.CompletionKV(prompt, torch.tensor([0, 0, 2]), 10, None)
        model.step(torch.tensor([3, 4, 5]), pos, dec._cos, dec._sin, model.cache_pointers(prompt, stray), 1)
    with pytest.raises(ValueError, match="inputs"):  # a column past the completion buffers
        model.step(torch.tensor([3, 4, 5]), pos, dec._cos, dec._sin, caches, 16)
    with pytest.raises(ValueError, match="inputs"):  # int32 ids
        model.step(torch.tensor([3, 4, 5], dtype=torch.int32), pos, dec._cos, dec._sin, caches, 1)
    with pytest.raises(ValueError, match="float32"):
        model.cache_pointers(wave_mod.PromptKV(_prefill(engine, tok, torch.float64), torch.ones(2, 5)), rows)
    out = wave_mod.Outputs(3, 8)
    with pytest.raises(ValueError, match="rows out of range"):
        dec.native.sample_step(
            ok,
            1.0,
            torch.zeros(3, dtype=torch.long),
            torch.tensor([0, 1, 3]),
            0,
            2,
            out.tokens,
            out.logps,
            out.ent_sum,
            out.lengths,
            out.done,
            torch.empty(3, dtype=torch.long),
            torch.empty(3, dtype=torch.bool),
        )
    with pytest.raises(ValueError, match="float32"):
        dec.native.sample_step(
            ok.double(),
            1.0,
            torch.zeros(3, dtype=torch.long),
            torch.tensor([0, 1, 2]),
            0,
            2,
            out.tokens,
            out.logps,
            out.ent_sum,
            out.lengths,
            out.done,
            torch.empty(3, dtype=torch.long),
            torch.empty(3, dtype=torch.bool),
        )


def _prefill(engine, tok, dtype=torch.float32):
    """A DynamicCache of two 5-token prompts through the engine's model."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([encode_prompt(tok, "1+2=")[:5], encode_prompt(tok, "3+4=")[:5]])
    engine.model(input_ids=ids, past_key_values=cache, use_cache=True)
    if dtype != torch.float32:
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    return cache
