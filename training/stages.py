"""Training stages as plain library functions: build the base model, warm-up SFT, RL.

Each reads its inputs from artifact folders and writes a Hugging Face checkpoint folder into
``out_dir``; the Prefect layer (``tasks/``) handles caching and lineage around them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
import torch
from tqdm.auto import tqdm

from conf.schema import ModelConfig, RLConfig, SFTConfig
from training.model import build_char_tokenizer, build_tiny_model, encode_prompt, encode_response, load_model, save_model
from training.objectives import PRESETS, ObjectiveParams
from training.rl.loop import RLResult, format_step, run_sync
from training.rl.records import PromptItem
from training.sft import SFTExample, train_sft


LOG = logging.getLogger("laminar.training")


def setup_torch(threads: int, seed: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def read_table(path: Path) -> list[dict]:
    import polars as pl

    return pl.read_parquet(path).to_dicts()


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
            raise ValueError(f"model.path={src} has no *.safetensors weights; convert pickled weights "
                             "to safetensors first (pickles are never loaded)")
        for f in sorted(src.iterdir()):
            if f.is_file() and not f.name.endswith(UNSAFE_WEIGHT_SUFFIXES):
                shutil.copy2(f, Path(out_dir) / f.name)
        model, _ = load_model(out_dir)
    else:
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(cfg, tokenizer, seed)
        save_model(model, tokenizer, out_dir)
    return {"parameters": float(sum(p.numel() for p in model.parameters()))}


def warmup(model_dir: Path, data_dir: Path, cfg: SFTConfig, *, template: str, seed: int, device: str,
           out_dir: Path) -> dict[str, float]:
    """Warm-up SFT on the prompt pool's demonstrations (``data.demo_error_rate`` of their steps slip)."""
    model, tokenizer = load_model(model_dir, device)
    rows = [r for r in read_table(Path(data_dir) / "pool.parquet") if r.get("level") in set(cfg.levels)]
    examples = [SFTExample(encode_prompt(tokenizer, template.format(problem=r["problem"])),
                           encode_response(tokenizer, r["demonstration"])) for r in rows]
    with tqdm(total=cfg.steps, desc="warmup sft", unit="step", leave=False) as bar:
        metrics = train_sft(model, examples, steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                            warmup_steps=cfg.warmup_steps, weight_decay=cfg.weight_decay,
                            max_grad_norm=cfg.max_grad_norm, pad_id=tokenizer.pad_token_id, seed=seed,
                            device=device, progress=bar)
    save_model(model.to("cpu"), tokenizer, out_dir)
    return metrics


OVERRIDABLE = ("clip_low", "clip_high", "dual_clip", "dynamic_sampling", "max_sampling_rounds",
               "overlong_shaping", "overlong_filter", "kl_coef")


def objective_params(cfg: RLConfig) -> ObjectiveParams:
    """The algorithm's preset with the config's explicit overrides (None keeps the preset)."""
    overrides = {k: getattr(cfg, k) for k in OVERRIDABLE if getattr(cfg, k) is not None}
    return dataclasses.replace(PRESETS[cfg.algorithm], overlong_cache_len=cfg.overlong_cache_len, **overrides)


def rl(model_dir: Path, data_dir: Path, cfg: RLConfig, *, template: str, seed: int, device: str, out_dir: Path,
       verifier) -> RLResult:
    """RL from the warm-up checkpoint on the prompt pool; writes the final checkpoint, the per-step
    history (``history.jsonl``) and the prompts trained on (``consumed.json``)."""
    model, tokenizer = load_model(model_dir, device)
    rows = read_table(Path(data_dir) / "pool.parquet")
    prompts = [PromptItem(prompt_id=r["prompt_id"], text=r["problem"], answer=r["answer"],
                          prompt_tokens=encode_prompt(tokenizer, template.format(problem=r["problem"])),
                          level=r.get("level")) for r in rows]
    params = objective_params(cfg)
    with tqdm(total=cfg.steps, desc=f"rl {cfg.algorithm}/{cfg.mode}", unit="step", leave=False) as bar:
        def on_step(m: dict) -> None:
            line = format_step(m, cfg.steps)
            bar.update(1)
            bar.write(line)
            LOG.info(line)

        result = run_sync(model, tokenizer, prompts, verifier, params, steps=cfg.steps,
                          prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size, lr=cfg.lr,
                          weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=seed,
                          device=device, on_step=on_step)
    save_model(model.to("cpu"), tokenizer, out_dir)
    with open(Path(out_dir) / "history.jsonl", "w") as f:
        for m in result.history:
            f.write(json.dumps(m, sort_keys=True) + "\n")
    with open(Path(out_dir) / "consumed.json", "w") as f:
        json.dump(dict(sorted(result.consumed.items())), f, indent=1)
    return result
