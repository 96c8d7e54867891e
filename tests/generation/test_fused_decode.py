"""``generation.fused_decode``: the wave's decode (the native step over the fused weights where it
applies, else the model's forward over the static cache) computes what the model computes.

Against the reference loop (``Engine._generate_batch_reference``: the model's own forward over a
growing cache) the engine samples the same tokens at a fixed seed, with behaviour log-probs and
entropies within 1e-5, for Llama (power-of-two attention scale, folded into q) and Qwen2 (q/k/v
biases, a scale that is not a power of two); new weights reach it (loaded versions and in-place
edits); models it does not reproduce fall back to the model's forward."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conf.schema import EngineOptions, ModelConfig
from generation import kernels
from generation.engine import Engine
from generation.fused_decode import fused_decoder
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from tests.generation.oracle import reference_generate
from generation.records import GenRequest, PromptItem, WeightsUpdate
from test_engine_static import _assert_same

SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128
)
HEAD16 = ModelConfig(
    hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=128
)


def _requests(tok, n=10, samples=3):
    items = [
        PromptItem(f"p{i}", "", "", encode_prompt(tok, f"What is {i}+{i % 3}?\n" + "x" * (i % 4)))
        for i in range(n)
    ]
    return [GenRequest(p, s) for p in items for s in range(samples)]


def _reference(engine, reqs, max_new, temperature, seed):
    bs = engine.capacity
    return [
        t
        for s in range(0, len(reqs), bs)
        for t in reference_generate(engine, reqs[s : s + bs], max_new, temperature, seed)
    ]


def _qwen2(tok, seed=0, hidden_size=48, max_positions=128):
    """A tiny Qwen2 (2 query heads, 1 KV head) with non-zero q/k/v biases."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # Qwen2's q/k/v biases start at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_samples_what_the_model_samples(arch):
    tok = build_char_tokenizer()
    model = build_tiny_model(HEAD16, tok, seed=0) if arch == "llama" else _qwen2(tok)
    engine = Engine(
        model, tok, EngineOptions(capacity=8)
    )  # several batches: the kept buffers are reused and regrown
    dec = fused_decoder(model)
    dec.refresh()
    assert dec.scale_folded == (arch == "llama")  # head_dim 16 (scale 1/4) vs 24
    # the native step runs head dims that are multiples of 16; 24 decodes through the model
    assert (engine._fused(64) is not None) == (arch == "llama" and kernels.load() is not None)
    reqs = _requests(tok)
    out = engine.generate(reqs, 30, 0.8, seed=5)
    _assert_same(_reference(engine, reqs, 30, 0.8, 5), out)
    # and the model's own forward over the same static cache (fused off) agrees too
    off = Engine(model, tok, EngineOptions(capacity=8), fused_decode=False)
    _assert_same(off.generate(reqs, 30, 0.8, seed=5), out)


def test_new_weights_reach_the_fused_decoder():
    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(SMALL, tok, seed=0), tok)
    reqs = _requests(tok, 4, 2)
    before = engine.generate(reqs, 20, 1.0, seed=0)
    other = build_tiny_model(SMALL, tok, seed=7)
    engine.load_weights(
        WeightsUpdate(
            kind="weights_update",
            version=3,
            state={k: v.detach().numpy() for k, v in other.state_dict().items()},
        )
    )
    after = engine.generate(reqs, 20, 1.0, seed=0)
    _assert_same(_reference(engine, reqs, 20, 1.0, 0), after)
    assert [t.response_tokens for t in after] != [t.response_tokens for t in before]
    with torch.no_grad():  # an in-place edit of one weight (what an optimizer step does) is picked up too
        engine.model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    edited = engine.generate(reqs, 20, 1.0, seed=0)
    _assert_same(_reference(engine, reqs, 20, 1.0, 0), edited)
    assert [t.behaviour_logprobs for t in edited] != [t.behaviour_logprobs for t in after]


def test_models_it_does_not_reproduce_decode_through_the_model():
    tok = build_char_tokenizer()
    scaled = build_tiny_model(SMALL, tok, seed=0)
    scaled.config.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}  # depends on the sequence length
    assert fused_decoder(scaled) is None
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(build_tiny_model(SMALL, tok, seed=0), LoraConfig(r=2, target_modules=["q_proj"]))
    assert fused_decoder(wrapped) is None and fused_decoder(wrapped.base_model.model) is None  # LoRA layers
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert fused_decoder(gpt2) is None
    engine = Engine(scaled, tok)
    reqs = _requests(tok, 3, 2)
    _assert_same(_reference(engine, reqs, 12, 1.0, 1), engine.generate(reqs, 12, 1.0, seed=1))
