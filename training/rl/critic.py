"""The value model of the critic presets (``rl.algorithm=ppo|vapo``): a separate critic, a copy of the
policy's backbone (or of ``rl.critic_path``'s) with a scalar head, trained by the trainer beside the
policy with its own optimizer. Values are computed at train time on the trainer, so rollouts never
carry them. Why a separate critic and not a value head on the policy: docs/runtime.md.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import torch

from training.lora import is_peft
from training.objectives import ObjectiveParams, aggregate, clipped_value_loss, explained_variance
from training.rl.update_parallel import micro_batches, micro_share


class ValueModel(torch.nn.Module):
    """A causal LM's backbone (its ``base_model_prefix`` module, without the LM head) and a linear head
    to one value per position. ``forward`` returns an object whose ``logits`` are the values
    ``(R, L, 1)``, so the trainer's padded and packed forwards (``response_logits``,
    ``packed_response_logits``) gather them at the positions that predict each response token:
    ``V(s_t)``, the state before token t. The head starts at zero (every value 0)."""

    def __init__(self, lm):
        super().__init__()
        self.backbone = getattr(lm, lm.base_model_prefix)
        self.config = lm.config
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return SimpleNamespace(logits=self.head(hidden.to(self.head.weight.dtype)))


def vocab_mismatch(policy_tokenizer, critic_dir: str | Path) -> str | None:
    """Why the critic folder ``critic_dir`` cannot read ``policy_tokenizer``'s token ids (None when it
    can): its tokenizer's vocabulary must equal the policy's and its embedding must cover it."""
    from generation.model import load_tokenizer
    from transformers import AutoConfig

    crit = load_tokenizer(critic_dir)
    pol_vocab, crit_vocab = policy_tokenizer.get_vocab(), crit.get_vocab()
    if pol_vocab != crit_vocab:
        diff = len(set(pol_vocab.items()) ^ set(crit_vocab.items()))
        return (
            f"its tokenizer differs from the policy's ({len(crit_vocab)} vs {len(pol_vocab)} tokens, "
            f"{diff} entries differ): the critic reads the policy's token ids"
        )
    vocab = AutoConfig.from_pretrained(critic_dir).vocab_size
    if vocab < len(pol_vocab):
        return f"its embedding has {vocab} rows for the policy's {len(pol_vocab)} tokens"
    return None


def build_critic(policy, critic_path: str | Path | None, device: str) -> ValueModel:
    """The critic: from ``critic_path`` (a ``save_pretrained`` causal LM folder whose tokenizer is the
    policy's; ``vocab_mismatch`` is checked by the caller) or a copy of ``policy`` (a LoRA policy:
    the adapter merged into the copy). Every weight trains."""
    if critic_path is not None:
        from generation.model import load_model

        lm, _ = load_model(Path(critic_path), "cpu")
        if lm.config.vocab_size < policy.config.vocab_size:
            raise ValueError(
                f"rl.critic_path={critic_path}: its embedding has {lm.config.vocab_size} rows for the "
                f"policy's {policy.config.vocab_size}; use a critic with the policy's tokenizer"
            )
    else:
        lm = copy.deepcopy(policy)
        if is_peft(lm):
            lm = lm.merge_and_unload()
    critic = ValueModel(lm).to(device).train()
    critic.requires_grad_(True)
    return critic


def critic_steps(
    critic,
    opt,
    inp,
    chunks: list[torch.Tensor],
    p: ObjectiveParams,
    *,
    token_budget: int,
    max_grad_norm: float,
    values_of,
    check_finite,
) -> dict[str, float]:
    """One step of ``critic`` (optimizer ``opt``) per minibatch of rows ``chunks`` on the clipped value
    loss (``value_coef`` x its token mean), micro-batched within ``token_budget``, gradients clipped
    at ``max_grad_norm``. ``inp`` is the update's inputs (``PolicyTrainer._update_inputs``: batch,
    mask, lengths, pre-update ``values``, ``returns``); ``values_of(sub)``: the critic's (B, T) values
    of a micro-batch; ``check_finite(loss=, gradient_norm=)`` raises before a non-finite step. Every
    rank runs it on the whole minibatch (the batch is on every rank), so the replicated critics stay
    equal without communication. Metrics: ``value_loss``, ``value_clipfrac``,
    ``explained_variance`` (of the pre-update values)."""
    total, clipped = 0.0, 0.0
    for idx in chunks:
        opt.zero_grad(set_to_none=True)
        for mb in micro_batches(inp.lengths, idx, token_budget):
            sub = inp.batch.rows(mb).trimmed()
            t = sub.mask.shape[1]
            m = inp.mask[mb, :t]
            values = values_of(sub)
            loss, frac = clipped_value_loss(values, inp.values[mb, :t], inp.returns[mb, :t], p.value_clip)
            share = micro_share(m, inp.mask[idx], "token_mean")
            (p.value_coef * aggregate(loss, m, "token_mean") * share).backward()
            total += float(aggregate(loss.detach(), m, "token_mean")) * share / len(chunks)
            clipped += float(aggregate(frac, m, "token_mean")) * share / len(chunks)
        norm = float(torch.nn.utils.clip_grad_norm_(critic.parameters(), max_grad_norm))
        check_finite(loss=total, gradient_norm=norm)
        opt.step()
    return {
        "value_loss": total,
        "value_clipfrac": clipped,
        "explained_variance": explained_variance(inp.values, inp.returns, inp.mask),
    }
