"""The Laminar runtime: trainer, relays and rollouts as Ray actors, driven by the control plane.

The driver (this module, in the RL stage's process) is the rollout manager and holds the
experience buffer: plain Python from ``training.rl.control``. It keeps at most one call in flight
per actor and reacts to whichever returns first (``ray.wait``):

- a rollout's ``step`` returns finished trajectories (into the buffer) and its status (occupancy);
  the driver then tops it up with prompts, hands it partials from a repack, tells it to pull;
- the trainer's ``train`` returns after one update, having pushed the new version to the master
  relay; the mode decides what rollouts do about it (``control.MODES``);
- a rollout that dies loses only its in-flight requests, which go back to the prompt queue; Ray
  restarts it and it pulls weights from its node's relay. A relay that dies is cut out of the
  chain (its node's rollouts bypass to the master) and rebuilt.

Checkpoints (``rl.checkpoint_every``) hold the trainer's weights, optimizer and RNG, the data
cursor, the prompt queue, buffered trajectories and the requests in flight; a rerun resumes from
the last complete one with the same prompt order.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from training.objectives import ObjectiveParams
from training.rl import control
from training.rl.control import MODES, ExperienceBuffer, PromptQueue, RelayChain, RolloutView
from training.rl.loop import Collected, PromptCursor, RLResult, overlong_shaping, score_phase, step_metrics
from generation.records import GenRequest, Partial, PromptItem, ScoredGroup, Trajectory

LOG = logging.getLogger("laminar.training")

# glibc malloc in the actors: keep freed blocks below 32 MiB in the heap (and up to 256 MiB of free
# heap before trimming) instead of unmapping them. Torch on the CPU allocates and frees the same
# activation and cache-sized tensors every decode step and update; by default each large one comes
# back as fresh pages to fault in. Measured on the 2-core machine (rl_throughput, laminar, 40
# updates): trainer page faults 271k -> 56k and rollouts' 84-142k -> 12k; system time 0.8 CPU-s lower
# at capacity 64, more at 128. A value already in the environment wins.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


def actor_env(threads: int) -> dict[str, str]:
    """The environment of every actor the runtime starts (Ray's ``runtime_env``): ``threads`` intra-op
    threads, no tokenizer threads, and ``MALLOC_ENV`` unless the driver's environment sets it."""
    return {**{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()},
            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class RuntimeConfig:
    """Everything the runtime needs beyond the RL hyper-parameters (see ``conf.schema.ClusterConfig``)."""

    mode: str = "laminar"
    rollouts: int = 2
    capacity: int = 64
    chunk_steps: int = 8
    max_staleness: int | None = 4
    admit_lag: int = 1
    repack_interval_s: float = 0.5
    repack_b: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: Path | None = None
    address: str | None = None
    num_cpus: float | None = None
    trainer_cpus: float = 0.5
    rollout_cpus: float = 0.5
    relay_cpus: float = 0.05
    actor_threads: int = 1
    trainer_threads: int = 1
    driver_threads: int = 0  # torch threads of this process while the roles run; 0 = leave them
    rollout_priority: str = "idle"
    keep_versions: int = 2
    max_restarts: int = 3
    trainer_node: int = 0
    namespace: str | None = None
    trainer_backend: str = "torch"
    ds_config: dict | None = None
    trainer_ranks: int = 1
    trainer_strategy: str = "PACK"
    dist_backend: str = "auto"
    rollout_nodes: tuple = ()
    extensions_dir: str | None = None
    engine_options: dict | None = None
    rollout_gpus: float = 0.0
    trainer_gpus: float = 0.0


class _TrainerGroup:
    """The trainer's ranks as one handle. ``call`` invokes a method on every rank and returns rank
    0's ref (the other ranks' refs wait in ``pending`` until ``settle``); ``get`` calls every rank
    and returns rank 0's value; ``lead`` is rank 0 alone (it talks to the relays)."""

    def __init__(self, handles: list, pg=None):
        self.handles = handles
        self.lead = handles[0]
        self.pg = pg
        self.pending: list = []

    def call(self, method: str, *args):
        refs = [getattr(h, method).remote(*args) for h in self.handles]
        self.pending = refs[1:]
        return refs[0]

    def settle(self, ray) -> None:
        if self.pending:
            ray.get(self.pending)
        self.pending = []

    def get(self, ray, method: str, *args):
        return ray.get([getattr(h, method).remote(*args) for h in self.handles])[0]


@dataclass
class _Rollout:
    name: str
    node: str
    handle: object
    relay: str
    future: object = None
    op: str = ""
    assigned: dict = field(default_factory=dict)
    """(group_uid, sample_idx) -> GenRequest for work this rollout holds (queued or active)."""
    version: int = -1
    active: int = 0
    queued: int = 0
    prev_active: int = 0
    alive: bool = True
    draining: bool = False
    pending_inject: list = field(default_factory=list)
    extract_to: str | None = None
    restarts: int = 0
    awaiting: int = 0
    """Repacks on their way to this rollout (it must not pull a new version before they land)."""
    pid: int = 0
    last_sent: list = field(default_factory=list)
    pulling: bool = False
    """The call in flight loads new weights: ``version`` is stale until it returns."""


class LaminarRuntime:
    """One RL run on Ray in any of ``control.MODES``. ``run()`` returns an ``RLResult`` whose history
    has one dict per update, plus ``self.timeline`` and ``self.summary``."""

    def __init__(self, model_dir: Path, prompts: Sequence[PromptItem], verifier, params: ObjectiveParams, *,
                 steps: int, prompts_per_step: int, group_size: int, lr: float, weight_decay: float,
                 max_grad_norm: float, max_new_tokens: int, temperature: float, seed: int, device: str,
                 minibatches: int, rc: RuntimeConfig, micro_batch_tokens: int = 0,
                 source: Callable | None = None, on_step: Callable[[dict], None] | None = None,
                 evaluate: Callable[[object], dict[str, float]] | None = None, eval_every: int = 0):
        if rc.mode not in MODES:
            raise ValueError(f"rl.mode={rc.mode!r}: expected one of {sorted(MODES)}")
        self.mode = dataclasses.replace(MODES[rc.mode], admit_lag=rc.admit_lag)
        self.model_dir = Path(model_dir)
        self.prompts = list(prompts)
        self.verifier = verifier
        self.params = params
        self.steps = steps
        self.n = prompts_per_step
        self.group_size = group_size
        self.train_kw = dict(lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, temperature=temperature,
                             max_new_tokens=max_new_tokens, minibatches=minibatches,
                             micro_batch_tokens=micro_batch_tokens)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.device = device
        self.rc = rc
        self.source_factory = source
        self.on_step = on_step
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.timeline: dict = {"rollouts": [], "samples": [], "events": [], "updates": []}
        self.summary: dict = {}

    # ------------------------------------------------------------------------------------------ setup
    def _start_ray(self):
        import ray

        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            kw = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True,
                      runtime_env={"env_vars": actor_env(self.rc.actor_threads)}, namespace=self.rc.namespace)
            if self.rc.address:
                ray.init(address=self.rc.address, **kw)
            else:  # Ray's CPUs are a scheduling resource: enough for every role, however many cores
                ray.init(num_cpus=max(self.rc.num_cpus or os.cpu_count(), math.ceil(self._cpus_needed(1))), **kw)
        return ray

    def _cpus_needed(self, nodes: int) -> float:
        return (self.rc.trainer_ranks * self.rc.trainer_cpus + self.rc.rollouts * self.rc.rollout_cpus
                + nodes * self.rc.relay_cpus)

    def _build(self, ray) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from training.rl.actors import RelayWorker, RolloutWorker, TrainerWorker

        nodes = sorted((n["NodeID"] for n in ray.nodes() if n.get("Alive")), key=lambda n: n)
        have = ray.cluster_resources().get("CPU", 0.0)
        if have + 1e-9 < self._cpus_needed(len(nodes)):
            raise RuntimeError(
                f"the Ray cluster has {have:g} CPUs but the RL roles need {self._cpus_needed(len(nodes)):g} "
                f"(trainer {self.rc.trainer_ranks} x {self.rc.trainer_cpus:g} + {self.rc.rollouts} rollouts x {self.rc.rollout_cpus:g} + "
                f"{len(nodes)} relays x {self.rc.relay_cpus:g}): lower cluster.rollout_cpus / cluster.trainer_cpus "
                "or add nodes; the actors would otherwise wait for resources forever")
        head = ray.get_runtime_context().get_node_id()
        self.nodes = [head] + [n for n in nodes if n != head]
        pin = lambda node: NodeAffinitySchedulingStrategy(node_id=node, soft=False)  # noqa: E731
        self._Relay = ray.remote(num_cpus=self.rc.relay_cpus, max_concurrency=8)(RelayWorker)
        self._pin = pin
        self.relays: dict[str, object] = {}
        chain = []
        for i, node in enumerate(self.nodes):
            name = f"relay-{i}"
            self.relays[name] = self._Relay.options(scheduling_strategy=pin(node)).remote(name, self.rc.keep_versions)
            chain.append((name, node))
        self.chain = RelayChain(chain)
        self._relay_seq = len(chain)
        self._wire_chain()
        Rollout = ray.remote(num_cpus=self.rc.rollout_cpus, num_gpus=self.rc.rollout_gpus,
                             max_restarts=self.rc.max_restarts)(RolloutWorker)
        self.rollouts: dict[str, _Rollout] = {}
        for i in range(self.rc.rollouts):
            node = (self.nodes[self.rc.rollout_nodes[i % len(self.rc.rollout_nodes)] % len(self.nodes)]
                    if self.rc.rollout_nodes else self.nodes[i % len(self.nodes)])
            name = f"rollout-{i}"
            handle = Rollout.options(scheduling_strategy=pin(node)).remote(
                name, str(self.model_dir), device=self.device, capacity=self.rc.capacity,
                max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=self.seed,
                threads=self.rc.actor_threads, engine_options=self.rc.engine_options, priority=self.rc.rollout_priority)
            self.rollouts[name] = _Rollout(name, node, handle, self.chain.relay_for(node))
        self.timeline["rollouts"] = list(self.rollouts)
        self.trainer = self._build_trainers(ray, TrainerWorker)
        ray.get(self.trainer.lead.set_master.remote(self.relays[self.chain.master]))
        for r in self.rollouts.values():
            r.pid = ray.get(r.handle.ping.remote())["pid"]

    def _build_trainers(self, ray, TrainerWorker) -> _TrainerGroup:
        """One trainer actor per rank. One rank is pinned to ``cluster.trainer_node``; several form a
        placement group (``cluster.trainer_strategy``: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD) and
        meet in a ``torch.distributed`` rendezvous at rank 0's address."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ranks = self.rc.trainer_ranks
        Trainer = ray.remote(num_cpus=self.rc.trainer_cpus, num_gpus=self.rc.trainer_gpus)(TrainerWorker)
        pg = None
        if ranks > 1:
            bundle = {"CPU": self.rc.trainer_cpus, **({"GPU": self.rc.trainer_gpus} if self.rc.trainer_gpus else {})}
            pg = placement_group([bundle] * ranks, strategy=self.rc.trainer_strategy)
            ready, _ = ray.wait([pg.ready()], timeout=120)
            if not ready:
                raise RuntimeError(f"the trainer's placement group ({ranks} x {self.rc.trainer_cpus:g} CPU, "
                                   f"{self.rc.trainer_strategy}) could not be placed on this cluster within 120 s")
        dist_backend = self.rc.dist_backend
        if dist_backend == "auto":
            dist_backend = "nccl" if str(self.device).startswith("cuda") else "gloo"
        handles = []
        for rank in range(ranks):
            strategy = (PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank) if pg is not None
                        else self._pin(self.nodes[self.rc.trainer_node % len(self.nodes)]))
            handles.append(Trainer.options(scheduling_strategy=strategy).remote(
                str(self.model_dir), self.params, device=self.device, seed=self.seed, threads=self.rc.trainer_threads,
                backend=self.rc.trainer_backend, ds_config=self.rc.ds_config, rank=rank, world_size=ranks,
                dist_backend=dist_backend, extensions_dir=self.rc.extensions_dir, **self.train_kw))
        group = _TrainerGroup(handles, pg)
        if ranks > 1 or self.rc.trainer_backend != "torch":
            addr, port = ray.get(handles[0].address.remote())
            infos = ray.get([h.start.remote(addr, port) for h in handles])
        else:
            infos = [ray.get(handles[0].ping.remote())]
        self.trainer_nodes = [i["node"] for i in infos]
        return group

    def _wire_chain(self) -> None:
        import ray

        ray.get([self.relays[a].set_next.remote(self.relays[b] if b else None) for a, b in self.chain.links()])

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> RLResult:
        threads = torch.get_num_threads()
        if self.rc.driver_threads:
            torch.set_num_threads(self.rc.driver_threads)
        ray = self._start_ray()
        try:
            self._build(ray)
            return self._loop(ray)
        finally:
            self._teardown(ray)
            torch.set_num_threads(threads)

    def _role_handles(self, rollouts: bool) -> dict:
        handles = {f"trainer-{i}": h for i, h in enumerate(self.trainer.handles)}
        handles.update(self.relays)
        if rollouts:
            handles.update({n: r.handle for n, r in self.rollouts.items() if r.alive})
        return handles

    def _teardown(self, ray) -> None:
        group = getattr(self, "trainer", None)
        for handle in [*(group.handles if group is not None else []), *[r.handle for r in getattr(self, "rollouts", {}).values()],
                       *getattr(self, "relays", {}).values()]:
            if handle is not None:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
        if group is not None and group.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group.pg)
            except Exception:  # noqa: BLE001
                pass
        if getattr(self, "_own_ray", False):
            ray.shutdown()

    def _loop(self, ray) -> RLResult:
        from generation.model import load_model
        from generation.engine import TorchEngine

        torch.manual_seed(self.seed)
        model, tokenizer = load_model(self.model_dir, "cpu")
        self.local_engine = TorchEngine(model, tokenizer, device="cpu")  # HIVE's prompt entropy, in-run eval
        self.local_version = 0
        cursor = PromptCursor(self.prompts, self.seed)
        self.cursor = cursor
        source = self.source_factory(cursor, self.local_engine) if self.source_factory else cursor
        self.source = source
        self.queue = PromptQueue(source, self.group_size)
        shaping = overlong_shaping(self.params, self.max_new_tokens)
        keep = (lambda g: len(set(g.correct)) > 1) if self.params.dynamic_sampling else None
        self.buffer = ExperienceBuffer(self.group_size, lambda trajs: score_phase(trajs, self.verifier, shaping)[0],
                                       keep=keep, max_staleness=self.rc.max_staleness)
        result = RLResult()
        self.result = result
        self.version = 0
        self.t0 = time.perf_counter()
        self.counts = Counter()
        self._checkpoint_due = False
        self._eval_thread = None
        self._resume(ray)
        # version 0 (or the resumed version) goes to the relays before any rollout starts
        self.trainer.get(ray, "publish")
        self.latest = self.version
        self.cpu = _CpuLedger()
        self.cpu.see("driver", os.getpid(), time.process_time())
        self.cpu.ping_all(ray, self._role_handles(rollouts=True))
        trainer_future = None
        trainer_groups: list[tuple[int, ScoredGroup]] = []
        self.training_responses = 0  # responses of the batch the trainer is updating on now
        last_update_t = time.perf_counter()
        last_repack = time.perf_counter()
        last_relay_check = time.perf_counter()
        window = _Window()
        # batched modes: batch index -> uids; the batch being generated
        self.batch_idx = self.version
        self.batch_uids: set[int] = set()
        self.batch_rounds = 0
        self.batch_open = False
        while self.version < self.steps:
            now = time.perf_counter()
            # ---- trainer
            if trainer_future is None:
                groups = self._trainable()
                if groups:
                    trainer_groups = groups
                    trainer_future = self.trainer.call("train", [g for _, g in groups])
                    self.training_responses = sum(len(g.trajectories) for _, g in groups)
            # ---- batched modes open the next batch
            if self.mode.batched:
                self._maybe_open_batch()
            # ---- rollouts
            for r in self.rollouts.values():
                if r.future is None and r.alive:
                    self._dispatch(r)
            # ---- repack (laminar): periodic
            if self.mode.repack and now - last_repack > self.rc.repack_interval_s:
                self._repack()
                last_repack = now
            if now - last_relay_check > 1.0:
                self._check_relays(ray)
                self._revive(ray)
                last_relay_check = now
            futures = [r.future for r in self.rollouts.values() if r.future is not None]
            if trainer_future is not None:
                futures.append(trainer_future)
            if not futures:
                if self.counts["idle_spins"] > 20000:
                    raise RuntimeError("the runtime stalled: no work in flight and nothing to train")
                self.counts["idle_spins"] += 1
                time.sleep(0.01)
                continue
            done, _ = ray.wait(futures, num_returns=1, timeout=1.0)
            for fut in done:
                if fut is trainer_future:
                    out = ray.get(fut)  # a dead trainer ends the run: rerun resumes from the checkpoint
                    self.trainer.settle(ray)
                    trainer_future = None
                    self.training_responses = 0
                    self._after_update(ray, out, trainer_groups, window, time.perf_counter() - last_update_t)
                    last_update_t = time.perf_counter()
                    if self.mode.repack:
                        self._repack()
                        last_repack = time.perf_counter()
                    continue
                r = next(x for x in self.rollouts.values() if x.future is fut)
                self._on_rollout_result(ray, r, fut, window)
        self._join_eval()
        self.cpu.see("driver", os.getpid(), time.process_time())
        self.cpu.ping_all(ray, self._role_handles(rollouts=False))  # rollouts report with their results
        self._finish_summary()
        state = self.trainer.get(ray, "state")
        model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
        self.final_model = model
        return result

    # ------------------------------------------------------------------------------------------ batches
    def _maybe_open_batch(self) -> None:
        """sync / one_step: batch b (the groups of update b+1) starts once batch b-1 is fully generated
        and the trainer has reached version b - max_ahead; rollouts pull that version first."""
        if self.batch_open:
            if self.batch_uids and all(u in self.buffer.done or u in self.buffer.ready for u in self.batch_uids):
                kept = sum(1 for u in self.batch_uids if u in self.buffer.ready)
                max_rounds = self.params.max_sampling_rounds if self.params.dynamic_sampling else 1
                if kept < self.n and self.batch_rounds < max_rounds:
                    need = self.n - kept
                    if hasattr(self.source, "round_size"):
                        need = self.source.round_size(need, self.buffer.stats.filtered / max(1, len(self.batch_uids)),
                                                      self.n)
                    self._issue_batch(need)
                    return
                self.batch_open = False
                self.closed_batches = getattr(self, "closed_batches", []) + [set(self.batch_uids)]
            return
        if not control.may_open_batch(self.mode, version=self.version, batch_idx=self.batch_idx, steps=self.steps,
                                      closed_waiting=len(getattr(self, "closed_batches", []))):
            return  # the trainer has not caught up, or every batch is issued
        self.batch_open = True
        self.batch_rounds = 0
        self.batch_uids = set()
        self.batch_min_version = control.batch_min_version(self.mode, self.batch_idx)
        self._issue_batch(self.n)
        self.batch_idx += 1

    def _issue_batch(self, n_groups: int) -> None:
        self.batch_rounds += 1
        self._refresh_local()
        reqs = list(self.queue.retry) + self.queue.take_groups(n_groups)
        self.queue.retry.clear()
        self.batch_uids |= {q.group_uid for q in reqs}
        alive = [r for r in self.rollouts.values() if r.alive] or list(self.rollouts.values())
        # whole groups round-robin over rollouts; fresh requests also ride in pending_inject (GenRequest)
        for r, share in zip(alive, control.round_robin_groups(reqs, len(alive))):
            r.pending_inject.extend(share)

    def _trainable(self) -> list[tuple[int, ScoredGroup]]:
        if self.mode.batched:
            closed = getattr(self, "closed_batches", [])
            if not closed:
                return []
            uids, self.closed_batches = closed[0], closed[1:]
            groups = self.buffer.take_uids(uids, self.n, self.version)
            if not groups:  # every group filtered (dynamic sampling): no update; the batch index repeats
                self.counts["empty_batches"] += 1
                self.batch_idx -= 1
            return groups
        if self.buffer.n_ready() < self.n:
            return []
        groups, stale = self.buffer.take(self.n, self.version, full=True)
        for uid, g in stale:  # too stale: regenerate the prompt under newer weights
            self.buffer.forget(uid)
            self.queue.requeue(GenRequest(prompt=t.prompt, sample_idx=t.sample_idx, group_uid=uid)
                               for t in g.trajectories)
        return groups

    # ------------------------------------------------------------------------------------------ rollouts
    def _dispatch(self, r: _Rollout) -> None:
        if r.extract_to is not None:
            r.future, r.op = r.handle.extract.remote(), "extract"
            return
        # the mode's decision (shared with the simulator): pull first? interrupt? admit queued requests?
        # laminar is version-atomic: it pulls only when no response is in flight here (queued requests
        # have not started, so they run under the new version) and no repack is about to hand some over
        plan = control.dispatch_plan(self.mode, version=r.version, latest=self.latest, active=r.active,
                                     queued=r.queued, pending=bool(r.pending_inject), awaiting=r.awaiting,
                                     batch_min_version=getattr(self, "batch_min_version", 0))
        relay = self.relays[r.relay] if plan.pull else None
        min_version = plan.min_version
        if plan.interrupt:
            self.counts["interrupts"] += 1
            self._event(r, "interrupt", self.latest)
        draining = not plan.admitting
        admitting = plan.admitting
        inject: list[Partial] = []
        submit: list[GenRequest] = []
        for item in r.pending_inject:
            (inject if isinstance(item, Partial) else submit).append(item)
        r.pending_inject = []
        if inject and self.mode.drain:
            ok = [p for p in inject if p.version == r.version]
            lost = [p for p in inject if p.version != r.version]
            if lost:  # the receiver moved on: the responses restart from their prompt
                self.counts["repack_lost"] += len(lost)
                self.counts["repack_lost_tokens"] += sum(len(p.tokens) for p in lost)
                self._requeue([p.request for p in lost])
            inject = ok
        if not self.mode.batched and admitting:
            free = self.rc.capacity - (r.active + r.queued + len(inject) + len(submit))
            if self.rc.max_staleness is not None:  # unbounded: no flow control, nothing to count
                # the batch in the trainer's hands fills the update at version `latest` (the first
                # update the room counts): without it, every other update's rollouts overshoot by a batch
                outstanding = control.outstanding_responses(self.rollouts.values(), self.buffer,
                                                            training=self.training_responses,
                                                            new=len(inject) + len(submit))
                room = control.admission_room(self.rc.max_staleness, latest=self.latest, version=r.version,
                                              batch_groups=self.n, group_size=self.group_size,
                                              outstanding=outstanding, retry=len(self.queue.retry))
                if room < free:
                    free = room
                    self.counts["admission_limited"] += 1
            if free > 0:
                self._refresh_local()
                submit.extend(self.queue.take(free))
        for q in submit:
            r.assigned[(q.group_uid, q.sample_idx)] = q
        for p in inject:
            r.assigned[(p.request.group_uid, p.request.sample_idx)] = p.request
        r.last_sent = [(q.group_uid, q.sample_idx) for q in submit] + \
            [(p.request.group_uid, p.request.sample_idx) for p in inject]
        if relay is None and not submit and not inject and r.active == 0 and r.queued == 0:
            return  # idle
        r.draining = draining
        r.pulling = relay is not None
        r.future = r.handle.step.remote(self.rc.chunk_steps, submit=submit, inject=inject, relay=relay,
                                        min_version=min_version, admitting=admitting)
        r.op = "step"

    def _on_rollout_result(self, ray, r: _Rollout, fut, window) -> None:
        from ray.exceptions import RayActorError

        op = r.op
        r.future, r.op, r.pulling = None, "", False
        try:
            out = ray.get(fut)
        except RayActorError:
            self._rollout_died(r)
            return
        status = out["status"]
        now = time.perf_counter() - self.t0
        self.cpu.see(r.name, out["pid"], out.get("cpu_s"))
        if out["pid"] != r.pid:  # Ray restarted it between two calls: what it held is gone
            fresh = set(r.last_sent) if op == "step" else set()
            lost = [q for k, q in r.assigned.items() if k not in fresh]
            for q in lost:
                r.assigned.pop((q.group_uid, q.sample_idx))
            self._requeue(lost)
            self.counts["rollout_failures"] += 1
            self.counts["requeued_requests"] += len(lost)
            self._event(r, "restart", -1)
            r.pid, r.restarts = out["pid"], r.restarts + 1
            LOG.warning("%s was restarted (pid %d): %d requests re-queued", r.name, r.pid, len(lost))
        if op == "extract":
            dst = self.rollouts.get(r.extract_to) if r.extract_to else None
            r.extract_to = None
            if dst is not None:
                dst.awaiting = max(0, dst.awaiting - 1)
            if out["partials"] and dst is not None and dst.alive:
                dst.pending_inject.extend(out["partials"])
                self._event(r, "repack_out", status["version"])
                self._event(dst, "repack_in", status["version"])
            elif out["partials"]:  # the receiver died meanwhile: the responses restart from their prompts
                self._requeue([p.request for p in out["partials"]])
            self._requeue(out["queued"])
            for q in out["queued"]:
                r.assigned.pop((q.group_uid, q.sample_idx), None)
            for p in out["partials"]:
                r.assigned.pop((p.request.group_uid, p.request.sample_idx), None)
        else:
            pulled = out.get("pulled")
            if pulled is not None:
                if pulled["ok"]:
                    if pulled["version"] != r.version:
                        self._event(r, "pull", pulled["version"])
                        self.counts["pulls"] += 1
                else:
                    self.counts["pull_failures"] += 1  # the periodic relay check finds a dead one
            for t in out["finished"]:
                r.assigned.pop((t.group_uid, t.sample_idx), None)
                self.buffer.add(t)
                window.generated_tokens += len(t.response_tokens)
                window.generated += 1
            self._record_completed()
        r.prev_active = r.active
        r.version, r.active, r.queued = status["version"], status["active"], status["queued"]
        occ = status["active"] / max(1, status["capacity"])
        window.occupancy.append(occ)
        self.timeline["samples"].append({"t": now, "rollout": r.name, "occupancy": occ, "active": status["active"]})

    def _requeue(self, requests) -> None:
        """Lost or returned requests go back first in line. Batched modes hand them straight to a
        live rollout: their batch cannot close without them."""
        requests = list(requests)
        if not requests:
            return
        if not self.mode.batched:
            self.queue.requeue(requests)
            return
        alive = [x for x in self.rollouts.values() if x.alive] or list(self.rollouts.values())
        for i, q in enumerate(sorted(requests, key=lambda q: (q.group_uid, q.sample_idx))):
            alive[i % len(alive)].pending_inject.append(q)

    def _record_completed(self) -> None:
        completed = self.buffer.pop_completed()
        self.source.observe([g for _, g in completed])
        step = self.version + 1
        self.result.rewards.extend((step, g.prompt_id, sum(g.correct) / len(g.correct), len(g.correct))
                                   for _, g in completed)

    def _rollout_died(self, r: _Rollout) -> None:
        """A dead rollout loses only its in-flight work: back to the prompt queue by prompt id."""
        lost = list(r.assigned.values())
        lost += [p.request if isinstance(p, Partial) else p for p in r.pending_inject]
        r.assigned.clear()
        r.pending_inject = []
        if r.extract_to in self.rollouts:
            dst = self.rollouts[r.extract_to]
            dst.awaiting = max(0, dst.awaiting - 1)
        r.extract_to = None
        r.awaiting = 0
        for other in self.rollouts.values():
            if other.extract_to == r.name:
                other.extract_to = None
        r.alive = False
        self._requeue(lost)
        r.active = r.queued = r.prev_active = 0
        r.version = -1
        self.counts["rollout_failures"] += 1
        self.counts["requeued_requests"] += len(lost)
        self._event(r, "restart", -1)
        LOG.warning("%s died: %d in-flight requests re-queued; waiting for Ray to restart it", r.name, len(lost))

    def _revive(self, ray) -> None:
        for r in self.rollouts.values():
            if r.alive:
                continue
            try:
                info = ray.get(r.handle.ping.remote(), timeout=0.5)
            except Exception:  # noqa: BLE001 - still restarting (or gone for good)
                continue
            r.alive, r.pid, r.restarts = True, info["pid"], r.restarts + 1
            r.version = -1  # pulls from its relay on the next dispatch
            LOG.warning("%s is back (pid %d)", r.name, r.pid)

    # ------------------------------------------------------------------------------------------ relays
    def _check_relays(self, ray) -> None:
        dead = []
        for name in list(self.chain.order):
            try:
                ray.get(self.relays[name].ping.remote(), timeout=2.0)
            except Exception:  # noqa: BLE001
                dead.append(name)
        for name in dead:
            self._rebuild_relay(ray, name)

    def _rebuild_relay(self, ray, name: str) -> None:
        """Cut a dead relay out of the chain (its node's rollouts bypass to a live relay), start a new
        one on the same node at the tail of the chain, and feed it the latest version."""
        was_master = name == self.chain.master
        node = self.chain.node_of[name]
        new = f"relay-{self._relay_seq}"
        self._relay_seq += 1
        self.relays[new] = self._Relay.options(scheduling_strategy=self._pin(node)).remote(new, self.rc.keep_versions)
        self.chain.add(new, node)
        self.chain.remove(name)
        self.counts["relay_failures"] += 1
        self.timeline["events"].append({"t": time.perf_counter() - self.t0, "rollout": "", "kind": "relay_dead",
                                        "version": self.latest, "relay": name})
        self._wire_chain()
        if was_master:
            ray.get(self.trainer.lead.set_master.remote(self.relays[self.chain.master]))
            ray.get(self.trainer.lead.republish.remote())
        else:
            ray.get(self.relays[self.chain.master].forward_latest.remote())
            self._forward_chain(ray)
        for r in self.rollouts.values():
            r.relay = self.chain.relay_for(r.node)
        LOG.warning("relay %s died: cut out of the chain, rebuilt as %s", name, new)

    def _forward_chain(self, ray) -> None:
        for a, b in self.chain.links():
            if b is not None:
                ray.get(self.relays[a].forward_latest.remote())

    # ------------------------------------------------------------------------------------------ repack
    def _repack(self) -> None:
        views = [RolloutView(r.name, r.version, r.queued + len(r.pending_inject), r.active, r.prev_active,
                             self.rc.capacity, alive=r.alive and r.extract_to is None, pulling=r.pulling)
                 for r in self.rollouts.values()]
        moves = control.plan_repack(views, self.rc.repack_b or self.rc.capacity)
        for m in moves:
            src, dst = self.rollouts[m.src], self.rollouts[m.dst]
            if src.extract_to is None and dst.extract_to is None:
                src.extract_to = m.dst
                dst.awaiting += 1
                self.counts["repacks"] += 1
                self._window_repacks = getattr(self, "_window_repacks", 0) + 1

    # ------------------------------------------------------------------------------------------ updates
    def _refresh_local(self) -> None:
        """Keep the driver's copy of the policy (HIVE's prompt entropy) at the latest version."""
        if self.source is self.cursor or self.local_version == self.latest:
            return
        import ray

        got = ray.get(self.relays[self.chain.master].latest.remote())
        if got is not None:
            version, box = got
            self.local_engine.model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in ray.get(box[0]).items()})
            self.local_version = version

    def _start_eval(self, m: dict, state: dict) -> None:
        """Held-out evaluation of the version just trained, beside the loop: a thread of the driver on
        its own copy of the policy, so the trainer and rollouts keep being fed meanwhile (the in-process
        sync loop waits for it). Its metrics join the step's history entry ``m``; a checkpoint falling
        due meanwhile waits for the first update after it (``_after_update``); ``_join_eval`` waits for
        it at the end of the run (and before a checkpoint) and re-raises its error."""
        import copy
        import threading

        self._join_eval()
        if getattr(self, "eval_model", None) is None:
            self.eval_model = copy.deepcopy(self.local_engine.model)
        self.eval_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})

        def work() -> None:
            try:
                m.update(self.evaluate(self.eval_model))
            except BaseException as e:  # noqa: BLE001 - handed to the loop's thread by _join_eval
                self._eval_error = e

        self._eval_error = None
        self._eval_thread = threading.Thread(target=work, name="laminar-eval", daemon=True)
        self._eval_thread.start()

    def _eval_running(self) -> bool:
        return self._eval_thread is not None and self._eval_thread.is_alive()

    def _join_eval(self) -> None:
        t = self._eval_thread
        if t is not None:
            t.join()
            self._eval_thread = None
            if self._eval_error is not None:
                raise self._eval_error

    def _after_update(self, ray, out: dict, groups: list[tuple[int, ScoredGroup]], window, wall: float) -> None:
        stats = out["stats"]
        self.version = stats.version
        self.latest = self.version
        self.timeline["updates"].append({"t": time.perf_counter() - self.t0, "version": self.version})
        kept = [g for _, g in groups]
        collected = Collected(kept, rounds=1, dropped_groups=self.buffer.stats.filtered - window.filtered_before,
                              generated=window.generated)
        m = step_metrics(self.version, collected, stats, wall, out["train_s"])
        trained_tokens = sum(len(t.response_tokens) for g in kept for t in g.trajectories)
        st = [self.version - 1 - ExperienceBuffer.group_version(g) for g in kept]
        m.update({
            "trained_tokens": float(trained_tokens), "tokens_per_s": trained_tokens / max(wall, 1e-9),
            "staleness_mean": sum(st) / max(1, len(st)), "staleness_max": float(max(st) if st else 0),
            "occupancy": sum(window.occupancy) / max(1, len(window.occupancy)),
            "repacks": float(getattr(self, "_window_repacks", 0)), "publish_stall_s": out["publish_stall_s"],
            "publish_cpu_s": out.get("publish_cpu_s", float("nan")),
            "gen_tokens_per_s": window.generated_tokens / max(wall, 1e-9), "wall_seconds": time.perf_counter() - self.t0,
        })
        m.update(self.source.step_counts())
        self._window_repacks = 0
        window.reset(self.buffer.stats.filtered)
        if self.evaluate is not None and self.eval_every > 0 and self.version % self.eval_every == 0 \
                and self.version < self.steps:
            self._start_eval(m, self.trainer.get(ray, "state"))
        self.result.history.append(m)
        self.result.consumed.update(t.prompt.prompt_id for g in kept for t in g.trajectories)
        self.trained_uids = getattr(self, "trained_uids", []) + [u for u, _ in groups]
        self.trained_prompts = getattr(self, "trained_prompts", []) + [(u, g.prompt_id) for u, g in groups]
        self.lengths = getattr(self, "lengths", []) + [len(t.response_tokens) for g in kept for t in g.trajectories]
        if self.on_step is not None:
            self.on_step(m)
        if self.rc.checkpoint_every and self.rc.checkpoint_dir and self.version % self.rc.checkpoint_every == 0:
            self._checkpoint_due = True
        # a checkpoint holds the history with every evaluation's metrics: one due while an evaluation
        # still runs beside the loop is written at the first update after it finished, so the loop
        # never waits for the evaluation (it did, 5-8 s per evaluation on the 2-core default task)
        if self._checkpoint_due and self.version < self.steps and not self._eval_running():
            self._checkpoint(ray)
            self._checkpoint_due = False

    # ------------------------------------------------------------------------------------------ checkpoints
    def _in_flight(self) -> list[GenRequest]:
        reqs = [q for r in self.rollouts.values() for q in r.assigned.values()]
        reqs += [p.request if isinstance(p, Partial) else p for r in self.rollouts.values() for p in r.pending_inject]
        reqs += list(self.queue.retry)
        seen, out = set(), []
        for q in sorted(reqs, key=lambda q: (q.group_uid, q.sample_idx)):
            if (q.group_uid, q.sample_idx) not in seen:
                seen.add((q.group_uid, q.sample_idx))
                out.append(q)
        return out

    def _checkpoint(self, ray) -> None:
        from training.rl.checkpoint import save_json, write_checkpoint

        self._join_eval()  # the history it writes holds the evaluation's metrics

        def writer(tmp: Path) -> None:
            self.trainer.get(ray, "save", str(tmp))
            save_json(tmp, "runtime.json", {
                "version": self.version, "cursor": self.cursor.position, "queue": self.queue.state(),
                "in_flight": [control.request_to_json(q) for q in self._in_flight()],
                "buffer": self.buffer.state(), "history": self.result.history,
                "consumed": dict(self.result.consumed), "rewards": [list(x) for x in self.result.rewards],
                "trained_uids": getattr(self, "trained_uids", []), "mode": self.mode.name,
                "batch_idx": self.batch_idx,
            })
        path = write_checkpoint(Path(self.rc.checkpoint_dir), self.version, writer)
        self.counts["checkpoints"] += 1
        LOG.info("checkpoint %s", path)

    def _resume(self, ray) -> None:
        if not (self.rc.checkpoint_dir and Path(self.rc.checkpoint_dir).exists()):
            return
        from training.rl.checkpoint import latest_checkpoint, load_json

        ckpt = latest_checkpoint(Path(self.rc.checkpoint_dir))
        if ckpt is None:
            return
        state = load_json(ckpt, "runtime.json")
        self.version = self.trainer.get(ray, "load", str(ckpt))
        self.cursor.position = state["cursor"]
        self.queue.load_state(state["queue"])
        self.queue.requeue(control.request_from_json(q) for q in state["in_flight"])
        self.buffer.load_state(state["buffer"])
        self.result.history = state["history"]
        self.result.consumed = Counter(state["consumed"])
        self.result.rewards = [tuple(x) for x in state["rewards"]]
        self.trained_uids = state["trained_uids"]
        self.resumed_from = int(state["version"])
        self.counts["resumed"] = 1
        LOG.warning("resuming RL from checkpoint %s (update %d)", ckpt, self.version)

    # ------------------------------------------------------------------------------------------ report
    def _event(self, r: _Rollout, kind: str, version: int) -> None:
        self.timeline["events"].append({"t": time.perf_counter() - self.t0, "rollout": r.name, "kind": kind,
                                        "version": version})

    def _finish_summary(self) -> None:
        hist = self.result.history
        wall = time.perf_counter() - self.t0
        trained = sum(m.get("trained_tokens", 0) for m in hist)
        self.summary = {
            "mode": self.mode.name, "updates": len(hist), "wall_seconds": wall,
            "trained_tokens": trained, "tokens_per_s": trained / max(wall, 1e-9),
            "staleness_histogram": {str(k): v for k, v in sorted(self.buffer.stats.staleness.items())},
            "duplicates_ignored": self.buffer.stats.duplicates, "stale_dropped": self.buffer.stats.stale_dropped,
            **{k: v for k, v in self.counts.items() if k != "idle_spins"},
            "publish_stall_s": [m.get("publish_stall_s", 0.0) for m in hist],
            "publish_cpu_s": [m.get("publish_cpu_s", 0.0) for m in hist],
            "rollouts": self.rc.rollouts, "relays": list(self.chain.order),
            "relay_nodes": {n: self.chain.node_of[n] for n in self.chain.order},
            "rollout_relays": {r.name: r.relay for r in self.rollouts.values()},
            "rollout_nodes": {r.name: r.node for r in self.rollouts.values()},
            "trainer_backend": self.rc.trainer_backend, "trainer_nodes": getattr(self, "trainer_nodes", []),
            "trained_uids": getattr(self, "trained_uids", []),
            "response_lengths": getattr(self, "lengths", []),
            "trained_prompts": getattr(self, "trained_prompts", []),
            **self.cpu.report(),
        }
        LOG.info("CPU over the loop (%.1f s, %d cores%s): %s", self.summary["loop_seconds"], self.summary["cores"],
                 f", {100 * self.summary['machine_busy']:.0f}% busy" if "machine_busy" in self.summary else "",
                 ", ".join(f"{n} {v:.1f} s" for n, v in self.summary["cpu_seconds"].items()))


class _CpuLedger:
    """CPU seconds each role's process spent over the loop (``summary["cpu_seconds"]``): its CPU time
    when the loop starts and the latest seen. Rollouts report theirs with every result; the trainer
    ranks and relays answer a ping at both ends; the driver counts all its threads (scoring, HIVE's
    prompt entropy, the in-run evaluation). A restarted process counts from its first report. Plus
    the head machine's busy share over the loop (Linux ``/proc/stat``), to tell a CPU-bound loop
    from one that waits."""

    def __init__(self):
        self.procs: dict[str, list] = {}  # name -> [pid, cpu at first sight, cpu last seen]
        self.done: dict[str, float] = {}  # CPU of earlier processes of the same role (restarts)
        self.machine0 = _machine_jiffies()
        self.t0 = time.perf_counter()

    def see(self, name: str, pid: int, cpu_s: float | None) -> None:
        if cpu_s is None:
            return
        cur = self.procs.get(name)
        if cur is not None and cur[0] == pid:
            cur[2] = cpu_s
            return
        if cur is not None:
            self.done[name] = self.done.get(name, 0.0) + cur[2] - cur[1]
        self.procs[name] = [pid, cpu_s, cpu_s]

    def ping_all(self, ray, handles: dict) -> None:
        refs = {name: h.ping.remote() for name, h in handles.items()}
        for name, ref in refs.items():
            try:
                info = ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - a dead or busy role reports nothing; the run goes on
                continue
            self.see(name, info["pid"], info.get("cpu_s"))

    def report(self) -> dict:
        out = {"loop_seconds": time.perf_counter() - self.t0, "cores": os.cpu_count(),
               "cpu_seconds": {n: self.done.get(n, 0.0) + c[2] - c[1] for n, c in sorted(self.procs.items())}}
        m1 = _machine_jiffies()
        if self.machine0 is not None and m1 is not None and m1[1] > self.machine0[1]:
            out["machine_busy"] = (m1[0] - self.machine0[0]) / (m1[1] - self.machine0[1])
        return out


def _machine_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of this machine's CPUs since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already inside user time
    return total - idle, total


@dataclass
class _Window:
    """Counters since the last update."""

    occupancy: list = field(default_factory=list)
    generated: int = 0
    generated_tokens: int = 0
    filtered_before: int = 0

    def reset(self, filtered: int) -> None:
        self.occupancy, self.generated, self.generated_tokens = [], 0, 0
        self.filtered_before = filtered
