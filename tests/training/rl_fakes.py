"""Small real fakes shared by the RL loop tests: a micro model config and a verdict record."""

from dataclasses import dataclass

import torch

from conf.schema import ModelConfig

MICRO = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=32
)


@dataclass(frozen=True)
class Verdict:
    """What the loop reads of a verifier's verdict."""

    correct: bool

    @property
    def reward(self) -> float:
        return float(self.correct)


def fit(model, ids, labels, *, steps: int, lr: float, attention_mask=None):
    """``model`` after ``steps`` full-batch AdamW steps on ``ids`` with ``labels`` (-100: no loss),
    in eval mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def saved_model(folder, model, tokenizer):
    """``model`` and ``tokenizer`` written as a checkpoint folder, which the RL drivers start from."""
    from pathlib import Path

    from generation.model import save_model

    save_model(model, tokenizer, Path(folder))
    return Path(folder)


def ray_rl(mode: str, **overrides):
    """A short ``rl.runtime=ray`` run of ``mode`` for the runtime tests: 3 steps of 4 prompts x 2, two
    rollouts' worth of capacity, a loose staleness bound and frequent repack checks (``overrides``:
    any other ``RLConfig`` field)."""
    from conf.schema import RLConfig

    kw = dict(
        mode=mode,
        runtime="ray",
        steps=3,
        prompts_per_step=4,
        group_size=2,
        lr=1e-3,
        max_new_tokens=12,
        rollout_capacity=8,
        chunk_steps=4,
        max_staleness=4,
        repack_interval_s=0.2,
        micro_batch_tokens=0,
    )
    return RLConfig(**{**kw, **overrides})


def micro_setup(kinds=()):
    """The char tokenizer, the ``MICRO`` model (seed 0) and one prompt per entry of ``kinds`` (id
    ``{kind}{i}``, answer ``kind``)."""
    from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
    from generation.records import PromptItem

    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    prompts = [PromptItem(f"{k}{i}", k, k, encode_prompt(tok, f"{k}{i}\n")) for i, k in enumerate(kinds)]
    return tok, model, prompts


def cpu_trainer(model, params, tok, *, max_new_tokens: int, lr=1e-3, max_grad_norm=1.0, **kw):
    """A ``PolicyTrainer`` on the CPU as the unit tests build it: no weight decay, temperature 1, the
    tokenizer's pad id (``kw``: any other constructor argument)."""
    from training.rl.trainer import PolicyTrainer

    return PolicyTrainer(
        model, params, lr=lr, weight_decay=0.0, max_grad_norm=max_grad_norm, temperature=1.0,
        max_new_tokens=max_new_tokens, pad_id=tok.pad_token_id, device="cpu", **kw,
    )  # fmt: skip
