"""Models and tokenizers: build the tiny default from config, load any local HF causal LM.

The tiny model is a Llama-architecture ``LlamaForCausalLM`` with a character-level tokenizer
(``tokenizers`` WordLevel over single characters, wrapped as ``PreTrainedTokenizerFast``). Both are
saved with ``save_pretrained`` (safetensors) and loaded back through ``AutoModelForCausalLM`` /
``AutoTokenizer`` from a path, exactly like a real checkpoint.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHARSET = string.digits + string.ascii_letters + " +-*/=?:.,()#\n"
SPECIAL = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}


def build_char_tokenizer(charset: str = CHARSET):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL.values())}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **SPECIAL)


def build_tiny_model(model_cfg, tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=model_cfg.max_seq_len,
        rope_theta=model_cfg.rope_theta,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_model(model, tokenizer, out_dir: Path) -> None:
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def load_model(path: str | Path, device: str = "cpu"):
    """(model, tokenizer) from a ``save_pretrained`` folder; weights only through safetensors. A PEFT
    adapter folder (``generation.adapter``) gives its base with the adapter merged in."""
    from transformers import AutoModelForCausalLM

    from generation.adapter import is_adapter_dir

    if is_adapter_dir(path):
        return load_merged_adapter(path, device)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, dtype=torch.float32)
    return model.to(device), tokenizer


def check_adapter_weights(path: str | Path) -> None:
    """An adapter folder's weights must be safetensors (PEFT would unpickle ``adapter_model.bin``)."""
    if not (Path(path) / "adapter_model.safetensors").is_file():
        raise ValueError(
            f"adapter {path} has no adapter_model.safetensors; pickled adapter weights are never loaded"
        )


def load_merged_adapter(path: str | Path, device: str = "cpu"):
    """(base with the PEFT adapter in ``path`` merged, tokenizer): a plain model, as fast as the base."""
    from peft import PeftModel

    from generation.adapter import base_dir

    check_adapter_weights(path)
    base, tokenizer = load_model(base_dir(path), device)
    if (Path(path) / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(path)
    merged = PeftModel.from_pretrained(base, str(path), is_trainable=False).merge_and_unload()
    return merged.to(device).eval(), tokenizer


def load_tokenizer(path: str | Path):
    """The tokenizer of a ``save_pretrained`` folder (pad falls back to EOS), without its weights."""
    from transformers import AutoTokenizer

    from generation.adapter import base_dir, is_adapter_dir

    if is_adapter_dir(path) and not (Path(path) / "tokenizer_config.json").is_file():
        path = base_dir(path)

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def encode_prompt(tokenizer, text: str) -> tuple[int, ...]:
    """Prompt token ids: the tokenizer's chat template when it has one, else BOS + text."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return tuple(int(i) for i in ids)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return tuple(bos + list(ids))


def encode_problem(tokenizer, template: str, problem: str) -> tuple[int, ...]:
    """``encode_prompt`` of ``template`` with ``{problem}`` replaced (only that placeholder, so
    templates such as ``\\boxed{}`` need no brace escaping)."""
    return encode_prompt(tokenizer, template.replace("{problem}", problem))


def encode_response(tokenizer, text: str) -> tuple[int, ...]:
    """Response token ids ending with EOS (the SFT target)."""
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
