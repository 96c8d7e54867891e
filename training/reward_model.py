"""A Bradley-Terry reward model: ``AutoModelForSequenceClassification`` with one label, initialised
from a causal-LM ``save_pretrained`` folder (the warm-up model or any ``model.path``), trained on
comparisons (``data_curation.preferences``) with ``-log sigmoid(r_chosen - r_rejected - margin)``,
saved with ``save_pretrained`` (safetensors). Held-out pairwise accuracy is measured beside the
baselines that need no model: random (0.5), longer-wins and shorter-wins."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of ``-log sigmoid(r_chosen - r_rejected - margin)`` over [B] scores (margin: [B] or None)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).mean()


def pairwise_accuracy(chosen: Sequence[float], rejected: Sequence[float]) -> float:
    """Share of pairs whose chosen score is above the rejected one (a tie counts half)."""
    if not chosen:
        return float("nan")
    wins = sum(1.0 if c > r else 0.5 if c == r else 0.0 for c, r in zip(chosen, rejected))
    return wins / len(chosen)


def length_baselines(comparisons: Sequence[dict]) -> dict[str, float]:
    """``longer_wins`` and ``shorter_wins`` pairwise accuracy, and ``random`` (0.5 by definition)."""
    lc = [float(len(c["chosen"])) for c in comparisons]
    lr = [float(len(c["rejected"])) for c in comparisons]
    return {
        "random": 0.5,
        "longer_wins": pairwise_accuracy(lc, lr),
        "shorter_wins": pairwise_accuracy([-x for x in lc], [-x for x in lr]),
    }


def check_reward_model_path(path: str | Path, policy_tokenizer=None) -> None:
    """Refuse, before any write, a folder that is not a sequence-classification checkpoint with one
    label, or whose tokenizer differs from the policy's."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"reward model {path} has no config.json; pass a save_pretrained folder")
    arch = json.loads(config.read_text()).get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in arch):
        raise ValueError(
            f"reward model {path} is a {', '.join(arch) or 'model of unknown architecture'}, not a "
            "sequence-classification checkpoint; pass a folder the reward_model stage saved (or any "
            "AutoModelForSequenceClassification folder with num_labels=1)"
        )
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"reward model {path} has no safetensors weights; pickled weights are never loaded")
    if policy_tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        if tok.get_vocab() != policy_tokenizer.get_vocab():
            raise ValueError(
                f"reward model {path} has a tokenizer that differs from the policy's "
                f"({len(tok)} vs {len(policy_tokenizer)} tokens); pass a reward model trained from the "
                "policy's own backbone (the warm-up model), or a model.path with the same tokenizer"
            )


def _encode(tokenizer, prompt: str, response: str, max_len: int) -> list[int]:
    ids = tokenizer(prompt + response, add_special_tokens=False)["input_ids"]
    return ids[-max_len:]


def score_texts(model, tokenizer, prompts: Sequence[str], responses: Sequence[str], max_len: int = 160):
    """The reward model's score per (prompt, response), batched with right padding."""
    out = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), 32):
            seqs = [
                _encode(tokenizer, p, r, max_len) for p, r in zip(prompts[i : i + 32], responses[i : i + 32])
            ]
            out.extend(_forward(model, tokenizer, seqs).tolist())
    return out


def _forward(model, tokenizer, seqs: list[list[int]]) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def train_reward_model(
    backbone: str | Path,
    comparisons: Sequence[dict],
    out_dir: str | Path,
    *,
    steps: int = 200,
    batch_size: int = 16,
    lr: float = 1e-3,
    heldout_share: float = 0.2,
    max_len: int = 160,
    seed: int = 0,
) -> dict[str, float]:
    """Train on all but a held-out share of ``comparisons``; save to ``out_dir``; metrics: the loss,
    held-out pairwise accuracy (``rm_heldout_accuracy``) and the baselines on the same split."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not comparisons:
        raise ValueError("no comparisons to train a reward model on; ingest preference data first")
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(backbone))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        str(backbone), num_labels=1, use_safetensors=True, dtype=torch.float32
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    rows = list(comparisons)
    random.Random(seed).shuffle(rows)
    n_held = max(1, int(len(rows) * heldout_share)) if len(rows) > 1 else 0
    held, train = rows[:n_held], rows[n_held:] or rows
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed + 1)
    losses = []
    model.train()
    for _ in range(steps):
        batch = [train[rng.randrange(len(train))] for _ in range(batch_size)]
        seqs = [_encode(tokenizer, c["prompt"], c["chosen"], max_len) for c in batch]
        seqs += [_encode(tokenizer, c["prompt"], c["rejected"], max_len) for c in batch]
        scores = _forward(model, tokenizer, seqs)
        margin = torch.tensor([float(c.get("margin") or 0.0) for c in batch])
        loss = bradley_terry_loss(scores[:batch_size], scores[batch_size:], margin)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    metrics = {"rm_loss_first": losses[0] if losses else float("nan"), "rm_loss_last": losses[-1]}
    if held:
        sc = score_texts(model, tokenizer, [c["prompt"] for c in held], [c["chosen"] for c in held], max_len)
        sr = score_texts(
            model, tokenizer, [c["prompt"] for c in held], [c["rejected"] for c in held], max_len
        )
        metrics["rm_heldout_accuracy"] = pairwise_accuracy(sc, sr)
        metrics.update({f"baseline_{k}_accuracy": v for k, v in length_baselines(held).items()})
        metrics["heldout_comparisons"] = float(len(held))
    return metrics
