"""The base-model stage: build the tiny default from config, or take a local Hugging Face model."""

from __future__ import annotations

from pathlib import Path

from conf.schema import ModelConfig
from generation.model import build_char_tokenizer, build_tiny_model, load_model, save_model


UNSAFE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def build_base_model(cfg: ModelConfig, seed: int, out_dir: Path) -> dict[str, float]:
    """``model=tiny``: build the model and tokenizer from config. ``model=hf``: copy a local
    ``save_pretrained`` folder into the store (safetensors only: pickled weights are refused), so
    the checkpoint's lineage starts from the hash of the exact files."""
    import shutil

    if cfg.kind == "hf":
        src = Path(cfg.path).expanduser()
        if not (src / "config.json").exists():
            raise FileNotFoundError(f"model.path={src} is not a save_pretrained folder (no config.json)")
        if not list(src.glob("*.safetensors")):
            raise ValueError(
                f"model.path={src} has no *.safetensors weights; convert pickled weights "
                "to safetensors first (pickles are never loaded)"
            )
        for f in sorted(src.iterdir()):
            if f.is_file() and not f.name.endswith(UNSAFE_WEIGHT_SUFFIXES):
                shutil.copy2(f, Path(out_dir) / f.name)
        model, _ = load_model(out_dir)
    else:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(cfg, tokenizer, seed)
        save_model(model, tokenizer, out_dir)
    return {"parameters": float(sum(p.numel() for p in model.parameters()))}
