"""Supervised fine-tuning on (prompt, response) token pairs: loss on response tokens only.

Used by the warm-up stage (gold solutions) and, later, by RFT on DART's rejection-sampled data.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class SFTExample:
    """``response_tokens`` end with EOS; the loss covers exactly them."""

    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]


def collate(batch: Sequence[SFTExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), right-padded; labels are -100 outside responses."""
    seqs = [ex.prompt_tokens + ex.response_tokens for ex in batch]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (ex, s) in enumerate(zip(batch, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        labels[i, len(ex.prompt_tokens):len(s)] = torch.tensor(ex.response_tokens)
    return ids, attn, labels


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def train_sft(model, examples: Sequence[SFTExample], *, steps: int, batch_size: int, lr: float,
              warmup_steps: int, weight_decay: float, max_grad_norm: float, pad_id: int, seed: int,
              device: str = "cpu", progress=None) -> dict[str, float]:
    """Train ``model`` in place for ``steps`` optimizer steps; returns loss metrics."""
    if not examples:
        raise ValueError("SFT needs at least one example")
    rng = random.Random(f"sft:{seed}")
    torch.manual_seed(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup_steps, steps))
    order: list[int] = []
    first = last = float("nan")
    ema = None
    for step in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order.extend(fresh)
        idx, order = order[:batch_size], order[batch_size:]
        ids, attn, labels = (t.to(device) for t in collate([examples[i] for i in idx], pad_id))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
        value = float(loss.detach())
        first = value if step == 0 else first
        ema = value if ema is None else 0.9 * ema + 0.1 * value
        last = value
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    return {"sft_loss_first": first, "sft_loss_last": last, "sft_loss_ema": ema if ema is not None else float("nan"),
            "sft_steps": float(steps), "sft_examples": float(len(examples))}
