"""The warm-up stage: SFT on the prompt pool's demonstrations."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from conf.schema import SFTConfig
from training.model import encode_prompt, encode_response, load_model, save_model
from training.setup import read_table
from training.sft import SFTExample, train_sft


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
