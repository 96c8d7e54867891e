"""The policy trainer: turns scored groups into one optimizer step and publishes weight versions.

``build_batch`` lays groups out as tensors (shapes documented there); ``PolicyTrainer.update``
computes advantages and the objective chosen by ``ObjectiveParams`` (see ``training.objectives``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from training.objectives import ADVANTAGES, ObjectiveParams, PolicyBatch, entropy_from_logits, policy_loss
from training.rl.records import ScoredGroup, UpdateStats, WeightsUpdate


@dataclass(frozen=True)
class TrainBatch:
    """B sequences (prompt + response, right-padded to L), T = longest response.

    ``input_ids``/``attention_mask`` (B, L); ``positions`` (B, T): index into the logits of the
    position that predicts response token t (prompt_len - 1 + t); ``targets``/``behaviour``/``mask``
    (B, T); ``rewards``, ``group_index``, ``versions`` (B,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    behaviour: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    group_index: torch.Tensor
    versions: torch.Tensor
    finished: torch.Tensor


def build_batch(groups: Sequence[ScoredGroup], pad_id: int) -> TrainBatch:
    trajs = [(g, t, r) for g, grp in enumerate(groups) for t, r in zip(grp.trajectories, grp.rewards)]
    if not trajs:
        raise ValueError("build_batch needs at least one trajectory")
    width = max(len(t.prompt.prompt_tokens) + len(t.response_tokens) for _, t, _ in trajs)
    tmax = max(1, max(len(t.response_tokens) for _, t, _ in trajs))
    bsz = len(trajs)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attn = torch.zeros((bsz, width), dtype=torch.long)
    positions = torch.zeros((bsz, tmax), dtype=torch.long)
    targets = torch.zeros((bsz, tmax), dtype=torch.long)
    behaviour = torch.zeros((bsz, tmax), dtype=torch.float32)
    mask = torch.zeros((bsz, tmax), dtype=torch.float32)
    for i, (_, t, _) in enumerate(trajs):
        p, r = len(t.prompt.prompt_tokens), len(t.response_tokens)
        ids[i, :p + r] = torch.tensor(t.prompt.prompt_tokens + t.response_tokens)
        attn[i, :p + r] = 1
        positions[i, :r] = torch.arange(p - 1, p - 1 + r)
        targets[i, :r] = torch.tensor(t.response_tokens)
        behaviour[i, :r] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
        mask[i, :r] = 1.0
    return TrainBatch(
        input_ids=ids, attention_mask=attn, positions=positions, targets=targets, behaviour=behaviour,
        mask=mask, rewards=torch.tensor([r for _, _, r in trajs], dtype=torch.float32),
        group_index=torch.tensor([g for g, _, _ in trajs], dtype=torch.long),
        versions=torch.tensor([t.version for _, t, _ in trajs], dtype=torch.long),
        finished=torch.tensor([t.finished for _, t, _ in trajs], dtype=torch.bool),
    )


def response_logits(model, batch: TrainBatch, device: str) -> torch.Tensor:
    """Logits (B, T, V) at the positions predicting each response token."""
    logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)).logits
    idx = batch.positions.to(device)[..., None].expand(-1, -1, logits.shape[-1])
    return logits.gather(1, idx).float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, T, V) logits, (B, T) targets -> (B, T) log-probs under the temperature-scaled policy."""
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


class PolicyTrainer:
    """Owns the trained model and its optimizer; ``version`` counts optimizer steps taken."""

    def __init__(self, model, params: ObjectiveParams, *, lr: float, weight_decay: float,
                 max_grad_norm: float, temperature: float, max_new_tokens: int, pad_id: int, device: str):
        self.model = model.to(device).train()
        self.params = params
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99))
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.pad_id = pad_id
        self.device = device
        self.version = 0
        # a frozen copy of the starting weights, only when the objective has a KL term
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if params.kl_coef > 0 else None

    def update(self, groups: Sequence[ScoredGroup]) -> UpdateStats:
        batch = build_batch(groups, self.pad_id)
        advantages = ADVANTAGES[self.params.advantage](batch.rewards, batch.group_index).to(self.device)
        logits = response_logits(self.model, batch, self.device)
        logprobs = token_logprobs(logits, batch.targets.to(self.device), self.temperature)
        mask = batch.mask.to(self.device)
        if self.params.overlong_filter:  # DAPO: truncated responses carry no loss
            mask = mask * batch.finished.to(self.device, mask.dtype)[:, None]
        ref_logprobs = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logprobs = token_logprobs(response_logits(self.ref_model, batch, self.device),
                                              batch.targets.to(self.device), self.temperature)
        pbatch = PolicyBatch(
            logprobs=logprobs, old_logprobs=logprobs.detach(), behaviour_logprobs=batch.behaviour.to(self.device),
            advantages=advantages, mask=mask, max_len=self.max_new_tokens,
            versions=batch.versions, trainer_version=self.version, ref_logprobs=ref_logprobs,
        )
        loss, metrics = policy_loss(pbatch, self.params)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        self.opt.step()
        self.version += 1
        with torch.no_grad():
            ent = entropy_from_logits(logits.detach() / self.temperature)
            metrics["entropy"] = float((ent * mask).sum() / mask.sum().clamp_min(1))
            metrics["sampler_logprob_gap"] = float(((logprobs.detach() - pbatch.behaviour_logprobs).abs() * mask).sum()
                                                   / mask.sum().clamp_min(1))
        return UpdateStats(kind="update_stats", version=self.version, loss=float(loss.detach()), grad_norm=grad_norm,
                           n_sequences=int(mask.shape[0]), n_tokens=int(mask.sum()), metrics=metrics)

    def publish(self) -> WeightsUpdate:
        state = {k: v.detach().to("cpu").numpy().copy() for k, v in self.model.state_dict().items()}
        return WeightsUpdate(kind="weights_update", version=self.version, state=state)
