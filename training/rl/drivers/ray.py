"""The Ray driver (the Laminar runtime): trainer, relays and rollouts as Ray actors around the
rollout manager.

The driver (this module, in the RL stage's process) holds the rollout manager
(``training.rl.manager``: prompt queue, experience buffer, batch gate, per-rollout state and every
scheduling decision) and is only its transport: it starts the actors, keeps at most one call in
flight per actor, and hands whichever returns first (``ray.wait``) to the manager:

- a rollout's ``step`` returns finished trajectories and its status (``StepReply``); the manager
  then decides what the rollout does next (``StepOrder``: prompts, handed-over partials, a pull) or
  that it hands its work to another (``ExtractOrder``, a repack);
- the trainer's ``train`` returns after one update (``TrainReply``), having pushed the new version to
  the master relay; the mode decides what rollouts do about it (``control.MODES``);
- a rollout that dies loses only its in-flight requests, which go back to the prompt queue; Ray
  restarts it and it pulls weights from its node's relay. A relay that dies is cut out of the
  chain (its node's rollouts bypass to the master) and rebuilt (here: relay health is transport).

Its collaborators, one module each: ``ray_start`` (starting Ray, the actors' environment),
``ray_relays`` (the relay chain: wiring, health, rebuilds), ``ray_rollouts`` (the rollout actors and
the transport of the manager's orders), ``ray_trainer`` (the trainer's ranks), ``ray_report`` (the
CPU ledger and the run's summary) and ``background_eval`` (the in-run evaluation beside the loop).

Checkpoints (``rl.checkpoint_every``) are the record every driver writes (``training.rl.checkpoint
.save_run``): the trainer's weights, optimizer and RNG, the prompt source, the manager's state
(prompt queue, buffered trajectories, requests in flight) and the history; a rerun resumes from the
last complete one with the same prompt order. After each update the relays keep the versions the
manager says in-flight work still uses (``RolloutManager.retained_versions``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from collections.abc import Callable, Sequence

import torch

from generation.adapter import load_published
from generation.records import PromptItem
from training.objectives import ObjectiveParams
from training.rl.control import RelayChain
from training.rl.checkpoint import resume_run, save_run
from rewards.compose import as_reward
from training.rl.drivers.background_eval import BackgroundEval
from training.rl.drivers.ray_relays import KEEP_VERSIONS, RelayFleet
from training.rl.drivers.ray_report import run_summary
from training.rl.drivers.ray_rollouts import RolloutFleet, rollout_node
from training.rl.drivers.ray_start import check_capacity, kill_actors, live_nodes, start_ray
from training.rl.drivers.ray_trainer import release_placement_group, start_trainers
from training.rl.loop import PromptCursor, RLResult, group_scorer, keep_filter, policy_copy
from training.rl.reward_actor import with_reward_actor
from training.rl.manager import ManagerSettings, RolloutManager
from training.rl.records import StepMetrics, TrainReply
from training.rl.sections import RLSections
from training.rl.teacher_actor import start_teacher

# re-exported: the driver's public names before its collaborators moved to modules of their own
from training.rl.drivers.ray_rollouts import WAKE_GROUP, rollout_actor_class  # noqa: F401
from training.rl.drivers.ray_start import MALLOC_ENV, actor_env  # noqa: F401

# the names LaminarRuntime.__init__ annotates its attributes with
from training.rl.drivers.ray_report import CpuLedger as _CpuLedger
from training.rl.drivers.ray_rollouts import RolloutActor as _RolloutActor
from training.rl.drivers.ray_trainer import TrainerGroup as _TrainerGroup

LOG = logging.getLogger("laminar.training")


class LaminarRuntime:
    """One RL run on Ray in any of ``control.MODES``, configured by the schema's sections in ``run``
    (``training.rl.sections.RLSections``): ``rl`` (steps, batch, mode, staleness, repack,
    checkpoints), ``cluster`` (where the roles run), ``trainer``, ``rollout`` (the engine), ``env``
    and ``sandbox``. ``run()`` returns an ``RLResult`` whose history has one ``StepMetrics`` per update, plus
    ``self.timeline`` and ``self.summary``. With ``state_dir`` it checkpoints every
    ``rl.checkpoint_every`` updates into ``state_dir/checkpoints`` and resumes from the last one."""

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
    ):
        self.sections = run
        self.settings = ManagerSettings.from_config(run.rl, params)
        self.mode = self.settings.mode
        self.env_cfg, self.sandbox = run.env, run.sandbox
        self.model_dir = Path(model_dir)
        self.prompts = list(prompts)
        self.reward = reward
        self.params = params
        self.rl = run.rl
        self.cluster, self.trainer_cfg, self.rollout_cfg = run.cluster, run.trainer, run.rollout
        self.seed = run.seed
        self.device = device
        self.checkpoint_dir = Path(state_dir) / "checkpoints" if state_dir is not None else None
        self.extensions_dir = (
            str(Path(state_dir).parent / "torch_extensions") if state_dir is not None else None
        )
        self.source_factory = source
        self.on_step = on_step
        self.evaluate = evaluate
        self.timeline: dict = {"rollouts": [], "samples": [], "events": [], "updates": []}
        self.summary: dict = {}
        # the run's state, built by run()
        self.nodes: list[str] = []
        self.relays: dict[str, object] = {}
        self.chain = RelayChain([])
        self.rollouts: dict[str, _RolloutActor] = {}
        self.trainer: _TrainerGroup | None = None
        self.teacher_actor = None
        """OPD's teacher actor (``training.rl.teacher_actor``); None without a teacher."""
        self.trainer_nodes: list[str] = []
        self.manager: RolloutManager | None = None
        self.cursor: PromptCursor | None = None
        self.source = None
        self.local_engine = None
        self.local_version = 0
        self.result = RLResult()
        self.cpu: _CpuLedger | None = None
        self.final_model = None
        self.final_state: dict | None = None
        self.resumed_from: int | None = None
        self.t0 = time.perf_counter()
        self._own_ray = False
        self._checkpoint_due = False

    @property
    def version(self) -> int:
        """The trainer's latest version (0 before the run starts)."""
        return self.manager.version if self.manager is not None else 0

    # ------------------------------------------------------------------------------------------ Outside
    def refresh(self) -> None:
        """Keep the driver's copy of the policy (HIVE's prompt entropy) at the latest version."""
        if self.source is self.cursor or self.local_version == self.manager.version:
            return
        import ray

        got = self.relay_fleet.latest()
        if got is not None:
            load_published(self.local_engine.model, ray.get(got.box[0]))
            self.local_version = got.version

    def poke(self, rollout: str) -> None:
        """``rollout`` has news: ``RolloutFleet.poke`` cuts a wait on its tools short."""
        self.rollout_fleet.poke(rollout)

    def note(self, rollout: str, kind: str, version: int) -> None:
        self.timeline["events"].append(
            {"t": time.perf_counter() - self.t0, "rollout": rollout, "kind": kind, "version": version}
        )

    # ------------------------------------------------------------------------------------------ setup
    def _build(self, ray) -> None:
        """Every actor: a relay per node (chained, master on the driver's node), the rollouts, the
        trainer's ranks; the trainer's lead pushes to the master relay."""
        c = self.cluster
        self.nodes = live_nodes(ray)
        check_capacity(ray, c, self.trainer_cfg.ranks, len(self.nodes))
        self.relay_fleet = RelayFleet(ray, c.relay_cpus)
        self.relays, self.chain = self.relay_fleet.relays, self.relay_fleet.chain
        self.relay_fleet.start(self.nodes)
        self._build_rollouts(ray)
        threads = c.trainer_threads or c.actor_threads
        params, self.teacher_actor = start_teacher(  # OPD: the teacher in an actor of its own
            ray,
            self.params,
            self.rl,
            node=self.nodes[c.trainer_node % len(self.nodes)],
            device=self.device,
            seed=self.seed,
            threads=threads,
        )
        self.trainer, self.trainer_nodes = start_trainers(
            ray,
            c,
            self.trainer_cfg,
            self.nodes,
            self.device,
            (str(self.model_dir), params, self.rl, self.trainer_cfg),
            dict(
                device=self.device,
                seed=self.seed,
                threads=threads,
                extensions_dir=self.extensions_dir,
            ),
        )
        ray.get(self.trainer.lead.set_master.remote(self.relay_fleet.master))

    def _build_rollouts(self, ray) -> None:
        from generation.engines import engine_kind

        engine_kind(self.rollout_cfg)  # an unknown engine fails here, before any actor starts
        c = self.cluster
        self.rollout_fleet = RolloutFleet()
        self.rollouts = self.rollout_fleet.actors
        self.rollout_fleet.start(
            ray,
            c,
            [rollout_node(c, self.nodes, i) for i in range(c.rollouts)],
            (str(self.model_dir), self.sections),
            dict(device=self.device),
        )
        self.timeline["rollouts"] = list(self.rollouts)

    def _prepare(self, ray):
        """The driver's side: its policy copy, the prompt source and the manager; resume if a
        checkpoint is there; version 0 (or the resumed one) goes to the relays before any rollout starts."""
        torch.manual_seed(self.seed)
        self.local_engine = policy_copy(self.model_dir)  # HIVE's prompt entropy, in-run eval
        # an adapter's bare base takes version 0 from the relay
        self.local_version = self.local_engine.version
        model = self.local_engine.model
        self.cursor = PromptCursor(self.prompts, self.seed)
        self.source = (
            self.source_factory(self.cursor, self.local_engine) if self.source_factory else self.cursor
        )
        self.manager = RolloutManager(
            self.settings,
            self.source,
            group_scorer(with_reward_actor(ray, as_reward(self.reward)), self.params, self.rl.max_new_tokens),
            self,
            [(a.name, a.node, self.chain.relay_for(a.node)) for a in self.rollouts.values()],
            keep=keep_filter(self.params),
        )
        self.background_eval = BackgroundEval(self.evaluate)
        self.t0 = time.perf_counter()
        self._resume(ray)
        self.trainer.get(ray, "publish")
        return model

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> RLResult:
        threads = torch.get_num_threads()
        if self.cluster.driver_threads:
            torch.set_num_threads(self.cluster.driver_threads)
        ray, self._own_ray = start_ray(self.cluster, self.trainer_cfg.ranks)
        try:
            self._build(ray)
            return self._loop(ray)
        finally:
            self._teardown(ray)
            torch.set_num_threads(threads)

    def _role_handles(self, rollouts: bool) -> dict:
        handles = {f"trainer-{i}": h for i, h in enumerate(self.trainer.handles)}
        handles.update(self.relays)
        if self.teacher_actor is not None:
            handles["teacher"] = self.teacher_actor
        if rollouts:
            handles.update(self.rollout_fleet.alive_handles(self.manager))
        return handles

    def _teardown(self, ray) -> None:
        group = self.trainer
        handles = [*(group.handles if group is not None else []), *[a.handle for a in self.rollouts.values()]]
        handles += [self.teacher_actor] if self.teacher_actor is not None else []
        kill_actors(ray, [*handles, *self.relays.values()])
        release_placement_group(group)
        if self._own_ray:
            ray.shutdown()

    def _loop(self, ray) -> RLResult:
        """The event loop: feed the trainer, open batches, dispatch idle rollouts, repack, check the
        relays; then wait for whichever call returns first and hand its result to the manager."""
        model = self._prepare(ray)
        m, fleet = self.manager, self.rollout_fleet
        self.cpu = _CpuLedger()
        self.cpu.see("driver", os.getpid(), time.process_time())
        self.cpu.ping_all(ray, self._role_handles(rollouts=True))
        trainer_future = None
        last_update_t = last_repack = last_relay_check = time.perf_counter()
        while m.version < self.rl.steps:
            now = time.perf_counter()
            if trainer_future is None and m.next_batch():
                trainer_future = self.trainer.call("train", [g for _, g in m.training])
            if self.mode.batched:
                m.maybe_open_batch()
            fleet.dispatch_idle(m, self.relays, self.rl.chunk_steps)
            if self.mode.repack and now - last_repack > self.rl.repack_interval_s:
                m.repack()
                last_repack = now
            if now - last_relay_check > 1.0:
                self._check_relays()
                fleet.revive(ray, m)
                last_relay_check = now
            futures = fleet.futures() + ([trainer_future] if trainer_future is not None else [])
            if not futures:
                self._idle()
                continue
            done, _ = ray.wait(futures, num_returns=1, timeout=1.0)
            for fut in done:
                if fut is trainer_future:
                    reply = ray.get(fut)  # a dead trainer ends the run: rerun resumes from the checkpoint
                    self.trainer.settle(ray)
                    trainer_future = None
                    self._after_update(ray, reply, time.perf_counter() - last_update_t)
                    last_update_t = last_repack = time.perf_counter()
                else:
                    self._on_result(ray, fleet.owner(fut), fut)
        return self._finish(ray, model)

    def _idle(self) -> None:
        counts = self.manager.counts
        if counts["idle_spins"] > 20000:
            raise RuntimeError("the runtime stalled: no work in flight and nothing to train")
        counts["idle_spins"] += 1
        time.sleep(0.01)

    def _finish(self, ray, model) -> RLResult:
        self.background_eval.join()
        self.cpu.see("driver", os.getpid(), time.process_time())
        self.cpu.ping_all(ray, self._role_handles(rollouts=False))  # rollouts report with their results
        self.result.consumed = self.manager.consumed
        self.result.rewards = self.manager.rewards
        self.result.terms = self.manager.terms
        self.summary = run_summary(
            self.manager,
            self.result.history,
            time.perf_counter() - self.t0,
            self.chain,
            rollouts=self.cluster.rollouts,
            trainer={"backend": self.trainer_cfg.backend, "nodes": self.trainer_nodes},
            cpu=self.cpu.report(),
        )
        state = self.trainer.get(ray, "state")
        load_published(model, state)
        self.final_model = model
        self.final_state = state  # a LoRA run's adapter tensors: the RL stage writes them as a PEFT folder
        return self.result

    # ------------------------------------------------------------------------------------------ rollouts
    def _on_result(self, ray, a: _RolloutActor, fut) -> None:
        sample = self.rollout_fleet.collect(ray, a, fut, self.manager, self.cpu)
        if sample is not None:  # None: it died
            self.timeline["samples"].append({"t": time.perf_counter() - self.t0, **sample})

    # ------------------------------------------------------------------------------------------ relays
    def _check_relays(self) -> None:
        """Replace the relays that stopped answering (``RelayFleet.heal``); note each on the timeline."""
        for name in self.relay_fleet.heal(self.trainer.lead, self.manager):
            event = {"t": time.perf_counter() - self.t0, "rollout": "", "kind": "relay_dead"}
            self.timeline["events"].append({**event, "version": self.manager.version, "relay": name})

    # ------------------------------------------------------------------------------------------ updates
    def _after_update(self, ray, reply: TrainReply, wall: float) -> None:
        m = self.manager.updated(reply.stats.version, reply.stats, wall, reply.train_s)
        version = self.manager.version
        self.timeline["updates"].append({"t": time.perf_counter() - self.t0, "version": version})
        m.publish_stall_s, m.publish_cpu_s = reply.publish_stall_s, reply.publish_cpu_s
        m.wall_seconds = time.perf_counter() - self.t0
        self.relay_fleet.retain(sorted(self.manager.retained_versions(KEEP_VERSIONS)))
        if (
            self.evaluate is not None
            and self.rl.eval_every > 0
            and version % self.rl.eval_every == 0
            and version < self.rl.steps
        ):
            # beside the loop (``BackgroundEval``): its metrics join ``m`` when it finishes
            self.background_eval.start(m, self.local_engine.model, self.trainer.get(ray, "state"))
        self.result.history.append(m)
        if self.on_step is not None:
            self.on_step(m)
        if self.checkpoint_dir and self.rl.checkpoint_every and version % self.rl.checkpoint_every == 0:
            self._checkpoint_due = True
        # a checkpoint holds the history with every evaluation's metrics: one due while an evaluation
        # still runs beside the loop is written at the first update after it finished, so the loop
        # never waits for the evaluation (it did, 5-8 s per evaluation on the 2-core default task)
        if self._checkpoint_due and version < self.rl.steps and not self.background_eval.running():
            self._checkpoint(ray)
            self._checkpoint_due = False

    # ------------------------------------------------------------------------------------------ checkpoints
    def _checkpoint(self, ray) -> None:
        self.background_eval.join()  # the history it writes holds the evaluation's metrics
        path = save_run(
            self.checkpoint_dir,
            save_trainer=lambda folder: self.trainer.get(ray, "save", str(folder)),
            manager=self.manager,
            source=self.source,
            history=self.result.history,
            mode=self.mode.name,
        )
        self.manager.counts["checkpoints"] += 1
        LOG.info("checkpoint %s", path)

    def _resume(self, ray) -> None:
        resumed = resume_run(
            self.checkpoint_dir,
            load_trainer=lambda folder: self.trainer.get(ray, "load", str(folder)),
            manager=self.manager,
            source=self.source,
        )
        if resumed is not None:
            self.result.history = resumed.history
            self.resumed_from = resumed.version
