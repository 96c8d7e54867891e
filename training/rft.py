"""Rejection fine-tuning (RFT): SFT on the model's own verified-correct responses (DART's data)."""

from __future__ import annotations

from pathlib import Path

from tqdm.auto import tqdm

from conf.schema import LoraConfig, RFTConfig
from generation.model import encode_problem, encode_response
from training.lora import load_trainable, save_trained
from generation.setup import read_table
from training.sft import SFTExample, train_sft


def rft_examples(rows: list[dict], tokenizer, template: str) -> list[SFTExample]:
    """RFT's training examples: a single-turn response encoded after its prompt; a whole episode (DART
    under a multi-turn ``env``: a row with ``response_tokens``) exactly as it ran, the tokens the engine
    consumed, with its ``loss_mask`` (1 on the policy's turns, 0 on the tool results and other
    observations), so RFT learns the model's turns, tool calls included, and never the observations."""
    out = []
    for r in rows:
        if r.get("response_tokens") is not None:
            out.append(
                SFTExample(tuple(r["prompt_tokens"]), tuple(r["response_tokens"]), tuple(r["loss_mask"]))
            )
        else:
            out.append(
                SFTExample(
                    encode_problem(tokenizer, template, r["problem"]),
                    encode_response(tokenizer, r["response"]),
                )
            )
    return out


def rft(
    model_dir: Path,
    rft_path: Path,
    cfg: RFTConfig,
    *,
    template: str,
    seed: int,
    device: str,
    out_dir: Path,
    lora: LoraConfig | None = None,
) -> dict[str, float]:
    """Fine-tune the model on ``rft.parquet`` (problem, response; or whole episodes with their loss
    masks: ``rft_examples``). With ``cfg.steps == 0`` or no
    correct response to learn from, the model passes through unchanged (and says so)."""
    model, tokenizer, _ = load_trainable(model_dir, lora, "rft", device=device, seed=seed)
    examples = rft_examples(read_table(Path(rft_path)), tokenizer, template)
    metrics: dict[str, float] = {"rft_examples": float(len(examples)), "rft_steps": 0.0}
    if cfg.steps > 0 and examples:
        with tqdm(total=cfg.steps, desc="rft", unit="step", leave=False, disable=None) as bar:
            m = train_sft(
                model,
                examples,
                steps=cfg.steps,
                batch_size=cfg.batch_size,
                lr=cfg.lr,
                warmup_steps=cfg.warmup_steps,
                weight_decay=0.0,
                max_grad_norm=1.0,
                pad_id=tokenizer.pad_token_id,
                seed=seed,
                device=device,
                progress=bar,
                stage="rft",
                keys={"curation.rft.lr": cfg.lr, "curation.rft.warmup_steps": cfg.warmup_steps},
            )
        metrics.update(
            {
                "rft_steps": float(cfg.steps),
                "rft_loss_first": m["sft_loss_first"],
                "rft_loss_ema": m["sft_loss_ema"],
            }
        )
    save_trained(model.to("cpu"), tokenizer, out_dir)
    return metrics
