from pathlib import Path

import pytest

from conf.schema import ModelConfig
from generation.model import build_char_tokenizer, build_tiny_model, load_model, save_model
from training.base import build_base_model


def test_hf_model_path_goes_through_the_same_loading_code(tmp_path):
    src = tmp_path / "some-hf-model"
    tok = build_char_tokenizer()
    save_model(
        build_tiny_model(
            ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1),
            tok,
            0,
        ),
        tok,
        src,
    )
    out = tmp_path / "out"
    out.mkdir()
    metrics = build_base_model(ModelConfig(kind="hf", path=str(src)), 0, out)
    assert metrics["parameters"] > 0
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    model, tokenizer = load_model(out)
    assert tokenizer.decode(tokenizer("1+2", add_special_tokens=False)["input_ids"]) == "1+2"


def test_pickled_weights_are_refused(tmp_path):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"not loaded")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="safetensors"):
        build_base_model(ModelConfig(kind="hf", path=str(src)), 0, out)
    assert not list(Path(out).iterdir())
