"""``generation.pretrained``: a GGUF file dequantised into a plain safetensors folder that ``model=hf``
loads, on a tiny Llama GGUF the test writes itself (the real model's wheel is never needed here)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conf.loader import load_config
from conf.schema import ConfigError

GGUF_MISSING = "the gguf package is not installed (requirements.txt pins gguf==0.19.0: reinstall the venv)"

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 2, 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet (the 256 characters its BPE vocabularies start from)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def write_tiny_gguf(gguf, path, rng) -> dict[str, np.ndarray]:
    """A two-layer Llama GGUF (Q8_0 embeddings and value projections, f32 elsewhere) with a byte-level
    BPE tokenizer and a chat template; returns the dequantised values of the quantised tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_tokens() + ["Ġt", "he"]
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    quantised: dict[str, np.ndarray] = {}

    def tensor(name: str, shape: tuple[int, ...], quant: bool = False) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * 0.05
        if not quant:
            w.add_tensor(name, data)
            return
        q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        quantised[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    tensor("token_embd.weight", (len(tokens), HIDDEN), quant=True)
    tensor("output_norm.weight", (HIDDEN,))
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        for name, shape in (
            ("attn_q", (HIDDEN, HIDDEN)),
            ("attn_k", (kv, HIDDEN)),
            ("attn_output", (HIDDEN, HIDDEN)),
            ("ffn_gate", (FFN, HIDDEN)),
            ("ffn_up", (FFN, HIDDEN)),
            ("ffn_down", (HIDDEN, FFN)),
            ("attn_norm", (HIDDEN,)),
            ("ffn_norm", (HIDDEN,)),
        ):
            tensor(f"blk.{i}.{name}.weight", shape)
        tensor(f"blk.{i}.attn_v.weight", (kv, HIDDEN), quant=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return quantised


def test_dequantise_writes_a_plain_safetensors_folder_model_hf_loads(tmp_path):
    import torch

    gguf = pytest.importorskip("gguf", reason=GGUF_MISSING)
    from generation.model import encode_prompt, load_model
    from generation.pretrained import dequantise

    gguf_file = tmp_path / "tiny.gguf"
    quantised = write_tiny_gguf(gguf, gguf_file, np.random.default_rng(0))
    out = tmp_path / "model"
    shape = dequantise(gguf_file, out)

    assert shape["layers"] == LAYERS and shape["hidden"] == HIDDEN
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model, tok = load_model(out)
    assert model.config.num_key_value_heads == KV_HEADS and model.config.tie_word_embeddings
    # the quantised tensors come back as exactly their dequantised values (fp32)
    emb = model.model.embed_tokens.weight.detach().numpy()
    np.testing.assert_array_equal(emb, quantised["token_embd.weight"])
    v = model.model.layers[1].self_attn.v_proj.weight.detach().numpy()
    np.testing.assert_array_equal(v, quantised["blk.1.attn_v.weight"])
    # the tokenizer and its chat template came along: a prompt renders and the model runs on it
    ids = encode_prompt(tok, "the")
    assert tok.decode(list(ids)).startswith("<|im_start|>user\nthe<|im_end|>")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits).all()


def test_model_smollm2_composes_and_pretrained_names_are_checked():
    cfg = load_config(["model=smollm2"])
    assert (cfg.model.kind, cfg.model.pretrained, cfg.model.path) == ("hf", "smollm2", None)
    with pytest.raises(ConfigError, match="model.pretrained='nope'"):
        load_config(["model=hf", "model.pretrained=nope"])
    with pytest.raises(ConfigError, match="needs model.kind=hf"):
        load_config(["model.pretrained=smollm2"])


def test_registry_matches_the_config_names():
    from conf.schema import PRETRAINED_MODELS
    from generation.pretrained import PRETRAINED

    assert sorted(PRETRAINED) == sorted(PRETRAINED_MODELS)


def test_the_converter_pin_is_the_one_requirements_pin():
    """``laminar model fetch`` installs the same gguf the test environment has (requirements.txt)."""
    import re
    from pathlib import Path

    from generation.pretrained import PRETRAINED

    text = (Path(__file__).resolve().parents[2] / "requirements.txt").read_text()
    pins = dict(re.findall(r"^([\w-]+)==(\S+)$", text, re.M))
    for spec in PRETRAINED.values():
        assert pins.get(spec.converter.name) == spec.converter.version
