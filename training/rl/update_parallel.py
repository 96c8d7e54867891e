"""How one policy update's rows are split: into micro-batches within a token budget, over the
data-parallel ranks (each takes its share of the rows, the ranks' gradients and metrics summed), and
over host threads on one rank (whole groups per thread, each thread on a replica of the model that
shares its parameters). ``training.rl.trainer.PolicyTrainer`` applies them.
"""

from __future__ import annotations

import copy

import torch

from generation.setup import HostThreads


def micro_batches(lengths: torch.Tensor, idx: torch.Tensor, token_budget: int) -> list[torch.Tensor]:
    """Split rows ``idx`` into micro-batches of similar length whose padded size (rows x longest
    row) stays within ``token_budget`` (verl's dynamic batch size): longest first, so a batch of
    mostly short responses and a few long ones is not padded to the longest. 0 = one micro-batch."""
    if token_budget <= 0 or len(idx) <= 1:
        return [idx]
    order = idx[torch.argsort(lengths[idx], descending=True, stable=True)].tolist()
    out, cur, cur_max = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and max(cur_max, n) * (len(cur) + 1) > token_budget:
            out.append(torch.tensor(cur))
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    out.append(torch.tensor(cur))
    return out


def micro_share(mask_mb: torch.Tensor, mask_all: torch.Tensor, loss_agg: str) -> float:
    """The weight of a micro-batch's loss so that the weighted sum equals the loss of the whole
    batch under ``loss_agg`` (token_mean: share of tokens; seq_mean: share of sequences with a
    token; seq_sum_const: share of sequences)."""
    if loss_agg == "token_mean":
        return float(mask_mb.sum() / mask_all.sum().clamp(min=1))
    if loss_agg == "seq_mean":
        return float((mask_mb.sum(1) > 0).sum() / (mask_all.sum(1) > 0).sum().clamp(min=1))
    return mask_mb.shape[0] / mask_all.shape[0]


def accumulate(metrics: dict[str, float], more: dict[str, float], share: float = 1.0) -> None:
    """Add ``share`` x ``more`` to ``metrics`` (``staleness_max``: the maximum)."""
    for k, v in more.items():
        if k == "staleness_max":
            metrics[k] = max(metrics.get(k, v), v)
        else:
            metrics[k] = metrics.get(k, 0.0) + share * v


def group_shards(
    idx: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor, k: int
) -> list[torch.Tensor]:
    """Rows ``idx`` in ``k`` shards of whole groups (a group's samples share their prompt, which the
    packed forward then computes once), the groups' tokens balanced (largest first onto the
    lightest shard); rows keep their order within a shard. Fewer shards when there are fewer groups."""
    rows_of: dict[int, list[int]] = {}
    for i in idx.tolist():
        rows_of.setdefault(int(group_index[i]), []).append(i)
    k = max(1, min(k, len(rows_of)))
    tokens = {g: sum(int(lengths[i]) for i in rows) for g, rows in rows_of.items()}
    load, shards = [0] * k, [[] for _ in range(k)]
    for g in sorted(rows_of, key=lambda g: (-tokens[g], g)):
        j = min(range(k), key=lambda j: (load[j], j))
        shards[j].extend(rows_of[g])
        load[j] += tokens[g]
    return [torch.tensor(sorted(rows)) for rows in shards if rows]


def rank_micro_batches(
    lengths: torch.Tensor, idx: torch.Tensor, token_budget: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, bool]]:
    """Rank ``rank``'s micro-batches of rows ``idx`` as (rows, counts) pairs. Rank r takes every
    ``world_size``-th row by length (similar token counts per rank). Every rank plans every
    rank's split (they all hold the whole batch), so all run the same number of forward and
    backward passes, which ZeRO's collectives need: a rank with fewer micro-batches (or no
    row at all) repeats one with loss weight 0 (``counts`` False)."""
    if world_size == 1:
        return [(mb, True) for mb in micro_batches(lengths, idx, token_budget)]
    order = idx[torch.argsort(lengths[idx], descending=True, stable=True)]
    plans = [
        micro_batches(lengths, order[r::world_size], token_budget) if len(order[r::world_size]) else []
        for r in range(world_size)
    ]
    mine = [(mb, True) for mb in plans[rank]]
    filler = mine[0][0] if mine else order[:1]
    return mine + [(filler, False)] * (max(len(p) for p in plans) - len(mine))


def all_reduce_gradients(parameters) -> None:
    """Sum the ranks' partial gradients of ``parameters`` (their loss weights sum to 1); a parameter
    without a gradient on this rank contributes zeros."""
    import torch.distributed as dist

    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def reduce_metrics(metrics: dict[str, float], loss: float) -> tuple[dict[str, float], float]:
    """The ranks' (metrics, loss) summed (``staleness_max``: the maximum)."""
    import torch.distributed as dist

    keys = sorted(metrics)
    summed = torch.tensor([metrics[k] for k in keys if k != "staleness_max"] + [loss], dtype=torch.float64)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    out = dict(zip([k for k in keys if k != "staleness_max"], summed[:-1].tolist()))
    if "staleness_max" in metrics:
        top = torch.tensor([metrics["staleness_max"]], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        out["staleness_max"] = float(top[0])
    return out, float(summed[-1])


def has_dropout(model) -> bool:
    """Whether ``model`` draws dropout noise in training (a module or its config's dropout rates)."""
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        float(getattr(getattr(model, "config", None), a, 0.0) or 0.0) > 0
        for a in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")
    )


def replica(model, replicas: list, j: int):
    """Replica ``j`` >= 1 of ``model`` for thread ``j`` (kept in ``replicas``): its own modules and
    gradients, the same parameter storage (re-tied here whenever the model's parameters were replaced)."""
    while len(replicas) < j:
        replicas.append(copy.deepcopy(model))
    rep = replicas[j - 1]
    for p, q in zip(model.parameters(), rep.parameters()):
        if q.data_ptr() != p.data_ptr() or q.shape != p.shape:
            q.data = p.data
        q.requires_grad_(p.requires_grad)
    rep.train(model.training)
    return rep


def backward_in_threads(threads: HostThreads, model, replicas: list, backward_rows, parts: list):
    """``backward_rows(model, parts[j])`` for every ``j`` at once, one host thread each with its
    share of the torch threads (``threads``): thread 0 on ``model``, thread j on its ``replica``. The
    replicas' gradients are then added to the model's in thread order (so the sum is the same on every
    run) and the metrics and losses summed; (metrics, loss) as one thread returns them."""
    models = [model] + [replica(model, replicas, j) for j in range(1, len(parts))]
    results = threads.run(lambda j: backward_rows(models[j], parts[j]), len(parts))
    for rep in models[1:]:
        for p, q in zip(model.parameters(), rep.parameters()):
            if q.grad is not None:
                p.grad = q.grad if p.grad is None else p.grad.add_(q.grad)
            q.grad = None
    metrics: dict[str, float] = {}
    for part_metrics, _ in results:
        accumulate(metrics, part_metrics)
    return metrics, sum(loss for _, loss in results)
