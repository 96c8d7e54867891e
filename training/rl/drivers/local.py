"""The local driver: one RL run in this process, the rollout manager's ``sync`` mode.

Read this file first. One engine is the only rollout, an in-process ``PolicyTrainer`` the trainer,
and ``training.rl.manager.RolloutManager`` makes every decision, as it does for the Ray driver
(``training.rl.drivers.ray``) and the simulator: it opens a batch (and further dynamic-sampling
rounds), orders the rollout to pull weights and generate, scores finished groups, hands the full
batch to the trainer and keeps the reward history and the consumed counts. The loop here only
carries the orders to the engine (``training.rl.rollout.run_order``, what the Ray rollout actor runs
too) and the batches to the trainer. The same seed samples the same tokens as ``rl.runtime=ray``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from environments.registry import wrap_engine
from generation.adapter import adapter_rank, load_published, model_dir_for_sampling
from generation.engines import make_engine
from generation.records import PromptItem
from training.objectives import ObjectiveParams
from training.rl.checkpoint import (
    load_trainer_extras,
    load_trainer_state,
    resume_run,
    save_run,
    save_trainer_extras,
    save_trainer_state,
)
from training.rl.loop import PromptCursor, RLResult, group_scorer, keep_filter, policy_copy
from training.rl.manager import ManagerSettings, RolloutManager
from training.rl.records import ExtractReply, PullResult, StepMetrics
from training.rl.rollout import run_order
from training.rl.sections import RLSections
from training.rl.trainer import PolicyTrainer

LOG = logging.getLogger("laminar.training")
ROLLOUT = "rollout-0"


class LocalDriver:
    """Synchronous RL in process from the checkpoint in ``model_dir`` (a full model, or an adapter
    folder: LoRA), configured by ``run`` (``training.rl.sections.RLSections``): ``run.rl`` (steps,
    batch, lengths, optimizer, ``eval_every``, ``checkpoint_every``), ``run.rollout`` (the engine),
    ``run.env`` (the episodes' environment; None or single_turn: one turn, the engine as it is) and
    ``run.sandbox`` (its tools'). With ``state_dir`` it checkpoints into ``state_dir/checkpoints``
    and resumes from the last checkpoint there.
    ``run()`` returns the ``RLResult``; ``final_model`` is the trained model."""

    def __init__(
        self,
        model_dir: Path,
        prompts: Sequence[PromptItem],
        reward,
        params: ObjectiveParams,
        run: RLSections,
        *,
        device: str,
        state_dir: Path | None = None,
        source: Callable | None = None,
        on_step: Callable[[StepMetrics], None] | None = None,
        evaluate: Callable[[object], dict[str, float]] | None = None,
        relift=None,
    ):
        rl = run.rl
        self.settings = ManagerSettings.from_config(rl, params)
        if self.settings.mode.name != "sync":
            raise ValueError(f"rl.mode={rl.mode} needs the Ray driver: set rl.runtime=ray (or auto)")
        self.sections, self.rl = run, rl
        self.model_dir, self.prompts, self.reward, self.params = (
            Path(model_dir),
            list(prompts),
            reward,
            params,
        )
        self.seed, self.device = run.seed, device
        self.checkpoint_dir = Path(state_dir) / "checkpoints" if state_dir is not None else None
        self.source_factory, self.on_step, self.evaluate = source, on_step, evaluate
        self.relift = relift
        """ReLIFT (``training.rl.relift.Relift``; None: off): fine-tuning steps between the updates."""
        self.result = RLResult()
        self.trainer: PolicyTrainer | None = None
        self.engine = None
        self.policy = None
        """The prompt source's own copy of the policy (HIVE's prompt entropy), when it has one."""
        self.source = None
        self.manager: RolloutManager | None = None
        self.final_model = None

    # ------------------------------------------------------------------------------------------ Outside
    def refresh(self) -> None:
        """Bring the prompt source's copy of the policy to the trainer's version."""
        if self.policy is not None and self.policy.version != self.trainer.version:
            load_published(self.policy.model, self.trainer.full_state())
            self.policy.version = self.trainer.version

    def poke(self, rollout: str) -> None:
        """Nothing to do: the loop asks the manager for the rollout's next order every turn."""

    def note(self, rollout: str, kind: str, version: int) -> None:
        """No timeline in process."""

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> RLResult:
        self._build()
        try:
            return self._loop()
        finally:  # an episode environment's endpoint, tool pool and agents end with the run
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()

    def _loop(self) -> RLResult:
        m, last = self.manager, time.perf_counter()
        while m.version < self.rl.steps:
            if m.next_batch():
                self._train(time.perf_counter() - last)
                last = time.perf_counter()
                continue
            opened = m.maybe_open_batch()
            order = m.dispatch(ROLLOUT)
            if order is None:
                if not opened:
                    raise RuntimeError("the local driver stalled: no work in flight and nothing to train")
                continue
            reply = run_order(self.engine, order, self.rl.chunk_steps, self._pull)
            if isinstance(reply, ExtractReply):
                m.extract_done(ROLLOUT, reply.partials, reply.queued, reply.status)
            else:
                m.step_done(ROLLOUT, reply.finished, reply.status, reply.pulled)
        self.trainer.model.eval()
        self.result.consumed, self.result.rewards, self.result.terms = m.consumed, m.rewards, m.terms
        self.final_model = self.trainer.model
        return self.result

    def _build(self) -> None:
        from training.lora import load_for_rl

        torch.manual_seed(self.seed)
        model, tokenizer = load_for_rl(self.model_dir, self.device)  # an adapter folder: LoRA
        self.trainer = PolicyTrainer.from_config(
            model, self.params, self.rl, pad_id=tokenizer.pad_token_id, device=self.device
        )
        # the only rollout holds the whole sync batch: half of it at a time decodes the second half as
        # rows joining late, ~3x the generation seconds on the default run
        capacity = max(self.rl.rollout_capacity, self.rl.prompts_per_step * self.rl.group_size)
        self.engine = make_engine(
            model_dir_for_sampling(self.model_dir),  # LoRA: the bare base; each adapter version merges in
            self.sections.engine_options(capacity, lora_rank=adapter_rank(self.model_dir)),
            device=self.device,
        )
        # single_turn: the engine itself
        self.engine = wrap_engine(self.engine, self.sections.env, tokenizer, self.sections.sandbox)
        self.engine.version = -1  # no published version yet: the first order pulls
        cursor = PromptCursor(self.prompts, self.seed)
        if self.source_factory is not None:
            self.policy = policy_copy(self.model_dir)
            self.source = self.source_factory(cursor, self.policy)
        else:
            self.source = cursor
        self.manager = RolloutManager(
            self.settings,
            self.source,
            group_scorer(self.reward, self.params, self.rl.max_new_tokens),
            self,
            [(ROLLOUT, "local", "local")],
            keep=keep_filter(self.params),
        )
        if self.relift is not None:
            self.manager.on_completed = self.relift.observe
        resumed = resume_run(
            self.checkpoint_dir, load_trainer=self._load_trainer, manager=self.manager, source=self.source
        )
        if resumed is not None:
            self.result.history = resumed.history

    def _pull(self, min_version: int) -> PullResult:
        """The rollout's weight pull: the trainer's latest version, straight from its model."""
        t0 = time.perf_counter()
        if self.engine.version != self.trainer.version:
            update = self.trainer.publish()
            self.engine.load_state(update.state, update.version)
        return PullResult(True, self.trainer.version, time.perf_counter() - t0)

    def _train(self, wall: float) -> None:
        """One update on the batch the manager handed out; its metrics, evaluation and checkpoint."""
        t0 = time.perf_counter()
        stats = self.trainer.update([g for _, g in self.manager.training])
        if self.relift is not None:  # before the next pull: the next batch samples the fine-tuned policy
            self.relift.after_update(self.trainer, stats.metrics)
        metrics = self.manager.updated(
            stats.version, stats, wall + time.perf_counter() - t0, time.perf_counter() - t0
        )
        version, rl = self.manager.version, self.rl
        if (
            self.evaluate is not None
            and rl.eval_every > 0
            and version % rl.eval_every == 0
            and version < rl.steps
        ):
            metrics.extra.update(self._evaluate())
        self.result.history.append(metrics)
        if (
            self.checkpoint_dir
            and rl.checkpoint_every
            and version % rl.checkpoint_every == 0
            and version < rl.steps
        ):
            path = save_run(
                self.checkpoint_dir,
                save_trainer=self._save_trainer,
                manager=self.manager,
                source=self.source,
                history=self.result.history,
                mode=self.settings.mode.name,
            )
            LOG.info("checkpoint %s", path)
        if self.on_step is not None:
            self.on_step(metrics)

    def _evaluate(self) -> dict[str, float]:
        """The in-run evaluation of the trainer's model as it stands, in eval mode."""
        model = self.trainer.model
        model.eval()
        try:
            return self.evaluate(model)
        finally:
            model.train()

    def _save_trainer(self, folder: Path) -> None:
        save_trainer_state(folder, self.trainer.model, self.trainer.opt, version=self.trainer.version)
        save_trainer_extras(folder, self.trainer)  # the critic, the reset reference, the entropy coefficient
        if self.relift is not None:
            self.relift.save(folder)  # ReLIFT's buffer and the prompts awaiting a solution

    def _load_trainer(self, folder: Path) -> int:
        self.trainer.version = int(
            load_trainer_state(folder, self.trainer.model, self.trainer.opt)["version"]
        )
        load_trainer_extras(folder, self.trainer)
        if self.relift is not None:
            self.relift.load(folder)
        return self.trainer.version
