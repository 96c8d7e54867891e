"""The teacher of on-policy distillation (``rl.algorithm=opd``, docs/distillation.md).

A teacher is a model folder sharing the student's tokenizer (``teacher.path=DIR``, e.g. an RL
checkpoint), or the *privileged self-teacher* (``teacher.path=self``): a copy of the student's own
weights, taken when the trainer is built (the RL start) and re-synchronised every
``teacher.sync_every`` updates, that reads each prompt with the reference answer in front of the
problem (``teacher.hint``) while the student reads the plain prompt. Either way the teacher scores the
student's own sampled tokens: its log-probs come from the trainer's batched, micro-batched forward
(``PolicyTrainer._logprobs_of``, the reference model's path) on the trainer's device: inside the
trainer process with the local driver (``Teacher``), in a Ray actor of its own with the Ray driver
(``training.rl.teacher_actor``: the spec carries the actor's handle and the trainer holds a
``RemoteTeacher`` that asks it for the batch's log-probs at the start of the update, while the
trainer computes its own reference and proximal log-probs).
A run resumed from an RL checkpoint rebuilds the self-teacher from the RL-start weights (it is not
checkpointed): frozen, that is the same teacher; with ``sync_every`` it differs until the next sync.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import torch

SELF = "self"
"""``teacher.path`` of the privileged self-teacher."""


@dataclass(frozen=True)
class TeacherSpec:
    """Which teacher the trainer builds. ``path``: a model folder or ``SELF``; ``tokenizer_dir``: the
    student's model folder (its tokenizer encodes the self-teacher's prompts); ``template``: the
    student's prompt template (``{problem}``); ``hint``: put before the problem for the self-teacher
    (``{answer}``: the reference answer); ``sync_every``: the self-teacher copies the student every N
    updates (0: frozen at the RL start); ``actor``: the Ray driver's teacher actor
    (``training.rl.teacher_actor.TeacherWorker``) that computes the log-probs, None: the trainer
    does, in process."""

    path: str
    tokenizer_dir: str = ""
    template: str = "{problem}"
    hint: str = "Answer: {answer}\n"
    sync_every: int = 0
    actor: object = None

    @property
    def is_self(self) -> bool:
        return self.path == SELF


def with_teacher(params, teacher_cfg, model_dir: Path, template: str):
    """``params`` (``ObjectiveParams``) with ``teacher_cfg``'s teacher (``conf.schema.TeacherConfig``)
    and weights; unchanged without ``teacher_cfg.path``. A folder teacher whose tokenizer is not the
    student's fails here, with one line, before any rollout."""
    if teacher_cfg is None or not teacher_cfg.path:
        return params
    if teacher_cfg.path != SELF:
        from generation.model import load_tokenizer
        from training.rl.critic import vocab_mismatch

        folder = Path(teacher_cfg.path).expanduser()
        if not (folder / "config.json").exists():
            raise ValueError(f"teacher.path={teacher_cfg.path}: no model folder (config.json) there")
        why = vocab_mismatch(load_tokenizer(Path(model_dir)), folder)
        if why is not None:
            raise ValueError(
                f"teacher.path={teacher_cfg.path}: {why}; the teacher needs the student's tokenizer"
            )
    spec = TeacherSpec(
        path=teacher_cfg.path if teacher_cfg.path == SELF else str(Path(teacher_cfg.path).expanduser()),
        tokenizer_dir=str(model_dir),
        template=template,
        hint=teacher_cfg.hint,
        sync_every=teacher_cfg.sync_every,
    )
    return dataclasses.replace(
        params, distill_weight=teacher_cfg.kl_weight, reward_weight=teacher_cfg.reward_weight, teacher=spec
    )


def privileged_text(template: str, hint: str, problem: str, answer: str) -> str:
    """The self-teacher's prompt: ``template`` around ``hint`` (its ``{answer}`` filled) + ``problem``."""
    return template.replace("{problem}", hint.replace("{answer}", answer) + problem)


class Teacher:
    """The teacher's frozen model on the trainer's device and, for the self-teacher, the tokenizer
    that writes its privileged prompts (cached by prompt id)."""

    def __init__(self, spec: TeacherSpec, policy, device: str, *, copy_policy: bool = True):
        """``policy``: the student (the self-teacher's weights: a copy, or ``policy`` itself when
        ``copy_policy`` is off, for a caller that loaded it for the teacher alone)."""
        self.spec = spec
        if spec.is_self:
            from generation.model import load_tokenizer

            model = copy.deepcopy(policy) if copy_policy else policy
            self.tokenizer = load_tokenizer(Path(spec.tokenizer_dir))
        else:
            from generation.model import load_model

            model, _ = load_model(Path(spec.path), "cpu")
            self.tokenizer = None
        self.model = model.to(device).eval().requires_grad_(False)
        self._prompts: dict[str, tuple[int, ...]] = {}

    @classmethod
    def build(cls, params, policy, device: str) -> Teacher | None:
        """The teacher ``params`` (``ObjectiveParams``) asks for; None when it distils from none."""
        if params.distill_weight <= 0.0:
            return None
        if params.teacher is None:
            raise ValueError("distill_weight > 0 needs a teacher: set teacher.path=DIR or teacher.path=self")
        if params.teacher.actor is not None:  # the Ray driver's teacher actor
            from training.rl.teacher_actor import RemoteTeacher

            return RemoteTeacher(params.teacher)
        return cls(params.teacher, policy, device)

    def submit(self, trainer, groups: Sequence) -> None:
        """Called at the start of an update: the in-process teacher computes when asked
        (``logprobs``); ``RemoteTeacher`` starts its actor here."""

    def prompt_tokens(self, prompt) -> tuple[int, ...]:
        """What the teacher reads before ``prompt``'s response (a ``PromptItem``): the prompt itself,
        or for the self-teacher the privileged prompt with the answer. A multi-turn episode keeps its
        observation tokens in the response, so only the first prompt changes."""
        if not self.spec.is_self:
            return tuple(prompt.prompt_tokens)
        if prompt.prompt_id not in self._prompts:
            from generation.model import encode_prompt

            text = privileged_text(self.spec.template, self.spec.hint, prompt.text, prompt.answer)
            self._prompts[prompt.prompt_id] = encode_prompt(self.tokenizer, text)
        return self._prompts[prompt.prompt_id]

    def groups(self, groups: Sequence) -> list:
        """``groups`` (``ScoredGroup``) as the teacher reads them: each trajectory's prompt tokens
        replaced by ``prompt_tokens``; responses unchanged."""
        out = []
        for g in groups:
            trajs = [
                dataclasses.replace(
                    t, prompt=dataclasses.replace(t.prompt, prompt_tokens=self.prompt_tokens(t.prompt))
                )
                for t in g.trajectories
            ]
            out.append(dataclasses.replace(g, trajectories=tuple(trajs)))
        return out

    @torch.no_grad()
    def logprobs(self, trainer, groups: Sequence, inp) -> torch.Tensor:
        """(B, T) log-probs of the student's sampled tokens under the teacher, laid out as ``inp``
        (the trainer's ``_UpdateInputs`` of ``groups``), through ``trainer._logprobs_of``."""
        if not self.spec.is_self:
            return trainer._logprobs_of(self.model, inp)
        from training.rl.trainer import build_batch

        batch = build_batch(self.groups(groups), trainer.pad_id)
        seen = dataclasses.replace(inp, batch=batch, lengths=batch.attention_mask.sum(1))
        return trainer._logprobs_of(self.model, seen)

    def after_update(self, trainer, metrics: dict[str, float]) -> None:
        """The self-teacher copies the student's weights every ``sync_every`` updates."""
        every = self.spec.sync_every
        if self.spec.is_self and every and trainer.version % every == 0:
            self.model.load_state_dict(trainer._policy_state_dict())
            metrics["teacher_sync"] = 1.0


def teacher_metrics(teacher_kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``teacher_kl``: the mean per-token reverse KL to the teacher (``log pi - log pi_teacher`` on
    the sampled tokens, under the weights before the update) over ``mask``'s tokens."""
    m = mask.bool()
    return {"teacher_kl": float(teacher_kl[m].mean()) if m.any() else 0.0}
