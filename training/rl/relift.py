"""ReLIFT: RL interleaved with online fine-tuning on the prompts the policy fails (``rl.relift``).

Ma et al. 2025, "Learning What Reinforcement Learning Can't: Interleaved Online Fine-Tuning for
Hardest Questions" (arXiv 2506.07527; ReLIFT). During RL, a prompt whose group the policy fails
(every response wrong, or the group's accuracy at or below ``rl.relift.threshold``) collects a correct
solution: DART's synthesised correct answer for it where one exists (``source=dart`` or
``dart_then_teacher``), or responses sampled from the teacher checkpoint (``teacher.path``) and kept
only when the run's verdict accepts them (``source=teacher``, or the fallback of ``dart_then_teacher``).
Solutions go into a bounded buffer (newest ``buffer_size`` prompts, one solution each, a prompt
solved again replacing its older solution); every ``rl.relift.every`` RL updates the trainer takes
``rl.relift.sft_steps`` fine-tuning steps on a seeded sample of the buffer (the response tokens' mean
negative log-likelihood, through the trainer's own optimizer at ``rl.relift.lr``), before the next
weights are published, so the next rollouts sample the fine-tuned policy.

Where it runs: the manager hands every completed group, kept or filtered by dynamic sampling, to
:meth:`Relift.observe` (``RolloutManager.on_completed``); the driver calls :meth:`Relift.after_update`
after each RL update. The local driver (``rl.runtime=local``, ``mode=sync``) wires both; the Ray
driver does not yet (the config refuses ``rl.relift`` there). Metrics per update: ``relift/collected``
(solutions added this update), ``relift/buffer`` (buffer size) and, on updates with a fine-tuning
step, ``relift/sft_loss`` (mean NLL per response token before each step) and ``relift/steps``.
A checkpoint keeps the buffer and the prompts still waiting for a solution (``relift.json``).
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from generation.records import GenRequest, PromptItem, ScoredGroup

STATE_FILE = "relift.json"
"""The buffer's part of an RL checkpoint (token ids as JSON lists)."""


@dataclass(frozen=True)
class Solution:
    """A failed prompt's solution: the prompt's tokens and a correct response's, ending with EOS (the
    loss covers the response). Its own record, not ``training.sft``'s, so editing SFT does not rerun RL."""

    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]


def collate(batch: Sequence[Solution], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), right-padded; labels are -100 outside the responses."""
    seqs = [ex.prompt_tokens + ex.response_tokens for ex in batch]
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    attn, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (ex, seq) in enumerate(zip(batch, seqs)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, len(ex.prompt_tokens) : len(seq)] = torch.tensor(ex.response_tokens)
    return ids, attn, labels


def failed(group: ScoredGroup, threshold: float) -> bool:
    """Whether the policy failed ``group``'s prompt: its accuracy is at or below ``threshold``
    (0: every response wrong, ReLIFT's hardest questions)."""
    correct = list(group.correct)
    return bool(correct) and sum(correct) / len(correct) <= threshold


def teacher_folder(path: str | None, student_dir: Path, reader: str) -> Path:
    """``teacher.path`` as a model folder sharing the student's tokenizer (the student: the model in
    ``student_dir``); a one-line error naming ``reader`` (the option that reads it) otherwise."""
    from generation.model import load_tokenizer
    from training.rl.critic import vocab_mismatch

    if not path or path == "self":
        raise ValueError(f"{reader} needs teacher.path=DIR (a model folder); got teacher.path={path}")
    folder = Path(path).expanduser()
    if not (folder / "config.json").exists():
        raise ValueError(f"teacher.path={path}: no model folder (config.json) there ({reader})")
    why = vocab_mismatch(load_tokenizer(Path(student_dir)), folder)
    if why is not None:
        raise ValueError(f"teacher.path={path}: {why}; {reader} needs the student's tokenizer")
    return folder


def dart_solutions(rft_path: Path, tokenizer, template: str) -> dict[str, Solution]:
    """The first DART-accepted response of each prompt in ``rft.parquet``, encoded as RFT encodes a
    single-turn row (the problem through ``template``, the response and EOS), by prompt id. ReLIFT is
    single-turn (the config refuses it with a multi-turn ``env``)."""
    from generation.model import encode_problem, encode_response
    from generation.setup import read_table

    out: dict[str, Solution] = {}
    for r in read_table(Path(rft_path)):
        if r["prompt_id"] not in out and r.get("verified", True) is not False:
            prompt = encode_problem(tokenizer, template, r["problem"])
            out[r["prompt_id"]] = Solution(prompt, encode_response(tokenizer, r["response"]))
    return out


class TeacherSolver:
    """Samples ``samples`` responses per prompt from the teacher checkpoint and keeps, per prompt, the
    first one ``score`` (the RL run's group scorer: the verdict) marks correct."""

    def __init__(
        self, folder: Path, score, *, samples: int, max_new_tokens: int, temperature: float, seed: int
    ):
        from conf.schema import EngineOptions
        from generation.engine import Engine
        from generation.model import load_model

        model, tokenizer = load_model(Path(folder), "cpu")
        self.engine = Engine(model, tokenizer, EngineOptions(capacity=256), device="cpu")
        self.score, self.samples = score, samples
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.sampled = 0

    def solve(self, prompts: Sequence[PromptItem]) -> dict[str, Solution]:
        """A verified teacher solution for each prompt of ``prompts`` it solved, by prompt id."""
        if not prompts:
            return {}
        requests = [GenRequest(prompt=p, sample_idx=i) for p in prompts for i in range(self.samples)]
        trajs = self.engine.generate(requests, self.max_new_tokens, self.temperature, self.generator)
        self.sampled += len(trajs)
        out: dict[str, Solution] = {}
        for k, p in enumerate(prompts):
            group = trajs[k * self.samples : (k + 1) * self.samples]
            scored = self.score(list(group))
            for t, ok in zip(group, scored.correct):
                if ok and t.finished:
                    out[p.prompt_id] = Solution(tuple(p.prompt_tokens), tuple(t.response_tokens))
                    break
        return out


class Relift:
    """The buffer of solutions to failed prompts and the interleaved fine-tuning steps (see the module
    docstring). ``cfg``: ``conf.schema.ReliftConfig``; ``dart``: DART's solutions by prompt id
    (``dart_solutions``); ``teacher``: a :class:`TeacherSolver` (None: no teacher); ``lr``: the
    fine-tuning steps' learning rate; ``seed``: the buffer sampling's."""

    def __init__(
        self,
        cfg,
        *,
        dart: dict[str, Solution] | None = None,
        teacher: TeacherSolver | None = None,
        lr: float,
        seed: int,
    ):
        self.cfg, self.dart, self.teacher, self.lr = cfg, dart or {}, teacher, lr
        self.seed = seed
        self.buffer: OrderedDict[str, Solution] = OrderedDict()
        self.pending: OrderedDict[str, PromptItem] = OrderedDict()
        """Failed prompts waiting for a solution (solved at the next update)."""
        self.updates = 0
        self.collected_total = 0

    # ------------------------------------------------------------------------------------------ collect
    def observe(self, groups: Iterable[ScoredGroup]) -> None:
        """Completed groups (the manager's hook): the failed ones' prompts wait for a solution."""
        for g in groups:
            if g.trajectories and failed(g, self.cfg.threshold):
                prompt = g.trajectories[0].prompt
                self.pending[prompt.prompt_id] = prompt

    def collect(self) -> int:
        """Solve the pending prompts (DART's answer first where the source allows, else the teacher);
        returns the solutions added to the buffer. Prompts nobody solved are dropped."""
        pending, self.pending = list(self.pending.values()), OrderedDict()
        found: dict[str, Solution] = {}
        if self.cfg.source in ("dart", "dart_then_teacher"):
            found = {p.prompt_id: self.dart[p.prompt_id] for p in pending if p.prompt_id in self.dart}
        if self.teacher is not None and self.cfg.source in ("teacher", "dart_then_teacher"):
            found.update(self.teacher.solve([p for p in pending if p.prompt_id not in found]))
        for pid, ex in found.items():
            self.buffer.pop(pid, None)
            self.buffer[pid] = ex
        while len(self.buffer) > self.cfg.buffer_size:
            self.buffer.popitem(last=False)
        self.collected_total += len(found)
        return len(found)

    # ------------------------------------------------------------------------------------------ fine-tune
    def after_update(self, trainer, metrics: dict[str, float]) -> None:
        """After an RL update: solve what failed, and every ``every`` updates fine-tune on the buffer."""
        self.updates += 1
        metrics["relift/collected"] = float(self.collect())
        if self.updates % self.cfg.every == 0 and self.buffer:
            losses = [self.sft_step(trainer, self.sample()) for _ in range(self.cfg.sft_steps)]
            metrics["relift/sft_loss"] = sum(losses) / len(losses)
            metrics["relift/steps"] = float(len(losses))
        metrics["relift/buffer"] = float(len(self.buffer))

    def sample(self) -> list[Solution]:
        """A batch of up to ``batch_size`` buffered solutions, drawn without replacement by a generator
        seeded with the run's seed and the update count (the same after a resume)."""
        items = list(self.buffer.values())
        rng = random.Random(f"relift:{self.seed}:{self.updates}")
        return rng.sample(items, min(self.cfg.batch_size, len(items)))

    def sft_step(self, trainer, batch: Sequence[Solution]) -> float:
        """One fine-tuning step of ``trainer``'s policy (a ``PolicyTrainer``) on ``batch``: the mean
        NLL of the response tokens, through the trainer's optimizer and gradient clipping at ``lr``.
        Returns the loss before the step."""
        loss_fn = nll_loss(trainer.forward_model, batch, trainer.pad_id, trainer.device)
        saved = [g["lr"] for g in trainer.opt.param_groups]
        trainer._zero_grad()
        loss = loss_fn()
        trainer._check_finite(loss=float(loss.detach()))
        trainer._backward(loss / max(1, trainer.world_size), boundary=True)
        for g in trainer.opt.param_groups:
            g["lr"] = self.lr
        try:
            trainer._step()
        finally:
            for g, lr in zip(trainer.opt.param_groups, saved):
                g["lr"] = lr
        return float(loss.detach())

    # ------------------------------------------------------------------------------------------ checkpoint
    def save(self, folder: Path) -> None:
        """The buffer, the pending prompts and the counters into ``folder/relift.json``."""
        state = {
            "updates": self.updates,
            "collected_total": self.collected_total,
            "buffer": [
                [pid, list(e.prompt_tokens), list(e.response_tokens)] for pid, e in self.buffer.items()
            ],
            "pending": [_prompt_json(p) for p in self.pending.values()],
        }
        (Path(folder) / STATE_FILE).write_text(json.dumps(state))

    def load(self, folder: Path) -> None:
        """Restore what :meth:`save` wrote (nothing to restore: an empty buffer)."""
        path = Path(folder) / STATE_FILE
        if not path.exists():
            return
        state = json.loads(path.read_text())
        self.updates, self.collected_total = int(state["updates"]), int(state["collected_total"])
        self.buffer = OrderedDict((pid, Solution(tuple(p), tuple(r))) for pid, p, r in state["buffer"])
        self.pending = OrderedDict((d["prompt_id"], PromptItem(**_prompt_args(d))) for d in state["pending"])


def nll_loss(model, batch: Sequence[Solution], pad_id: int, device: str) -> Callable[[], torch.Tensor]:
    """A closure computing ``model``'s mean NLL per response token over ``batch`` (padded batch)."""
    ids, attn, labels = (t.to(device) for t in collate(batch, pad_id))
    return lambda: model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss


@torch.no_grad()
def mean_nll(model, batch: Sequence[Solution], pad_id: int, device: str = "cpu") -> float:
    """``model``'s mean NLL per response token over ``batch``, in eval mode (no dropout)."""
    was = model.training
    model.eval()
    try:
        return float(nll_loss(model, batch, pad_id, device)())
    finally:
        model.train(was)


def _prompt_json(p: PromptItem) -> dict:
    return {
        "prompt_id": p.prompt_id,
        "text": p.text,
        "answer": p.answer,
        "prompt_tokens": list(p.prompt_tokens),
        "level": p.level,
    }


def _prompt_args(d: dict) -> dict:
    return {**d, "prompt_tokens": tuple(d["prompt_tokens"])}


def build_relift(run, *, model_dir: Path, tokenizer, template: str, score, dart_data: Path | None):
    """The run's :class:`Relift` (``run``: ``RLSections``; None when ``rl.relift`` is off): DART's
    solutions from ``dart_data`` (``rft.parquet``) and the teacher (``run.teacher.path``) as the source
    asks; a teacher with another tokenizer fails here, with one line, before any rollout."""
    cfg = run.rl.relift
    if not cfg.enabled:
        return None
    dart = {}
    if cfg.source in ("dart", "dart_then_teacher"):
        if dart_data is None or not Path(dart_data).exists():
            raise ValueError(f"rl.relift.source={cfg.source} needs DART's data (rft.parquet); none was given")
        dart = dart_solutions(Path(dart_data), tokenizer, template)
    teacher = None
    if cfg.source in ("teacher", "dart_then_teacher"):
        folder = teacher_folder(run.teacher.path if run.teacher else None, model_dir, "rl.relift")
        teacher = TeacherSolver(
            folder,
            score,
            samples=cfg.teacher_samples,
            max_new_tokens=run.rl.max_new_tokens,
            temperature=cfg.temperature,
            seed=run.seed,
        )
    return Relift(cfg, dart=dart, teacher=teacher, lr=cfg.lr or run.rl.lr, seed=run.seed)
