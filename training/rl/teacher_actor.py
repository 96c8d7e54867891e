"""The teacher of on-policy distillation in a Ray actor of its own (the Ray driver; issue 54).

With the Ray driver the teacher's model does not live in the trainer actor: ``start_teacher`` starts
one ``TeacherWorker`` on the trainer's node (the same devices as the trainer and its reference model)
and puts its handle in the ``TeacherSpec`` the trainer's ranks receive; their ``Teacher.build`` then
returns a ``RemoteTeacher``. At the start of each update the trainer sends the batch's scored groups
to the actor (``submit``) and computes its own reference and proximal log-probs meanwhile; it waits
for the teacher's (B, T) log-probs only when it needs them (``logprobs``). The actor builds the
trainer's batch from the same groups and scores it with the trainer's own micro-batched forward
(``PolicyTrainer._logprobs_of``, ``_TeacherForward``) at the trainer's temperature and token budget,
so its log-probs are the in-process teacher's. Several trainer ranks asking for the same update cost
one forward: the actor keeps its last answer, by the trainer's version and the groups' samples.

The privileged self-teacher loads the student's RL-start weights from the model folder (as the
trainer does) and, with ``teacher.sync_every``, takes the trainer's weights from rank 0 every K
updates (a blocking call, so the next update's request sees them). An actor that dies is restarted by
Ray and its call retried: a folder teacher or a frozen self-teacher is rebuilt as it was; a synced
self-teacher is the RL-start copy again until the next sync (as after a resume).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from training.rl.teacher import Teacher, TeacherSpec
from training.rl.trainer import PolicyTrainer, _UpdateInputs, build_batch


class _TeacherForward:
    """The trainer's batched, micro-batched log-prob forward outside a trainer: ``PolicyTrainer``'s
    ``_logprobs_of`` and ``_response_logits`` with its settings (device, temperature, token budget,
    pad id, the packed forward), so the actor's log-probs are computed exactly as in process."""

    _logprobs_of = PolicyTrainer._logprobs_of
    _response_logits = PolicyTrainer._response_logits

    def __init__(self, device: str, temperature: float, micro_batch_tokens: int, pad_id: int):
        self.device, self.temperature = device, temperature
        self.micro_batch_tokens, self.pad_id = micro_batch_tokens, pad_id
        self.pack = True


class TeacherWorker:
    """The actor's body: the teacher's frozen model and the trainer's forward settings."""

    def __init__(
        self,
        spec: TeacherSpec,
        *,
        device: str,
        temperature: float,
        micro_batch_tokens: int,
        seed: int = 0,
        threads: int = 1,
    ):
        from generation.model import load_tokenizer
        from generation.setup import setup_torch

        setup_torch(threads, seed)
        spec = dataclasses.replace(spec, actor=None)
        policy = None
        if spec.is_self:  # the student's RL-start weights, loaded as the trainer loads them
            from training.lora import load_for_rl

            policy, _ = load_for_rl(Path(spec.tokenizer_dir), device)
        self.teacher = Teacher(spec, policy, device, copy_policy=False)
        pad_id = load_tokenizer(Path(spec.tokenizer_dir)).pad_token_id
        self.forward = _TeacherForward(device, temperature, micro_batch_tokens, pad_id)
        self._last: tuple[tuple, np.ndarray] | None = None
        self.calls = 0

    @torch.no_grad()
    def logprobs(self, version: int, groups: Sequence) -> np.ndarray:
        """(B, T) float32 log-probs of ``groups``' sampled tokens under the teacher, in the layout of
        the trainer's batch of ``groups``; the same ``version`` and groups again (another rank's
        call) are answered from the last call."""
        samples = (
            (t.prompt.prompt_id, t.sample_idx, t.response_tokens) for g in groups for t in g.trajectories
        )
        key = (version, *samples)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self.calls += 1
        batch = build_batch(groups, self.forward.pad_id)
        inp = _UpdateInputs(
            batch=batch,
            advantages=torch.zeros(0),
            mask=batch.mask.to(self.forward.device),
            targets=batch.targets.to(self.forward.device),
            lengths=batch.attention_mask.sum(1),
        )
        out = self.teacher.logprobs(self.forward, groups, inp).float().cpu().numpy()
        self._last = (key, out)
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """The self-teacher takes the student's weights (``teacher.sync_every``)."""
        self.teacher.model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        self._last = None

    def ping(self):
        """``ActorInfo`` for the run's CPU ledger (``ray_report.CpuLedger``)."""
        import os
        import time

        from training.rl.actors import _node_id
        from training.rl.records import ActorInfo

        return ActorInfo("teacher", os.getpid(), _node_id(), time.process_time())

    def count(self) -> int:
        """Forwards this incarnation computed (calls answered from the last one not counted)."""
        return self.calls


class RemoteTeacher:
    """Stands in for ``Teacher`` in a trainer rank: ``submit`` sends the update's groups to the actor,
    ``logprobs`` waits for its answer, ``after_update`` sends the self-teacher's syncs (rank 0)."""

    def __init__(self, spec: TeacherSpec):
        self.spec = spec
        self.handle = spec.actor
        self._pending: tuple[int, object] | None = None

    def submit(self, trainer, groups: Sequence) -> None:
        self._pending = (trainer.version, self.handle.logprobs.remote(trainer.version, list(groups)))

    def logprobs(self, trainer, groups: Sequence, inp) -> torch.Tensor:
        import ray

        if self._pending is None or self._pending[0] != trainer.version:
            self.submit(trainer, groups)
        ref, self._pending = self._pending[1], None
        out = torch.tensor(ray.get(ref), device=trainer.device)  # a copy: the store's is read-only
        if tuple(out.shape) != (inp.n, inp.mask.shape[1]):
            raise RuntimeError(
                f"the teacher actor's log-probs are {tuple(out.shape)}, the batch is "
                f"{(inp.n, inp.mask.shape[1])}: it scored other groups"
            )
        return out

    def after_update(self, trainer, metrics: dict[str, float]) -> None:
        every = self.spec.sync_every
        if self.spec.is_self and every and trainer.version % every == 0:
            if trainer.rank == 0:
                import ray

                state = {k: v.float().cpu().numpy() for k, v in trainer._policy_state_dict().items()}
                ray.get(self.handle.load_state.remote(state))
            metrics["teacher_sync"] = 1.0


def start_teacher(ray, params, rl, *, node: str, device: str, seed: int, threads: int):
    """``params`` (``ObjectiveParams``) with its teacher moved into a ``TeacherWorker`` actor pinned
    to ``node`` (the trainer's) with the forward settings of ``rl`` (``conf.schema.RLConfig``), and
    the actor's handle; ``params`` and None without a teacher. The actor reserves no CPU (it computes
    while the trainer computes its own log-probs and then waits for it, as the reward actor reserves
    none) and no GPU: it sees the node's devices and runs on ``device``, the trainer's."""
    spec = params.teacher
    if spec is None or params.distill_weight <= 0.0:
        return params, None
    from training.rl.drivers.ray_relays import pin

    actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(TeacherWorker)
    handle = actor.options(scheduling_strategy=pin(node)).remote(
        spec,
        device=device,
        temperature=rl.temperature,
        micro_batch_tokens=rl.micro_batch_tokens,
        seed=seed,
        threads=threads,
    )
    return dataclasses.replace(params, teacher=dataclasses.replace(spec, actor=handle)), handle
