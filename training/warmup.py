"""The warm-up stage: SFT on the curated prompt pool's demonstrations."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from conf.schema import LoraConfig, SFTConfig
from generation.model import encode_problem, encode_response
from training.lora import load_trainable, save_trained
from generation.setup import read_table
from training.sft import SFTExample, train_sft


def target(row: dict) -> str:
    """What warm-up imitates: the demonstration when the pool has one, else the worked solution, else
    just the final answer in the ``#### <answer>`` form the verifier reads."""
    for key in ("demonstration", "solution"):
        if row.get(key):
            return row[key]
    return f"#### {row['answer']}"


def warmup(
    model_dir: Path,
    prompts_path: Path,
    cfg: SFTConfig,
    *,
    template: str,
    seed: int,
    device: str,
    out_dir: Path,
    lora: LoraConfig | None = None,
) -> dict[str, float]:
    """Warm-up SFT on the curated pool's demonstrations (for the synthetic task ``data.demo_error_rate``
    of their steps slip); prompts without a level are always used, the others when in ``cfg.levels``."""
    model, tokenizer, _ = load_trainable(model_dir, lora, "warmup", device=device, seed=seed)
    rows = [
        r
        for r in read_table(Path(prompts_path))
        if r.get("level") is None or r.get("level") in set(cfg.levels)
    ]
    examples = [
        SFTExample(encode_problem(tokenizer, template, r["problem"]), encode_response(tokenizer, target(r)))
        for r in rows
    ]
    with tqdm(total=cfg.steps, desc="warmup sft", unit="step", leave=False, disable=None) as bar:
        metrics = train_sft(
            model,
            examples,
            steps=cfg.steps,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm,
            pad_id=tokenizer.pad_token_id,
            seed=seed,
            device=device,
            progress=bar,
            stage="warmup",
            keys={
                "sft.lr": cfg.lr,
                "sft.max_grad_norm": cfg.max_grad_norm,
                "sft.weight_decay": cfg.weight_decay,
                "sft.warmup_steps": cfg.warmup_steps,
            },
        )
    save_trained(model.to("cpu"), tokenizer, out_dir)
    return metrics
