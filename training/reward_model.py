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
    _check_tokenizer(path, policy_tokenizer)


def check_backbone_path(path: str | Path, policy_tokenizer=None) -> None:
    """Refuse a reward-model backbone that is not a save_pretrained folder with safetensors weights, or
    whose tokenizer differs from the policy's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"backbone {path} has no config.json; pass a save_pretrained folder or 'warmup'")
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"backbone {path} has no safetensors weights; pickled weights are never loaded")
    _check_tokenizer(path, policy_tokenizer)


def _check_tokenizer(path: Path, policy_tokenizer) -> None:
    if policy_tokenizer is None:
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.get_vocab() != policy_tokenizer.get_vocab():
        raise ValueError(
            f"{path} has a tokenizer that differs from the policy's "
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


def split_by_prompt(comparisons: Sequence[dict], heldout_share: float, seed: int) -> tuple[list, list]:
    """(held-out, train): a seeded ``heldout_share`` of the prompts and all their comparisons held out,
    so no response pair is judged on both sides of the split (several annotators judge one pair)."""
    prompts = sorted({c["prompt"] for c in comparisons})
    random.Random(seed).shuffle(prompts)
    n_held = int(round(len(prompts) * heldout_share)) if len(prompts) > 1 else 0
    n_held = min(max(n_held, 1 if heldout_share > 0 and len(prompts) > 1 else 0), len(prompts) - 1)
    held_prompts = set(prompts[:n_held])
    held = [c for c in comparisons if c["prompt"] in held_prompts]
    train = [c for c in comparisons if c["prompt"] not in held_prompts]
    return held, train or list(comparisons)


def load_backbone(backbone: str | Path):
    """(model, tokenizer): ``backbone`` as a one-label sequence classifier (from a causal-LM folder the
    score head starts random; from a sequence-classification folder it is kept)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(backbone))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        str(backbone), num_labels=1, use_safetensors=True, dtype=torch.float32
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def fit(
    model,
    tokenizer,
    train: Sequence[dict],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    max_len: int,
    seed: int,
):
    """``steps`` AdamW steps of the Bradley-Terry loss on random batches of ``train``; the losses."""
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
    model.eval()
    return losses


def measure(model, tokenizer, held: Sequence[dict], max_len: int = 160) -> tuple[dict[str, float], dict]:
    """(metrics, stats) on the held-out comparisons: the model's pairwise accuracy
    (``rm_heldout_accuracy``) beside the length baselines, and the mean and standard deviation of its
    raw scores over their responses (the fixed statistics of ``normalize=fixed``)."""
    prompts = [c["prompt"] for c in held]
    sc = score_texts(model, tokenizer, prompts, [c["chosen"] for c in held], max_len)
    sr = score_texts(model, tokenizer, prompts, [c["rejected"] for c in held], max_len)
    metrics = {"rm_heldout_accuracy": pairwise_accuracy(sc, sr), "heldout_comparisons": float(len(held))}
    metrics.update({f"baseline_{k}_accuracy": v for k, v in length_baselines(held).items()})
    xs = sc + sr
    mean = sum(xs) / len(xs)
    std = (sum((x - mean) ** 2 for x in xs) / len(xs)) ** 0.5
    return metrics, {"mean": mean, "std": std if std > 1e-8 else 1.0}


def policy_logprob_baseline(policy_dir: str | Path, held: Sequence[dict], max_len: int = 160) -> float:
    """Pairwise accuracy of the policy's own mean token log-prob of each response given its prompt
    (the baseline of "the policy already prefers it")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation.adapter import sequence_logprobs

    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), use_safetensors=True, dtype=torch.float32)
    model.eval()

    def mean_logprob(prompt: str, response: str) -> float:
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(response, add_special_tokens=False)["input_ids"]
        ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + p + r
        ids = ids[-max_len:]
        n = min(len(r), len(ids) - 1)
        return torch.tensor(sequence_logprobs(model, ids)[-n:]).mean().item() if n > 0 else 0.0

    chosen = [mean_logprob(c["prompt"], c["chosen"]) for c in held]
    rejected = [mean_logprob(c["prompt"], c["rejected"]) for c in held]
    return pairwise_accuracy(chosen, rejected)


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
    """Train on all but a held-out share of the prompts' ``comparisons`` (``split_by_prompt``); save
    to ``out_dir`` with ``STATS_FILE`` beside it; metrics: the loss, held-out pairwise accuracy
    (``rm_heldout_accuracy``) and the baselines on the same split."""
    if not comparisons:
        raise ValueError("no comparisons to train a reward model on; ingest preference data first")
    torch.manual_seed(seed)
    model, tokenizer = load_backbone(backbone)
    held, train = split_by_prompt(list(comparisons), heldout_share, seed)
    losses = fit(
        model, tokenizer, train, steps=steps, batch_size=batch_size, lr=lr, max_len=max_len, seed=seed
    )
    metrics = {
        "rm_loss_first": losses[0] if losses else float("nan"),
        "rm_loss_last": losses[-1] if losses else float("nan"),
        "train_comparisons": float(len(train)),
    }
    stats = {"mean": 0.0, "std": 1.0}
    if held:
        m, stats = measure(model, tokenizer, held, max_len)
        metrics.update(m)
    save(model, tokenizer, out_dir, stats)
    return metrics


def save(model, tokenizer, out_dir: str | Path, stats: dict) -> None:
    """``save_pretrained`` (safetensors) and the fixed normalisation statistics beside it."""
    from rewards.reward_model import STATS_FILE

    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / STATS_FILE).write_text(json.dumps(stats, indent=1, sort_keys=True))
