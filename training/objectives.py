"""Policy-optimisation objectives: pure torch functions over shape-documented tensors.

Shapes: ``B`` sequences, ``T`` response positions (right-padded), ``V`` vocabulary. ``mask`` is a
float or bool ``(B, T)`` tensor, 1 on real response tokens. ``group_index`` is a ``LongTensor (B,)``;
sequences sharing a value are the responses to one prompt (groups may differ in size and order).

One small unit per algorithm, chosen through read-only tables (``ADVANTAGES``, ``AGGREGATIONS``,
``BEHAVIOUR_WEIGHTS``); ``policy_loss`` composes them from an ``ObjectiveParams``. Formulas follow
``docs/runtime.md`` (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO, PPO with GAE, VAPO, AReaL's
decoupled PPO, truncated IS). Sequence-level estimators give ``(B,)`` advantages (``ADVANTAGES``);
token-level ones (``TOKEN_ADVANTAGES``: GAE over a critic's values, REINFORCE++ returns) ``(B, T)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from conf.schema import Advantage, Algorithm, BehaviourWeight, LossAgg, RatioLevel

if TYPE_CHECKING:
    from training.rl.teacher import TeacherSpec

_K = TypeVar("_K", bound=str)
_V = TypeVar("_V")


def _lookup(table: Mapping[_K, _V], name: str, what: str) -> _V:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")
    return table[name]


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


# --------------------------------------------------------------------------- advantages


def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per sequence: reward minus its group mean, its group's unbiased std, and whether its group
    is constant (all rewards equal, or a single response). All ``(B,)``."""
    rewards = _as_float(rewards)
    uniq, inv = torch.unique(group_index, return_inverse=True)
    zeros = rewards.new_zeros(uniq.numel())
    counts = zeros.index_add(0, inv, torch.ones_like(rewards))
    mean = zeros.index_add(0, inv, rewards) / counts
    centred = rewards - mean[inv]
    var = zeros.index_add(0, inv, centred.square()) / (counts - 1).clamp_min(1)
    lo = zeros.scatter_reduce(0, inv, rewards, "amin", include_self=False)
    hi = zeros.scatter_reduce(0, inv, rewards, "amax", include_self=False)
    return centred, var.sqrt()[inv], (lo == hi)[inv]


def grpo_advantages(rewards: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``, ``(B,)``.

    The std is the unbiased one (``torch.std``'s default, as verl computes it). A constant group,
    including a group of one, gets exactly 0 (no rounding residue from the mean, no NaN)."""
    centred, std, constant = _group_stats(rewards, group_index)
    return torch.where(constant, 0.0, centred / (std + eps))


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO: ``r - mean_group`` with no std division, ``(B,)``; constant groups get 0."""
    centred, _, constant = _group_stats(rewards, group_index)
    return torch.where(constant, 0.0, centred)


def batch_normalized_advantages(rewards: Tensor, group_index: Tensor, eps: float = 1e-6) -> Tensor:
    """Group-mean-centred rewards divided by their unbiased std over the whole batch, ``(B,)``.

    The centred values are not re-centred on the batch mean. A batch of one gets 0."""
    centred = dr_grpo_advantages(rewards, group_index)
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    return centred / (std + eps)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j`` over the k responses of a prompt, ``(B,)``; equal to
    ``k / (k - 1) * (r_i - mean_group)``. A group of one (no other sample) and a constant group get 0."""
    centred, _, constant = _group_stats(rewards, group_index)
    _, inv, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    k = counts[inv].to(centred.dtype)
    return torch.where(constant | (k < 2), 0.0, centred * k / (k - 1).clamp_min(1))


AdvantageFn = Callable[[Tensor, Tensor], Tensor]
ADVANTAGES: Mapping[str, AdvantageFn] = MappingProxyType(
    {
        "grpo": grpo_advantages,
        "dr_grpo": dr_grpo_advantages,
        "batch": batch_normalized_advantages,
        "rloo": rloo_advantages,
    }
)
"""Sequence-level estimators: ``(rewards (B,), group_index (B,)) -> (B,)``."""


def _whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` over the tokens of ``mask`` (unbiased std; one token: std 0);
    0 off the mask."""
    m = mask.bool()
    n = m.sum()
    mean = _masked_sum(x, m) / n.clamp_min(1)
    var = _masked_sum((x - mean).square(), m) / (n - 1).clamp_min(1)
    return torch.where(m, (x - mean) / (var.sqrt() + eps), 0.0)


def _last_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """``(B,)`` rewards placed on each sequence's last response token, ``(B, T)``."""
    lengths = mask.to(torch.long).sum(-1)
    out = torch.zeros(mask.shape, dtype=_as_float(rewards).dtype, device=mask.device)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    out[rows, lengths[rows] - 1] = _as_float(rewards)[rows]
    return out


def reinforce_pp_advantages(
    rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """REINFORCE++ (arXiv 2501.03262), ``(B, T)``: the return of token t,
    ``G_t = r - kl_coef * sum_{s >= t} kl_s`` (the reward on the last token, the token KL folded in,
    gamma 1), normalised over every token of the batch (mean and std of ``mask``'s tokens). No critic
    and no group baseline; ``kl`` (B, T), detached, is the per-token ``log pi - log pi_ref``."""
    m = mask.to(torch.get_default_dtype() if not mask.is_floating_point() else mask.dtype)
    token_r = _last_token_rewards(rewards, mask)
    if kl is not None and kl_coef > 0.0:
        token_r = token_r - kl_coef * kl.detach() * m
    returns = token_r.flip(-1).cumsum(-1).flip(-1)
    return _whiten(returns, mask)


def adaptive_lambda(lengths: Tensor, alpha: float) -> Tensor:
    """VAPO's length-adaptive GAE lambda per sequence, ``(B,) -> (B,)``: ``1 - 1 / (alpha * l)``,
    clamped to [0, 1] (``alpha * l <= 1`` gives 0: a one-step TD advantage)."""
    if alpha <= 0:
        raise ValueError(f"lambda_alpha={alpha} must be > 0 (VAPO: 0.05)")
    return (1.0 - 1.0 / (alpha * _as_float(lengths)).clamp_min(1e-12)).clamp(0.0, 1.0)


def gae(
    values: Tensor, rewards: Tensor, mask: Tensor, *, gamma: float, lam: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens, reward on the last token.

    ``values`` (B, T): the critic's ``V(s_t)``, the state before token t; ``rewards`` (B,);
    ``mask`` (B, T), right-padded. ``lam``: a float or one lambda per sequence ``(B,)``.
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` after the last token is 0),
    ``A_t = delta_t + gamma * lam * A_{t+1}``. Returns ``(advantages, returns = A + V)``, both
    ``(B, T)``, detached, 0 off the mask."""
    values = values.detach()
    m = mask.to(values.dtype)
    lam_t = torch.as_tensor(lam, dtype=values.dtype, device=values.device)
    lam_t = lam_t.reshape(-1, 1) if lam_t.dim() == 1 else lam_t
    token_r = _last_token_rewards(rewards, mask).to(values.dtype)
    v = values * m
    next_v = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], dim=1)
    delta = (token_r + gamma * next_v - v) * m
    adv = torch.zeros_like(values)
    running = values.new_zeros(values.shape[0], 1)
    coef = (gamma * lam_t).expand(values.shape[0], 1)
    for t in range(values.shape[1] - 1, -1, -1):
        running = delta[:, t : t + 1] + coef * running * m[:, t : t + 1]
        adv[:, t : t + 1] = running
    adv = adv * m
    return adv, (adv + v) * m


@dataclass(frozen=True)
class TokenInputs:
    """What the token-level estimators read: ``rewards`` (B,), ``mask`` (B, T), the critic's
    ``values`` (B, T) (GAE), the per-token ``kl`` (B, T) to the reference (REINFORCE++) and
    ``teacher_kl`` (B, T), ``log pi - log pi_teacher`` on the sampled tokens (on-policy distillation),
    each None where the estimator does not need it."""

    rewards: Tensor
    mask: Tensor
    values: Tensor | None = None
    kl: Tensor | None = None
    teacher_kl: Tensor | None = None


def reverse_kl_tokens(logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """Per-token reverse KL to a teacher on the student's own samples, ``(B, T)``, detached:
    ``log pi(x_t) - log pi_teacher(x_t)``, the single-sample (k1) estimate of
    ``KL(pi || pi_teacher)`` at each position (0 where teacher and student agree)."""
    return (logprobs - teacher_logprobs).detach()


def opd_advantages(teacher_kl: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation's dense advantage, ``(B, T)``: the negative per-token reverse KL,
    ``log pi_teacher(x_t) - log pi(x_t)``, 0 off ``mask`` (Agarwal et al. 2024; Thinking Machines'
    OPD; prime-rl ``orchestrator/algo/opd.py``). Each token is its own return (no sum over later
    tokens): a token the teacher finds likelier than the student is pushed up."""
    return torch.where(mask.bool(), -teacher_kl.detach(), 0.0)


def distill_advantages(
    reward_advantages: Tensor, teacher_kl: Tensor, mask: Tensor, *, kl_weight: float, reward_weight: float
) -> Tensor:
    """``kl_weight * opd_advantages + reward_weight * reward_advantages`` per token, ``(B, T)``;
    ``reward_advantages`` (B,) is broadcast over each response's tokens (or is already (B, T))."""
    adv = kl_weight * opd_advantages(teacher_kl, mask)
    if reward_weight:
        base = reward_advantages[:, None] if reward_advantages.dim() == 1 else reward_advantages
        adv = adv + reward_weight * torch.where(mask.bool(), base, 0.0)
    return adv


def _gae_policy(inp: TokenInputs, p: ObjectiveParams) -> Tensor:
    if inp.values is None:
        raise ValueError("advantage 'gae' needs the critic's values (the trainer computes them)")
    lam = adaptive_lambda(inp.mask.sum(-1), p.lambda_alpha) if p.lambda_alpha is not None else p.gae_lambda
    adv, _ = gae(inp.values, inp.rewards, inp.mask, gamma=p.gamma, lam=lam)
    return _whiten(adv, inp.mask)


def value_targets(inp: TokenInputs, p: ObjectiveParams) -> Tensor:
    """The critic's regression targets ``(B, T)``: GAE returns with ``p.critic_lambda``."""
    if inp.values is None:
        raise ValueError("value_targets needs the critic's values")
    return gae(inp.values, inp.rewards, inp.mask, gamma=p.gamma, lam=p.critic_lambda)[1]


TOKEN_ADVANTAGES: Mapping[str, Callable[[TokenInputs, ObjectiveParams], Tensor]] = MappingProxyType(
    {
        "gae": _gae_policy,
        "reinforce_pp": lambda inp, p: reinforce_pp_advantages(
            inp.rewards, inp.mask, inp.kl if p.kl_in_reward else None, p.kl_coef
        ),
    }
)
"""Token-level estimators: ``(TokenInputs, ObjectiveParams) -> (B, T)``."""

NEEDS_CRITIC: frozenset[str] = frozenset({"gae"})
"""Advantage estimators that read a learned critic's values."""


def advantages_of(
    params: ObjectiveParams, rewards: Tensor, group_index: Tensor, inp: TokenInputs | None = None
) -> Tensor:
    """The advantages ``params.advantage`` names: ``(B,)`` from ``ADVANTAGES`` or ``(B, T)`` from
    ``TOKEN_ADVANTAGES`` (which read ``inp``). With a teacher (``params.distill_weight > 0``) they are
    ``distill_advantages``, ``(B, T)``, which reads ``inp.teacher_kl``."""
    if params.advantage in ADVANTAGES:
        adv = ADVANTAGES[params.advantage](rewards, group_index)
    elif inp is None:
        raise ValueError(f"advantage {params.advantage!r} is token-level: pass TokenInputs")
    else:
        adv = _lookup(TOKEN_ADVANTAGES, params.advantage, "advantage")(inp, params)
    if params.distill_weight <= 0.0:
        return adv
    if inp is None or inp.teacher_kl is None:
        raise ValueError("distill_weight > 0 needs the teacher's per-token KL: pass TokenInputs.teacher_kl")
    return distill_advantages(
        adv, inp.teacher_kl, inp.mask, kl_weight=params.distill_weight, reward_weight=params.reward_weight
    )


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token, ``(B, T)``: ``0.5 * max((V - R)^2, (V_clip - R)^2)``,
    ``V_clip = old + clip(V - old, -clip, clip)``. Gradient through ``values`` only. Returns
    ``(loss, clipfrac)``; ``clipfrac`` is 1.0 where the clipped branch is the larger."""
    old, ret = old_values.detach(), returns.detach()
    clipped = old + (values - old).clamp(-clip, clip)
    a, b = (values - ret).square(), (clipped - ret).square()
    return 0.5 * torch.maximum(a, b), (b > a).to(values.dtype)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over ``mask``'s tokens (1: perfect, 0: no better than the mean;
    NaN when the returns are constant)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    var = r.var(unbiased=False) if r.numel() else r.new_zeros(())
    if r.numel() == 0 or float(var) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var)


# --------------------------------------------------------------------------- per-token losses


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    ratio_level: RatioLevel = "token",
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token: ``max(-A*rho, -A*clip(rho, 1-clip_low, 1+clip_high))``.

    ``logprobs``, ``old_logprobs``: ``(B, T)``; ``advantages``: ``(B,)`` (broadcast over tokens) or
    ``(B, T)``. Gradient flows through ``logprobs`` only. With ``dual_clip = c > 1`` the loss of a
    negative-advantage token is also bounded by ``-A*c`` (verl's rule). ``ratio_level="sequence"``
    (GSPO) makes ``rho`` each sequence's ``exp(mean_t log(pi/pi_old))`` over ``mask``, broadcast to
    its tokens (``RATIO_LEVELS``). Returns ``(loss, clipfrac)``, both ``(B, T)``; ``clipfrac`` is 1.0
    where a clipped branch (ratio or dual clip) is active, i.e. where the token's gradient is zero."""
    adv = advantages.detach()
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    log_ratio = _lookup(RATIO_LEVELS, ratio_level, "ratio_level")(logprobs - old_logprobs.detach(), mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped.to(loss.dtype)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token, ``(B, T)``: ``exp(d) - d - 1``, ``d = ref - lp``.
    Non-negative; gradient flows through ``logprobs`` only."""
    d = ref_logprobs.detach() - logprobs
    return torch.exp(d) - d - 1.0


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last axis, ``(B, T, V) -> (B, T)``, via ``log_softmax`` (no
    overflow for large logits; ``-inf`` logits contribute 0, not NaN)."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    finite_logp = torch.where(torch.isfinite(logp), logp, 0.0)
    return -(logp.exp() * finite_logp).sum(-1)


# --------------------------------------------------------------------------- aggregation


def _masked_sum(loss: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    masked = torch.where(mask.bool(), loss, 0.0)
    return masked.sum() if dim is None else masked.sum(dim)


def _token_mean(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    return _masked_sum(loss, mask) / mask.sum().clamp_min(1)


def _seq_mean(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    lengths = mask.to(loss.dtype).sum(-1)
    per_seq = _masked_sum(loss, mask, dim=-1) / lengths.clamp_min(1)
    return per_seq.sum() / (lengths > 0).sum().clamp_min(1)


def _seq_sum_const(loss: Tensor, mask: Tensor, max_len: int | None) -> Tensor:
    if max_len is None or max_len <= 0:
        raise ValueError(
            f"loss_agg 'seq_sum_const' (Dr. GRPO) divides by a constant length but got max_len={max_len}; "
            "pass max_len = the generation's maximum response length"
        )
    return _masked_sum(loss, mask) / (loss.shape[0] * max_len)


AggregationFn = Callable[[Tensor, Tensor, int | None], Tensor]
AGGREGATIONS: Mapping[LossAgg, AggregationFn] = MappingProxyType(
    {"token_mean": _token_mean, "seq_mean": _seq_mean, "seq_sum_const": _seq_sum_const}
)


def aggregate(loss: Tensor, mask: Tensor, mode: LossAgg, max_len: int | None = None) -> Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar over ``mask``.

    ``token_mean`` (DAPO): sum over all tokens / number of tokens in the batch. ``seq_mean`` (GRPO):
    mean over each sequence, then over the sequences that have at least one token. ``seq_sum_const``
    (Dr. GRPO): sum over tokens / ``(B * max_len)``, ``max_len`` required. An all-zero mask gives 0,
    still attached to the graph (no NaN)."""
    return _lookup(AGGREGATIONS, mode, "loss aggregation")(loss, mask, max_len)


# --------------------------------------------------------------------------- DAPO reward shaping


def overlong_filter_mask(truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: ``(B,)`` float mask, 0 for truncated sequences, 1 otherwise."""
    return (~truncated.bool()).to(torch.get_default_dtype())


def nonconstant_groups(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dynamic sampling: ``BoolTensor (B,)``, true where the sequence's group has reward variance
    > 0. Groups of one are constant (they carry no group-relative signal)."""
    return ~_group_stats(rewards, group_index)[2]


def count_constant_groups(rewards: Tensor, group_index: Tensor) -> int:
    """Number of groups (not sequences) whose rewards are all equal."""
    constant = _group_stats(rewards, group_index)[2]
    return int(torch.unique(group_index[constant]).numel())


# --------------------------------------------------------------------------- off-policy correction


def _token_log_ratio(log_ratio: Tensor, mask: Tensor | None) -> Tensor:
    return log_ratio


def _sequence_log_ratio(log_ratio: Tensor, mask: Tensor | None) -> Tensor:
    total = log_ratio.sum(-1) if mask is None else _masked_sum(log_ratio, mask, dim=-1)
    return total.unsqueeze(-1).expand_as(log_ratio)


def _sequence_mean_log_ratio(log_ratio: Tensor, mask: Tensor | None) -> Tensor:
    """GSPO's length-normalised sequence log-ratio, ``mean_t`` over ``mask``, broadcast to every token."""
    if mask is None:
        return log_ratio.mean(-1, keepdim=True).expand_as(log_ratio)
    n = mask.to(log_ratio.dtype).sum(-1).clamp_min(1)
    return (_masked_sum(log_ratio, mask, dim=-1) / n).unsqueeze(-1).expand_as(log_ratio)


_IS_LEVELS: Mapping[str, Callable[[Tensor, Tensor | None], Tensor]] = MappingProxyType(
    {"token": _token_log_ratio, "sequence": _sequence_log_ratio}
)
"""Behaviour (importance) weights: per token, or the product over the sequence."""

RATIO_LEVELS: Mapping[RatioLevel, Callable[[Tensor, Tensor | None], Tensor]] = MappingProxyType(
    {"token": _token_log_ratio, "sequence": _sequence_mean_log_ratio}
)
"""The clipped policy ratio: per token (PPO, GRPO) or GSPO's geometric mean over the sequence."""


def _log_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, level: str, mask: Tensor | None) -> Tensor:
    log_ratio = (old_logprobs - behaviour_logprobs).detach()
    return _lookup(_IS_LEVELS, level, "importance-weight level")(log_ratio, mask)


def truncated_is_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    cap: float = 3.0,
    level: str = "token",
    mask: Tensor | None = None,
) -> Tensor:
    """Truncated importance weights ``min(pi_old / pi_behave, cap)``, ``(B, T)``, detached.

    ``level="sequence"`` uses the product of the token ratios over ``mask`` (all tokens when
    ``mask`` is None), truncated and broadcast to every token. Default cap 3.0 (TRL)."""
    return torch.exp(_log_ratio(old_logprobs, behaviour_logprobs, level, mask).clamp(max=math.log(cap)))


def masked_is_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    *,
    low: float = 0.0,
    high: float = 3.0,
    level: str = "token",
    mask: Tensor | None = None,
) -> Tensor:
    """Masked importance weights, ``(B, T)``, detached: the ratio ``pi_old / pi_behave`` where it
    lies in ``[low, high]``, 0 outside (AReaL's behaviour-weight masking caps only above: low=0)."""
    ratio = torch.exp(_log_ratio(old_logprobs, behaviour_logprobs, level, mask))
    return torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)


BehaviourWeightFn = Callable[[Tensor, Tensor, float, Tensor | None], Tensor]
BEHAVIOUR_WEIGHTS: Mapping[BehaviourWeight, BehaviourWeightFn] = MappingProxyType(
    {
        "truncate": lambda prox, behave, cap, mask: truncated_is_weights(prox, behave, cap=cap, mask=mask),
        "mask": lambda prox, behave, cap, mask: masked_is_weights(prox, behave, high=cap, mask=mask),
        "none": lambda prox, behave, cap, mask: torch.ones_like(prox).detach(),
    }
)


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    behaviour_weight: BehaviourWeight = "truncate",
    cap: float = 3.0,
    mask: Tensor | None = None,
    ratio_level: RatioLevel = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO per token: ``w * max(-A*u, -A*clip(u, 1-clip_low, 1+clip_high))``.

    ``u = exp(logprobs - proximal)``; ``w = BEHAVIOUR_WEIGHTS[behaviour_weight]`` of
    ``exp(proximal - behaviour)``, detached. All log-prob tensors ``(B, T)``, ``advantages`` ``(B,)``
    or ``(B, T)``. With proximal == behaviour (on-policy) this is ``clipped_policy_loss``. Returns
    ``(loss (B, T), stats)``, stats holding ``(B, T)`` tensors ``clipfrac``, ``ratio`` and
    ``behaviour_weight``, all detached."""
    weight_fn = _lookup(BEHAVIOUR_WEIGHTS, behaviour_weight, "behaviour_weight")
    loss, clipfrac = clipped_policy_loss(
        logprobs,
        proximal_logprobs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        ratio_level=ratio_level,
        mask=mask,
    )
    weight = weight_fn(proximal_logprobs.detach(), behaviour_logprobs.detach(), cap, mask)
    ratio = torch.exp(RATIO_LEVELS[ratio_level]((logprobs - proximal_logprobs).detach(), mask))
    return weight * loss, {"clipfrac": clipfrac, "ratio": ratio, "behaviour_weight": weight}


def staleness(trainer_version: int, versions: Tensor) -> Tensor:
    """Inherent staleness per sequence, ``LongTensor (B,)``: trainer version minus the version that
    generated the sequence."""
    lag = trainer_version - versions.long()
    if (lag < 0).any():
        raise ValueError(
            f"a sequence has version {int(versions.max())} > trainer_version={trainer_version}; "
            "a sequence cannot come from weights newer than the trainer's: check version bookkeeping"
        )
    return lag


# --------------------------------------------------------------------------- configuration and entry point


@dataclass(frozen=True)
class ObjectiveParams:
    """Which objective to optimise. Defaults are plain GRPO; see ``PRESETS`` for DAPO, Dr. GRPO."""

    advantage: Advantage = "grpo"
    """Key of ``ADVANTAGES``. GRPO and DAPO: "grpo" (group std); Dr. GRPO: "dr_grpo"; also "batch"."""
    loss_agg: LossAgg = "seq_mean"
    """Key of ``AGGREGATIONS``. GRPO: "seq_mean"; DAPO: "token_mean"; Dr. GRPO: "seq_sum_const"."""
    clip_low: float = 0.2
    """Lower clip ``eps_low``: ratio floor ``1 - clip_low``. PPO/GRPO/DAPO: 0.2."""
    clip_high: float = 0.2
    """Upper clip ``eps_high``: ratio ceiling ``1 + clip_high``. PPO/GRPO: 0.2; DAPO clip-higher: 0.28."""
    dual_clip: float | None = None
    """Dual-clip bound ``c > 1`` on negative-advantage losses; off in the papers (verl offers 3.0)."""
    overlong_shaping: bool = False
    """DAPO soft overlong punishment added to the reward (the reward layer's ``overlong`` component,
    ``rewards.components.overlong_penalty``); DAPO: on."""
    overlong_cache_len: int = 4096
    """DAPO ``L_cache`` for the soft punishment; DAPO paper: 4096 (with an expected max of 16384)."""
    overlong_filter: bool = False
    """DAPO overlong filtering: drop truncated sequences from the loss. Off in the final DAPO recipe."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups with constant rewards and resample; DAPO: on."""
    max_sampling_rounds: int = 10
    """Cap on generation rounds when dynamic sampling (verl's DAPO example: 10)."""
    behaviour_weight: BehaviourWeight = "truncate"
    """Key of ``BEHAVIOUR_WEIGHTS`` for ``pi_prox / pi_behave``. Truncated IS (TRL); exactly 1 on-policy."""
    is_cap: float = 3.0
    """Truncation cap (or upper mask bound) of the behaviour weight; TRL default 3.0."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference. DAPO and TRL: 0 (off); the original GRPO paper: 0.04."""
    kl_in_reward: bool = False
    """REINFORCE++: ``kl_coef`` x the k1 token KL goes into the returns instead of the loss."""
    ratio_level: RatioLevel = "token"
    """Key of ``RATIO_LEVELS``: "token" (PPO, GRPO) or "sequence" (GSPO)."""
    gamma: float = 1.0
    """GAE discount; LLM PPO (verl, OpenRLHF): 1.0."""
    gae_lambda: float = 0.95
    """GAE lambda of the policy's advantages (VC-PPO: 0.95 for the actor)."""
    value_lambda: float | None = None
    """GAE lambda of the critic's targets; None = ``gae_lambda`` (coupled PPO). VC-PPO/VAPO: 1.0."""
    lambda_alpha: float | None = None
    """VAPO's length-adaptive policy lambda ``1 - 1/(alpha*l)``; None: fixed ``gae_lambda``. VAPO: 0.05."""
    value_coef: float = 0.5
    """Weight of the critic's value loss (its own optimizer; matters through gradient clipping)."""
    value_clip: float = 0.5
    """Clip range of the value loss around the pre-update values (verl ``cliprange_value``: 0.5)."""
    value_warmup_steps: int = 0
    """Updates that train only the critic before the policy moves (VC-PPO/VAPO value pre-training)."""
    nll_coef: float = 0.0
    """Weight of the NLL of positive-reward responses added to the loss (VAPO: 0.1)."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``entropy_coef * H`` per token is subtracted from the loss."""
    entropy_target: float | None = None
    """Adapt ``entropy_coef`` towards this mean token entropy (None: fixed coefficient)."""
    ref_reset_every: int = 0
    """ProRL: every N updates the KL reference becomes the current policy and the optimizer's moments
    are cleared; 0 = never (the reference stays the RL-start weights)."""
    loss: str | None = None
    """A custom per-token policy loss by import path (``rl.loss``; see ``custom_loss``); None: the
    decoupled PPO term."""
    loss_params: tuple[tuple[str, object], ...] = ()
    """The custom loss's parameters (``rl.loss_params``) as sorted (key, value) pairs."""
    distill_weight: float = 0.0
    """Weight of the negative per-token reverse KL to ``teacher`` in the advantage
    (``opd_advantages``); 0: no teacher. OPD: 1.0 (``teacher.kl_weight``)."""
    reward_weight: float = 1.0
    """Weight of the reward advantage when distilling (``distill_advantages``). OPD: 0.0 (pure
    distillation, as Thinking Machines' OPD and TRL's GKD; ``teacher.reward_weight``)."""
    teacher: TeacherSpec | None = None
    """Which teacher the trainer loads (``training.rl.teacher.TeacherSpec``); needed when
    ``distill_weight > 0``."""

    @property
    def critic_lambda(self) -> float:
        return self.gae_lambda if self.value_lambda is None else self.value_lambda

    @property
    def needs_critic(self) -> bool:
        return self.advantage in NEEDS_CRITIC

    def __post_init__(self) -> None:
        """The names resolve to this module's tables, and a critic's rule that needs the preset. The
        ranges of the values a config sets (``dual_clip > 1``, ``0 <= clip_low < 1``, the lambdas in
        [0, 1], ...) are checked once, on the fields of ``conf.schema.RLConfig``."""
        _lookup({**ADVANTAGES, **TOKEN_ADVANTAGES}, self.advantage, "advantage")
        for value, table, name in (
            (self.ratio_level, RATIO_LEVELS, "ratio_level"),
            (self.loss_agg, AGGREGATIONS, "loss_agg"),
            (self.behaviour_weight, BEHAVIOUR_WEIGHTS, "behaviour_weight"),
        ):
            _lookup(table, value, name)
        if self.distill_weight < 0 or self.reward_weight < 0:
            raise ValueError(
                f"distill_weight={self.distill_weight}, reward_weight={self.reward_weight}: must be >= 0"
            )
        if self.value_warmup_steps and not self.needs_critic:
            raise ValueError(
                f"value_warmup_steps={self.value_warmup_steps} pre-trains a critic, but advantage="
                f"{self.advantage!r} has none: use advantage=gae (rl.algorithm=ppo|vapo) or set it to 0"
            )


_GRPO = ObjectiveParams()
PRESETS: Mapping[Algorithm, ObjectiveParams] = MappingProxyType(
    {
        "grpo": _GRPO,
        "dapo": dataclasses.replace(
            _GRPO, clip_high=0.28, loss_agg="token_mean", dynamic_sampling=True, overlong_shaping=True
        ),
        "dr_grpo": dataclasses.replace(_GRPO, advantage="dr_grpo", loss_agg="seq_sum_const"),
        "rloo": dataclasses.replace(_GRPO, advantage="rloo", loss_agg="token_mean"),
        "reinforce_pp": dataclasses.replace(
            _GRPO, advantage="reinforce_pp", loss_agg="token_mean", kl_in_reward=True
        ),
        "gspo": dataclasses.replace(_GRPO, ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
        "ppo": dataclasses.replace(_GRPO, advantage="gae", loss_agg="token_mean"),
        "vapo": dataclasses.replace(
            _GRPO,
            advantage="gae",
            loss_agg="token_mean",
            clip_high=0.28,
            value_lambda=1.0,
            lambda_alpha=1.0,
            value_warmup_steps=5,
            nll_coef=0.1,
        ),
        "opd": dataclasses.replace(_GRPO, loss_agg="token_mean", distill_weight=1.0, reward_weight=0.0),
    }
)
"""``rl.algorithm`` -> its objective. VAPO pre-trains its value model 50 steps in the paper (of
several thousand); here 5 of the default 60 (``rl.value_warmup_steps`` overrides it). VAPO's
``lambda_alpha`` is 0.05 in the paper, for responses of hundreds to thousands of tokens (lambda 0.97
at 700); the preset keeps that lambda regime at this project's tens of tokens with alpha 1.0 (lambda
0.97 at 30). The paper's alpha on 30-token responses gives lambda 0.33 and collapsed all three seeds
of the default task; ``rl.lambda_alpha=0.05`` restores it for long responses."""


@dataclass(frozen=True)
class PolicyBatch:
    """One update's tensors. Invariant: every ``(B, T)`` tensor shares ``mask``'s shape.

    ``logprobs`` (B, T): current policy, with grad. ``old_logprobs`` (B, T): proximal, the
    trainer's recomputation before the update; on-policy equal to ``behaviour_logprobs`` (B, T),
    the sampler's. ``advantages`` (B,). ``mask`` (B, T): 1 on response tokens. ``max_len``: the
    generation's maximum response length. ``versions`` (B,): weight version that generated each
    sequence, given together with ``trainer_version``. ``ref_logprobs`` (B, T): reference model,
    needed when ``kl_coef > 0``. ``entropy`` (B, T), with grad: the policy's token entropy, needed
    for an entropy bonus. ``positive`` (B,) bool: responses with a positive reward (VAPO's NLL)."""

    logprobs: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    max_len: int
    versions: Tensor | None = None
    trainer_version: int | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    positive: Tensor | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.mask.shape)
        named = {
            "logprobs": self.logprobs,
            "old_logprobs": self.old_logprobs,
            "behaviour_logprobs": self.behaviour_logprobs,
            "ref_logprobs": self.ref_logprobs,
            "entropy": self.entropy,
        }
        bad = {k: tuple(v.shape) for k, v in named.items() if v is not None and tuple(v.shape) != shape}
        if len(shape) != 2 or bad:
            raise ValueError(f"PolicyBatch: mask must be (B, T) and match {bad or 'it'}; mask is {shape}")
        if self.advantages.shape[0] != shape[0]:
            raise ValueError(
                f"PolicyBatch: advantages {tuple(self.advantages.shape)} must start with B={shape[0]}"
            )
        if (self.versions is None) != (self.trainer_version is None):
            raise ValueError("PolicyBatch: pass versions and trainer_version together (both or neither)")


@functools.cache
def custom_loss(target: str, params: tuple[tuple[str, object], ...] = ()) -> Callable:
    """The loss ``target`` names (``package.module:attr``), as ``fn(batch, objective) -> Tensor (B, T)``
    (or ``(Tensor, {name: float})``): the per-token policy loss in place of the decoupled PPO term,
    before KL, entropy, NLL and aggregation. A loss that declares ``Params`` gets ``params`` validated
    into it as a third argument. A ``core.plugins.PluginError`` naming it when it does not fit."""
    from core import plugins

    fn = plugins.load(target)
    validated = plugins.validate_params(target, fn, dict(params))
    plugins.check_callable(target, fn, arity=2 if validated is None else 3)
    if validated is None:
        return fn
    return functools.partial(_with_params, fn, validated)


def _with_params(fn: Callable, validated, batch: PolicyBatch, params: ObjectiveParams):
    return fn(batch, params, validated)


def _custom_token_loss(batch: PolicyBatch, params: ObjectiveParams, metrics: dict[str, float]) -> Tensor:
    """``rl.loss``'s per-token loss of ``batch``; its own metrics added to ``metrics`` as ``loss/<name>``."""
    out = custom_loss(params.loss, params.loss_params)(batch, params)
    loss, extra = out if isinstance(out, tuple) else (out, {})
    if not isinstance(loss, Tensor) or tuple(loss.shape) != tuple(batch.mask.shape):
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
        raise ValueError(f"rl.loss={params.loss!r} returned {shape}; it must return the token loss (B, T)")
    metrics.update({f"loss/{k}": float(v) for k, v in extra.items()})
    return loss


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float(_masked_sum(x.detach(), mask) / mask.sum().clamp_min(1))


def policy_loss(
    batch: PolicyBatch, params: ObjectiveParams, *, entropy_coef: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss for one update and its metrics (python floats).

    Decoupled PPO with ``params.behaviour_weight`` ("none" gives the standard clipped loss) at
    ``params.ratio_level``, plus per token ``kl_coef * k3`` (unless ``kl_in_reward``),
    ``- entropy_coef * H`` (``entropy_coef`` overrides ``params.entropy_coef``: the adaptive
    coefficient) and ``nll_coef * -log pi`` on positive responses, aggregated by ``params.loss_agg``.
    Metrics: ``loss``, ``clipfrac``, ``ratio`` and ``behaviour_weight`` (token means), ``kl`` when
    ``ref_logprobs`` is given, ``nll`` with ``nll_coef``, and ``staleness_mean`` / ``staleness_max``
    when ``versions`` is given."""
    if params.kl_coef > 0.0 and batch.ref_logprobs is None:
        raise ValueError(
            f"kl_coef={params.kl_coef} needs batch.ref_logprobs; compute reference log-probs or set kl_coef=0"
        )
    coef = params.entropy_coef if entropy_coef is None else entropy_coef
    if coef > 0.0 and batch.entropy is None:
        raise ValueError(f"entropy_coef={coef} needs batch.entropy (the policy's token entropy, with grad)")
    if params.nll_coef > 0.0 and batch.positive is None:
        raise ValueError(f"nll_coef={params.nll_coef} needs batch.positive (which responses were rewarded)")
    mask = batch.mask
    token_loss, stats = decoupled_ppo_loss(
        batch.logprobs,
        batch.old_logprobs,
        batch.behaviour_logprobs,
        batch.advantages,
        clip_low=params.clip_low,
        clip_high=params.clip_high,
        dual_clip=params.dual_clip,
        behaviour_weight=params.behaviour_weight,
        cap=params.is_cap,
        mask=mask,
        ratio_level=params.ratio_level,
    )
    metrics: dict[str, float] = {}
    if params.loss is not None:  # a custom loss by import path replaces the PPO term
        token_loss = _custom_token_loss(batch, params, metrics)
    if batch.ref_logprobs is not None:
        kl = kl_k3(batch.logprobs, batch.ref_logprobs)
        metrics["kl"] = _masked_mean(kl, mask)
        if params.kl_coef > 0.0 and not params.kl_in_reward:
            token_loss = token_loss + params.kl_coef * kl
    if coef > 0.0:
        token_loss = token_loss - coef * batch.entropy
    if params.nll_coef > 0.0:
        nll = -batch.logprobs * batch.positive.to(batch.logprobs.dtype)[:, None]
        metrics["nll"] = _masked_mean(nll, mask)
        token_loss = token_loss + params.nll_coef * nll
    loss = aggregate(token_loss, mask, params.loss_agg, max_len=batch.max_len)
    metrics.update(
        loss=float(loss.detach()),
        clipfrac=_masked_mean(stats["clipfrac"], mask),
        ratio=_masked_mean(stats["ratio"], mask),
        behaviour_weight=_masked_mean(stats["behaviour_weight"], mask),
    )
    if batch.versions is not None and batch.trainer_version is not None:
        lag = staleness(batch.trainer_version, batch.versions)
        metrics.update(staleness_mean=float(lag.float().mean()), staleness_max=float(lag.max()))
    return loss, metrics
