"""What the episode tests share (``test_episode_modes``, ``test_episode_features``, ``test_stateful``):
the tiny model shape, the SFT that teaches it to call the tool, the calculator prompts, verdicts,
the spies on the manager's batches and the kill switch of the resume tests. The model folders they
train are the session fixtures of ``conftest.py``."""

from __future__ import annotations

import torch

from conf.schema import ModelConfig
from generation.model import build_tiny_model, encode_problem
from generation.records import PromptItem
from tests.training.rl_fakes import Verdict, fit
from training.rl.manager import RolloutManager

TINY = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=128
)
CALL = "calc: 1+2"


def teach(tok, rows: list[list[int]], *, steps: int, lr: float):
    """The ``TINY`` model (seed 0) after ``steps`` full-batch AdamW steps on ``rows`` (token ids,
    right-padded, the padding masked out of the loss), in eval mode."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(ids == tok.pad_token_id, -100)
    return fit(build_tiny_model(TINY, tok, seed=0), ids, labels, steps=steps, lr=lr)


def _problem(tok, i: int) -> list[int]:
    return list(encode_problem(tok, "{problem}\n", f"{i % 4}+{i % 3}"))


def _call(tok) -> list[int]:
    return tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def taught_to_call(tok, steps: int = 200):
    """A tiny model taught (a few hundred SFT steps) to answer every prompt with ``calc: 1+2``."""
    return teach(tok, [_problem(tok, i) + _call(tok) for i in range(12)], steps=steps, lr=3e-3)


def taught_to_guess(tok, steps: int = 80):
    """A tiny model taught to answer every turn with ``calc: 1+2`` (a guess of 2), also after the
    guessing game's feedback, so its episodes run several turns."""
    feedback = ["\n= higher, above 2\n", "\n= again 2, higher, above 2\n"]
    rows = []
    for i in range(6):
        row = _problem(tok, i) + _call(tok)
        for text in feedback[: i % 2 + 1]:
            row += tok(text, add_special_tokens=False)["input_ids"] + _call(tok)
        rows.append(row)
    return teach(tok, rows, steps=steps, lr=6e-3)


def calc_prompts(tok, n: int, answer=lambda i: "3" if i % 2 == 0 else "99") -> list[PromptItem]:
    return [
        PromptItem(
            f"p{i}", f"{i % 4}+{i % 3}", answer(i), encode_problem(tok, "{problem}\n", f"{i % 4}+{i % 3}"), 1
        )
        for i in range(n)
    ]


class ToolSaysAnswer:
    """Right when the tool's result line ``= ANSWER`` is in the episode (so the policy called the tool
    and the tool computed the answer) and the episode's text has even length: the caller model's
    episodes all call ``calc: 1+2``, so a prompt whose answer is 3 gets mixed groups and one whose
    answer is 99 all-wrong ones."""

    def verify_batch(self, texts, answers):
        return [Verdict(f"= {a}\n" in t and len(t) % 2 == 0) for t, a in zip(texts, answers)]


class EvenLength:
    """Right when the episode's text has even length (mixed groups whatever the answer)."""

    def verify_batch(self, texts, answers):
        return [Verdict(len(t) % 2 == 0) for t, a in zip(texts, answers)]


def are_episodes(trajectories, share: float = 0.5) -> None:
    """Multi-turn episodes happened (at least ``share`` of them): tool calls, several turns,
    observation tokens masked out."""
    multi = [t for t in trajectories if t.turns > 1]
    assert len(multi) >= share * len(trajectories), [t.turns for t in trajectories]
    assert all(t.tool_calls > 0 and 0 in t.loss_mask for t in multi)
    assert all(len(t.loss_mask) == len(t.response_tokens) for t in trajectories)


def spy_batches(monkeypatch) -> list:
    """Every batch the manager hands the trainer (a list of ScoredGroups per update)."""
    batches = []
    original = RolloutManager.next_batch

    def spy(self):
        groups = original(self)
        if groups:
            batches.append([g for _, g in groups])
        return groups

    monkeypatch.setattr(RolloutManager, "next_batch", spy)
    return batches


def spy_groups(monkeypatch) -> list:
    """Every (group_uid, ScoredGroup) the manager hands the trainer, in order (the caller may clear it)."""
    groups_seen = []
    original = RolloutManager.next_batch

    def spy(self):
        groups = original(self)
        groups_seen.extend(groups or [])
        return groups

    monkeypatch.setattr(RolloutManager, "next_batch", spy)
    return groups_seen


class Killed(Exception):
    pass


def killer(ran: list, folder: str, kill_at: int | None = None):
    """An ``on_step`` that records (folder, step) of every update in ``ran`` and raises ``Killed`` at
    update ``kill_at``."""

    def on_step(m):
        ran.append((folder, m.step))
        if m.step == kill_at:
            raise Killed(kill_at)

    return on_step


def sigkill_trainer_at(step: int, ray, runtime):
    """An ``on_step`` that SIGKILLs the Ray runtime's lead trainer at update ``step`` (``runtime()``:
    the runtime, built after this callback)."""
    import os
    import signal

    def on_step(m):
        if m.step == step:
            os.kill(ray.get(runtime().trainer.lead.ping.remote()).pid, signal.SIGKILL)

    return on_step
