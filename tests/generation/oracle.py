"""The reference decode loop the engine's tests compare against: the model's own forward over a
``DynamicCache`` grown by concatenation, every row decoded until the whole batch is done, tokens
drawn by ``generation.sampler``. Slow and plain on purpose; not part of the engine."""

from __future__ import annotations

import torch

from generation.records import GenRequest, Trajectory
from generation.sampler import row_keys, sample


@torch.inference_mode()
def reference_generate(
    engine, requests: list[GenRequest], max_new_tokens: int, temperature: float, seed: int
) -> list[Trajectory]:
    """What ``engine.generate(requests, max_new_tokens, temperature, seed=seed)`` must return, computed
    with ``engine``'s model, tokenizer, EOS and padding but none of its decode paths."""
    from transformers import DynamicCache

    device = engine.device
    input_ids, attn, positions = engine._left_padded([r.prompt.prompt_tokens for r in requests])
    bsz = input_ids.shape[0]
    cache = DynamicCache()
    tokens = torch.empty((bsz, max_new_tokens), dtype=torch.long)
    logps = torch.zeros((bsz, max_new_tokens))
    ent_sum = torch.zeros(bsz, dtype=torch.float64)
    lengths = torch.full((bsz,), max_new_tokens, dtype=torch.long)
    done = torch.zeros(bsz, dtype=torch.bool)
    step_ids, step_pos = input_ids, positions
    keys = row_keys(seed, requests)
    for t in range(max_new_tokens):
        logits = engine.model(
            input_ids=step_ids,
            attention_mask=attn,
            position_ids=step_pos,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1, :]
        nxt, lp, ent = sample(logits.cpu(), temperature, keys, torch.full((bsz,), t))
        ent_sum += torch.where(done, 0.0, ent)
        tokens[:, t] = nxt
        logps[:, t] = lp
        newly = (nxt == engine.eos_id) & ~done
        lengths[newly] = t + 1
        done |= newly
        if bool(done.all()):
            break
        step_ids = nxt[:, None].to(device)
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=device)], dim=1)
    return [
        engine._trajectory(
            r, tokens[i, :n].tolist(), logps[i, :n].tolist(), engine.version, engine.version, float(e)
        )
        for i, (r, n, e) in enumerate(zip(requests, lengths.tolist(), ent_sum.tolist()))
    ]


def reference_batches(engine, requests, max_new_tokens, temperature, seed, batch_size=None):
    """``reference_generate`` over consecutive batches of ``batch_size`` (default: the engine's
    capacity); the sampler makes the split irrelevant, so this equals one big batch."""
    bs = batch_size or engine.capacity
    return [
        t
        for s in range(0, len(requests), bs)
        for t in reference_generate(engine, requests[s : s + bs], max_new_tokens, temperature, seed)
    ]


def oracle_generate(
    engine, requests, max_new_tokens=None, temperature=None, generator=None, progress=None, *, seed=None
) -> list[Trajectory]:
    """``Engine.generate``'s signature over the reference loop (batches of the engine's capacity):
    what ``benchmarks/before_issue30.py`` and ``trl_peer.py``'s ``laminar-reference`` put in its place."""
    from generation.sampler import seed_from

    m = engine.max_new_tokens if max_new_tokens is None else max_new_tokens
    temp = engine.temperature if temperature is None else temperature
    s = seed_from(generator, seed) if (seed is not None or generator is not None) else engine.seed
    out = reference_batches(engine, list(requests), m, temp, s)
    if progress is not None:
        progress.update(len(out))
    return out
