"""The engine's calls into the model, apart from its scheduling: a left-padded prefill, a model's
weights replaced strictly, a trajectory decoded into its record, HIVE's prompt entropy.

``generation.engine.Engine`` (and through it the row layouts of ``generation.rows`` and
``generation.wave``) calls these with its model, tokenizer and special ids.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from generation.records import GenRequest, PromptItem, Trajectory


def left_padded(seqs, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) on ``device``, left-padded with ``pad_id``: every
    sequence's next token is at the end."""
    bsz, width = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
        attn[i, width - len(s) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    return ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


def last_logits_only(model) -> dict:
    """The keyword that makes ``model``'s forward compute only the last position's logits
    (``logits_to_keep=1``), or none when its forward takes no such argument. A prefill needs no
    other position's logits, and the full [B, T, V] tensor is most of a large-vocabulary model's
    prefill (SmolLM2 at 64 x 64 prompt tokens, bf16, one thread: 2.4-2.6 s with it, 1.6-2.0 s
    without); fp32 logits at the last position are bit-identical either way."""
    forward = getattr(model, "forward", None)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def prefill(model, seqs: list[list[int]], pad_id: int, device):
    """One left-padded forward of ``model`` over ``seqs``: (fresh DynamicCache, attention mask [B, W],
    logits at each row's last position [B, V]), only that position's logits computed
    (``last_logits_only``). Padded columns' keys/values are zeroed."""
    from transformers import DynamicCache

    ids, attn, positions = left_padded(seqs, pad_id, device)
    cache = DynamicCache()
    logits = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        **last_logits_only(model),
    ).logits[:, -1, :]
    if not bool(attn.all()):
        pad = (attn == 0)[:, None, :, None]
        for layer in cache.layers:
            layer.keys = layer.keys.masked_fill(pad, 0.0)
            layer.values = layer.values.masked_fill(pad, 0.0)
    return cache, attn, logits


def replace_weights(model, state: Mapping[str, np.ndarray]) -> None:
    """Replace every parameter of ``model`` by the named arrays ``state``, strictly: the same names and
    shapes as the model's state dict, checked before anything is written. A LoRA adapter version
    (``generation.adapter``) is merged into the model instead."""
    from generation.adapter import is_adapter_state, merge_adapter

    if is_adapter_state(state):
        merge_adapter(model, state)
        return
    current = model.state_dict()
    missing, unexpected = set(current) - set(state), set(state) - set(current)
    if missing or unexpected:
        raise KeyError(f"load_state: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(current[k].shape):
            raise ValueError(
                f"load_state: {k} has shape {tuple(v.shape)}, model has {tuple(current[k].shape)}"
            )
    tensors = {k: torch.from_numpy(v if v.flags.writeable else np.array(v)) for k, v in state.items()}
    with torch.no_grad():
        model.load_state_dict(tensors, strict=True)


def trajectory(
    tokenizer,
    eos_id: int,
    req: GenRequest,
    ids: list[int],
    logps: list[float],
    version: int,
    last_version: int,
    ent_sum: float,
) -> Trajectory:
    """The record of ``req``'s response ``ids`` (finished when it ends with ``eos_id``, whose text
    leaves it out) with its behaviour log-probs, versions and entropy sum."""
    finished = bool(ids) and ids[-1] == eos_id
    body = ids[:-1] if finished else ids
    return Trajectory(
        kind="trajectory",
        prompt=req.prompt,
        sample_idx=req.sample_idx,
        response_tokens=tuple(int(i) for i in ids),
        behaviour_logprobs=tuple(np.asarray(logps, dtype=np.float64).tolist()),
        version=version,
        finished=finished,
        text=tokenizer.decode(body, skip_special_tokens=True),
        mean_entropy=ent_sum / max(1, len(ids)),
        group_uid=req.group_uid,
        last_version=last_version,
    )


@torch.inference_mode()
def prompt_entropy(model, prompts: Sequence[PromptItem], pad_id: int, device, chunk_size: int) -> list[float]:
    """HIVE's prompt entropy V(x): the mean, over prompt positions 2..L, of the full-vocabulary
    entropy of ``model``'s next-token distribution (temperature 1). One forward pass per
    ``chunk_size`` prompts, no generation."""
    out: list[float] = []
    for start in range(0, len(prompts), chunk_size):
        chunk = prompts[start : start + chunk_size]
        width = max(len(p.prompt_tokens) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # right padding: positions need no shift
            ids[i, : len(p.prompt_tokens)] = torch.tensor(p.prompt_tokens)
            attn[i, : len(p.prompt_tokens)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=attn.to(device)).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        ent = -(logp.exp() * logp).nan_to_num().sum(-1).cpu()  # [B, width-1]: predicting tokens 2..width
        mask = attn[:, 1:].float()
        out.extend((ent * mask).sum(1).div(mask.sum(1).clamp(min=1)).tolist())
    return out
