"""Supervised fine-tuning on (prompt, response) token pairs: loss on response tokens only.

Used by the warm-up stage (gold solutions) and, later, by RFT on DART's rejection-sampled data.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from collections.abc import Iterator, Mapping, Sequence

import torch

from training.finite import check_finite


@dataclass(frozen=True)
class SFTExample:
    """``response_tokens`` end with EOS; the loss covers exactly them, less those ``loss_mask`` marks 0
    (a tool demonstration's observation tokens; empty: every response token)."""

    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    loss_mask: tuple[int, ...] = ()

    def labels(self) -> torch.Tensor:
        """The response's labels: its tokens, -100 where ``loss_mask`` is 0."""
        out = torch.tensor(self.response_tokens)
        if self.loss_mask:
            out = out.masked_fill(torch.tensor(self.loss_mask) == 0, -100)
        return out


def collate(batch: Sequence[SFTExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), right-padded; labels are -100 outside responses."""
    seqs = [ex.prompt_tokens + ex.response_tokens for ex in batch]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (ex, s) in enumerate(zip(batch, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        labels[i, len(ex.prompt_tokens) : len(s)] = ex.labels()
    return ids, attn, labels


PACK_WIDTH = 256
"""Shortest row that ``pack`` fills (tokens); a longer example gets a row of its own length."""


def pack(
    batch: Sequence[SFTExample], pad_id: int, width: int = PACK_WIDTH
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, labels): the examples packed first-fit-decreasing into rows of
    ``max(width, longest)`` tokens, each example's positions counting from 0, labels -100 outside
    responses. Fed with ``attention_mask=None`` (and no KV cache), a transformers model reads the
    position resets as sequence boundaries and attends within each example only, so the loss is the
    padded batch's (``collate``) without computing its padding: on the default task a third of a
    padded batch is padding."""
    seqs = [ex.prompt_tokens + ex.response_tokens for ex in batch]
    width = max(width, max(len(s) for s in seqs))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        r = next((r for r, left in enumerate(room) if left >= len(seqs[i])), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= len(seqs[i])
    used = max(width - left for left in room)
    ids = torch.full((len(rows), used), pad_id, dtype=torch.long)
    pos = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            s, n_prompt = seqs[i], len(batch[i].prompt_tokens)
            ids[r, at : at + len(s)] = torch.tensor(s)
            pos[r, at : at + len(s)] = torch.arange(len(s))
            labels[r, at + n_prompt : at + len(s)] = batch[i].labels()
            at += len(s)
        pos[r, at:] = torch.arange(used - at)  # the tail's padding: one more "sequence", no labels
    return ids, pos, labels


def packing_matches(model, batch: Sequence[SFTExample], pad_id: int, device: str, tol: float = 1e-4) -> bool:
    """Whether ``model`` gives a packed batch the padded batch's loss: true for transformers models
    whose attention honours packed ``position_ids``; a model that attends across the packed examples
    (or ignores ``position_ids``) differs, and ``train_sft`` then pads."""
    was_training = model.training
    model.eval()  # no dropout in the comparison
    with torch.no_grad():
        ids, attn, labels = (t.to(device) for t in collate(batch, pad_id))
        padded = float(model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss)
        ids, pos, labels = (t.to(device) for t in pack(batch, pad_id))
        packed = float(model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss)
    model.train(was_training)
    return abs(packed - padded) <= tol * max(1.0, abs(padded))


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def _batches(n: int, batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Example indices, ``batch_size`` at a time, drawn in order from successive shuffles of all ``n``."""
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(n))
            rng.shuffle(fresh)
            order.extend(fresh)
        idx, order = order[:batch_size], order[batch_size:]
        yield idx


def _model_inputs(batch: Sequence[SFTExample], pad_id: int, device: str, packed: bool) -> dict:
    """The model's keyword arguments for ``batch``: packed rows (``pack``) or padded ones (``collate``)."""
    if packed:
        ids, pos, labels = (t.to(device) for t in pack(batch, pad_id))
        return {"input_ids": ids, "position_ids": pos, "labels": labels, "use_cache": False}
    ids, attn, labels = (t.to(device) for t in collate(batch, pad_id))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def _adamw(model, lr: float, weight_decay: float, warmup_steps: int, steps: int):
    """AdamW over the trainable parameters (a PEFT model's frozen base has requires_grad False: the
    optimizer and its state hold only the adapters) and its warm-up then cosine schedule."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr,
        weight_decay=weight_decay,
        betas=(0.9, 0.95),
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup_steps, steps))


@dataclass
class _LossTrace:
    """The first and last step losses and their exponential moving average (weight 0.1 on the new)."""

    first: float = float("nan")
    last: float = float("nan")
    ema: float | None = None

    def add(self, value: float) -> None:
        self.first = value if self.ema is None else self.first
        self.ema = value if self.ema is None else 0.9 * self.ema + 0.1 * value
        self.last = value

    def metrics(self) -> dict[str, float]:
        return {
            "sft_loss_first": self.first,
            "sft_loss_last": self.last,
            "sft_loss_ema": self.ema if self.ema is not None else float("nan"),
        }


def _optimizer_step(model, opt, sched, inputs: dict, max_grad_norm: float, where: str, keys) -> float:
    """One forward, backward and optimizer step on ``inputs``, the loss and the gradient norm checked
    finite first; returns the loss."""
    loss = model(**inputs).loss
    value = float(loss.detach())
    check_finite(where, keys, loss=value)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    check_finite(where, keys, gradient_norm=float(norm))
    opt.step()
    sched.step()
    return value


def _check_trained(model, opt, inputs: dict, where: str, keys) -> None:
    """Check the loss and gradient norm of the trained weights on ``inputs``; changes no weight."""
    loss = model(**inputs).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)  # measures, changes nothing
    opt.zero_grad(set_to_none=True)
    check_finite(where, keys, loss=float(loss.detach()), gradient_norm=float(norm))


def train_sft(
    model,
    examples: Sequence[SFTExample],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    weight_decay: float,
    max_grad_norm: float,
    pad_id: int,
    seed: int,
    device: str = "cpu",
    progress=None,
    stage: str = "sft",
    keys: Mapping[str, object] | None = None,
    packing: bool = True,
) -> dict[str, float]:
    """Train ``model`` in place for ``steps`` optimizer steps; returns loss metrics.

    Every step checks its loss (before the backward pass) and its gradient norm (before the
    optimizer step), and the trained model's loss and gradient norm on the last batch are checked
    once more (weights that the last step blew up can still give a finite loss). A non-finite value
    raises ``training.finite.NonFiniteError`` naming ``stage``, the step and ``keys`` (the config
    keys behind the optimizer settings, with their values; default: the arguments' names), so the
    caller saves nothing.

    ``packing`` (default) packs each batch's examples into few rows (``pack``) instead of padding
    them to the longest, once checked on the first batch to give the padded loss (``packing_matches``;
    a model for which it does not is trained on padded batches, and the metrics say ``sft_packed`` 0)."""
    if keys is None:
        keys = {"lr": lr, "max_grad_norm": max_grad_norm, "weight_decay": weight_decay}
    if not examples:
        raise ValueError("SFT needs at least one example")
    rng = random.Random(f"sft:{seed}")
    torch.manual_seed(seed)
    model.to(device).train()
    opt, sched = _adamw(model, lr, weight_decay, warmup_steps, steps)
    trace = _LossTrace()
    packed = None
    for step, idx in zip(range(steps), _batches(len(examples), batch_size, rng)):
        batch = [examples[i] for i in idx]
        if packed is None:
            packed = packing and packing_matches(model, batch, pad_id, device)
        inputs = _model_inputs(batch, pad_id, device, packed)
        where = f"stage {stage}, SFT step {step + 1}/{steps}"
        trace.add(_optimizer_step(model, opt, sched, inputs, max_grad_norm, where, keys))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{trace.ema:.3f}")
    if steps > 0:  # the weights the last step left, which the caller saves: one more forward and backward
        where = f"stage {stage}, after SFT step {steps}/{steps} (the trained model on the last batch)"
        _check_trained(model, opt, inputs, where, keys)
    model.eval()
    sizes = {"sft_steps": float(steps), "sft_examples": float(len(examples))}
    return {**trace.metrics(), **sizes, "sft_packed": float(bool(packed))}
