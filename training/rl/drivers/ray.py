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

Checkpoints (``rl.checkpoint_every``) are the record every driver writes (``training.rl.checkpoint
.save_run``): the trainer's weights, optimizer and RNG, the prompt source, the manager's state
(prompt queue, buffered trajectories, requests in flight) and the history; a rerun resumes from the
last complete one with the same prompt order. After each update the relays keep the versions the
manager says in-flight work still uses (``RolloutManager.retained_versions``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence

import psutil
import torch

from generation.adapter import load_published
from generation.records import PromptItem
from training.objectives import ObjectiveParams
from training.rl.control import RelayChain
from training.rl.checkpoint import resume_run, save_run
from rewards.compose import as_reward
from training.rl.loop import PromptCursor, RLResult, group_scorer, keep_filter, policy_copy
from training.rl.reward_actor import with_reward_actor
from training.rl.manager import ManagerSettings, RolloutManager
from training.rl.records import ExtractOrder, ExtractReply, StepMetrics, StepReply, TrainReply
from training.rl.sections import RLSections

LOG = logging.getLogger("laminar.training")

WAKE_GROUP = "wake"
"""The rollout actors' concurrency group for ``wake``: a thread of its own, so it runs while ``run`` waits."""


def rollout_actor_class(ray, cluster):
    """``RolloutWorker`` as a Ray actor class with ``cluster``'s resources and restarts: ``run`` in the
    default group (one call at a time), ``wake`` in ``WAKE_GROUP`` beside it."""
    from training.rl.actors import RolloutWorker

    return ray.remote(
        num_cpus=cluster.rollout_cpus,
        num_gpus=cluster.rollout_gpus,
        max_restarts=cluster.max_restarts,
        concurrency_groups={WAKE_GROUP: 1},
    )(RolloutWorker)


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
    return {
        **{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()},
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


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


KEEP_VERSIONS = 2
"""Versions a relay keeps besides those in-flight responses use (``control.retained_versions``)."""


@dataclass
class _RolloutActor:
    """The runtime's handle on one rollout actor (the manager holds its scheduling state)."""

    name: str
    handle: object
    pid: int = 0
    future: object = None
    op: str = ""


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
        self.trainer_nodes: list[str] = []
        self.manager: RolloutManager | None = None
        self.cursor: PromptCursor | None = None
        self.source = None
        self.local_engine = None
        self.local_version = 0
        self.eval_model = None
        self.result = RLResult()
        self.cpu: _CpuLedger | None = None
        self.final_model = None
        self.final_state: dict | None = None
        self.resumed_from: int | None = None
        self.t0 = time.perf_counter()
        self._own_ray = False
        self._relay_seq = 0
        self._Relay = None
        self._checkpoint_due = False
        self._eval_thread = None
        self._eval_error: BaseException | None = None

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

        got = ray.get(self.relays[self.chain.master].latest.remote())
        if got is not None:
            load_published(self.local_engine.model, ray.get(got.box[0]))
            self.local_version = got.version

    def poke(self, rollout: str) -> None:
        """An idle rollout: nothing to do, the loop dispatches it this turn. A busy one is back within a
        chunk of decode steps, unless its call waits on its episodes' tools: that wait is cut short
        (``RolloutWorker.wake``, in its own concurrency group), so a new version or handed-over work
        does not wait for a slow tool."""
        a = self.rollouts.get(rollout)
        if a is not None and a.future is not None and a.op == "step":
            a.handle.wake.options(concurrency_group=WAKE_GROUP).remote()

    def note(self, rollout: str, kind: str, version: int) -> None:
        self.timeline["events"].append(
            {"t": time.perf_counter() - self.t0, "rollout": rollout, "kind": kind, "version": version}
        )

    # ------------------------------------------------------------------------------------------ setup
    def _start_ray(self):
        import ray

        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            kw = dict(
                include_dashboard=False,
                logging_level=logging.WARNING,
                log_to_driver=True,
                runtime_env={"env_vars": actor_env(self.cluster.actor_threads)},
            )
            if self.cluster.address:
                ray.init(address=self.cluster.address, **kw)
                return ray
            # A local Ray serves this machine only: its auth token (on by default for a new local cluster)
            # goes in a 0600 file before Ray reads it (Ray writes ~/.ray/auth_token with the umask, 0644),
            # and every server of it listens on the loopback. Ray resolves _node_ip_address="127.0.0.1" to
            # the outward address except in its single-node mode, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read
            # at import, so its constant too): set for the start (the processes Ray starts inherit it).
            import secrets

            from ray._private import ray_constants

            if os.environ.get("RAY_AUTH_MODE", "token").lower() != "disabled" and not os.environ.get(
                "RAY_AUTH_TOKEN"
            ):
                token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
                token.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                try:
                    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    os.chmod(token, 0o600)
                else:
                    with os.fdopen(fd, "w") as f:
                        f.write(secrets.token_hex(32))  # as Ray generates it
            var, saved = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, ray_constants.ENABLE_RAY_CLUSTER
            saved_env = os.environ.get(var)
            os.environ[var], ray_constants.ENABLE_RAY_CLUSTER = "0", False
            try:  # Ray's CPUs are a scheduling resource: enough for every role, however many cores
                # address="local": always a new Ray of its own, never one a killed run left recorded in
                # /tmp/ray/ray_current_cluster (single-node mode would try to join that)
                ray.init(
                    address="local",
                    num_cpus=max(self.cluster.num_cpus or os.cpu_count(), math.ceil(self._cpus_needed(1))),
                    _node_ip_address="127.0.0.1",
                    **kw,
                )
            finally:
                ray_constants.ENABLE_RAY_CLUSTER = saved
                if saved_env is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = saved_env
        return ray

    def _cpus_needed(self, nodes: int) -> float:
        c = self.cluster
        return self.trainer_cfg.ranks * c.trainer_cpus + c.rollouts * c.rollout_cpus + nodes * c.relay_cpus

    def _build(self, ray) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from training.rl.actors import RelayWorker, TrainerWorker

        c = self.cluster
        nodes = sorted((n["NodeID"] for n in ray.nodes() if n.get("Alive")), key=lambda n: n)
        have = ray.cluster_resources().get("CPU", 0.0)
        if have + 1e-9 < self._cpus_needed(len(nodes)):
            raise RuntimeError(
                f"the Ray cluster has {have:g} CPUs but the RL roles need {self._cpus_needed(len(nodes)):g} "
                f"(trainer {self.trainer_cfg.ranks} x {c.trainer_cpus:g} + "
                f"{c.rollouts} rollouts x {c.rollout_cpus:g} + "
                f"{len(nodes)} relays x {c.relay_cpus:g}): lower cluster.rollout_cpus / cluster.trainer_cpus "
                "or add nodes; the actors would otherwise wait for resources forever"
            )
        head = ray.get_runtime_context().get_node_id()
        self.nodes = [head] + [n for n in nodes if n != head]
        self._pin = lambda node: NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        self._Relay = ray.remote(num_cpus=c.relay_cpus, max_concurrency=8)(RelayWorker)
        chain = []
        for i, node in enumerate(self.nodes):
            name = f"relay-{i}"
            self.relays[name] = self._Relay.options(scheduling_strategy=self._pin(node)).remote(
                name, KEEP_VERSIONS
            )
            chain.append((name, node))
        self.chain = RelayChain(chain)
        self._relay_seq = len(chain)
        self._wire_chain()
        self._build_rollouts(ray)
        self.trainer = self._build_trainers(ray, TrainerWorker)
        ray.get(self.trainer.lead.set_master.remote(self.relays[self.chain.master]))

    def _rollout_node(self, i: int) -> str:
        picks = self.cluster.rollout_nodes
        return (
            self.nodes[picks[i % len(picks)] % len(self.nodes)] if picks else self.nodes[i % len(self.nodes)]
        )

    def _build_rollouts(self, ray) -> None:
        from generation.engines import engine_kind

        engine_kind(self.rollout_cfg)  # an unknown engine fails here, before any actor starts
        c = self.cluster
        Rollout = rollout_actor_class(ray, c)
        for i in range(c.rollouts):
            name = f"rollout-{i}"
            handle = Rollout.options(scheduling_strategy=self._pin(self._rollout_node(i))).remote(
                name, str(self.model_dir), self.sections, device=self.device
            )
            self.rollouts[name] = _RolloutActor(name, handle)
        self.timeline["rollouts"] = list(self.rollouts)
        for a in self.rollouts.values():
            a.pid = ray.get(a.handle.ping.remote()).pid

    def _build_trainers(self, ray, TrainerWorker) -> _TrainerGroup:
        """One trainer actor per rank. One rank is pinned to ``cluster.trainer_node``; several form a
        placement group (``cluster.trainer_strategy``: PACK, SPREAD, STRICT_PACK, STRICT_SPREAD) and
        meet in a ``torch.distributed`` rendezvous at rank 0's address."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c, t = self.cluster, self.trainer_cfg
        ranks = t.ranks
        Trainer = ray.remote(num_cpus=c.trainer_cpus, num_gpus=c.trainer_gpus)(TrainerWorker)
        pg = None
        if ranks > 1:
            bundle = {"CPU": c.trainer_cpus, **({"GPU": c.trainer_gpus} if c.trainer_gpus else {})}
            pg = placement_group([bundle] * ranks, strategy=c.trainer_strategy)
            ready, _ = ray.wait([pg.ready()], timeout=120)
            if not ready:
                raise RuntimeError(
                    f"the trainer's placement group ({ranks} x {c.trainer_cpus:g} CPU, "
                    f"{c.trainer_strategy}) could not be placed on this cluster within 120 s"
                )
        dist_backend = t.dist_backend
        if dist_backend == "auto":
            dist_backend = "nccl" if str(self.device).startswith("cuda") else "gloo"
        handles = []
        for rank in range(ranks):
            strategy = (
                PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
                if pg is not None
                else self._pin(self.nodes[c.trainer_node % len(self.nodes)])
            )
            handles.append(
                Trainer.options(scheduling_strategy=strategy).remote(
                    str(self.model_dir),
                    self.params,
                    self.rl,
                    t,
                    device=self.device,
                    seed=self.seed,
                    threads=c.trainer_threads or c.actor_threads,
                    rank=rank,
                    world_size=ranks,
                    dist_backend=dist_backend,
                    extensions_dir=self.extensions_dir,
                )
            )
        group = _TrainerGroup(handles, pg)
        if ranks > 1 or t.backend != "torch":
            addr, port = ray.get(handles[0].address.remote())
            infos = ray.get([h.start.remote(addr, port) for h in handles])
        else:
            infos = [ray.get(handles[0].ping.remote())]
        self.trainer_nodes = [i.node for i in infos]
        return group

    def _wire_chain(self) -> None:
        import ray

        ray.get(
            [self.relays[a].set_next.remote(self.relays[b] if b else None) for a, b in self.chain.links()]
        )

    def _prepare(self, ray):
        """The driver's side: its policy copy, the prompt source and the manager; resume if a
        checkpoint is there; version 0 (or the resumed one) goes to the relays before any rollout starts."""
        torch.manual_seed(self.seed)
        self.local_engine = policy_copy(self.model_dir)  # HIVE's prompt entropy, in-run eval
        self.local_version = (
            self.local_engine.version
        )  # an adapter's bare base takes version 0 from the relay
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
            [
                (a.name, self._rollout_node(i), self.chain.relay_for(self._rollout_node(i)))
                for i, a in enumerate(self.rollouts.values())
            ],
            keep=keep_filter(self.params),
        )
        self.t0 = time.perf_counter()
        self._resume(ray)
        self.trainer.get(ray, "publish")
        return model

    # ------------------------------------------------------------------------------------------ run
    def run(self) -> RLResult:
        threads = torch.get_num_threads()
        if self.cluster.driver_threads:
            torch.set_num_threads(self.cluster.driver_threads)
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
            handles.update({n: a.handle for n, a in self.rollouts.items() if self.manager.rollouts[n].alive})
        return handles

    def _teardown(self, ray) -> None:
        group = self.trainer
        for handle in [
            *(group.handles if group is not None else []),
            *[a.handle for a in self.rollouts.values()],
            *self.relays.values(),
        ]:
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
        if self._own_ray:
            ray.shutdown()

    def _loop(self, ray) -> RLResult:
        """The event loop: feed the trainer, open batches, dispatch idle rollouts, repack, check the
        relays; then wait for whichever call returns first and hand its result to the manager."""
        model = self._prepare(ray)
        m = self.manager
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
            for a in self.rollouts.values():
                if a.future is None and m.rollouts[a.name].alive:
                    self._dispatch(a)
            if self.mode.repack and now - last_repack > self.rl.repack_interval_s:
                m.repack()
                last_repack = now
            if now - last_relay_check > 1.0:
                self._check_relays(ray)
                self._revive(ray)
                last_relay_check = now
            futures = [a.future for a in self.rollouts.values() if a.future is not None]
            futures += [trainer_future] if trainer_future is not None else []
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
                    self._on_result(ray, next(a for a in self.rollouts.values() if a.future is fut), fut)
        return self._finish(ray, model)

    def _idle(self) -> None:
        counts = self.manager.counts
        if counts["idle_spins"] > 20000:
            raise RuntimeError("the runtime stalled: no work in flight and nothing to train")
        counts["idle_spins"] += 1
        time.sleep(0.01)

    def _finish(self, ray, model) -> RLResult:
        self._join_eval()
        self.cpu.see("driver", os.getpid(), time.process_time())
        self.cpu.ping_all(ray, self._role_handles(rollouts=False))  # rollouts report with their results
        self.result.consumed = self.manager.consumed
        self.result.rewards = self.manager.rewards
        self.result.terms = self.manager.terms
        self._finish_summary()
        state = self.trainer.get(ray, "state")
        load_published(model, state)
        self.final_model = model
        self.final_state = state  # a LoRA run's adapter tensors: the RL stage writes them as a PEFT folder
        return self.result

    # ------------------------------------------------------------------------------------------ rollouts
    def _dispatch(self, a: _RolloutActor) -> None:
        order = self.manager.dispatch(a.name)
        if order is None:
            return  # idle
        relay = self.relays[self.manager.rollouts[a.name].relay] if getattr(order, "pull", False) else None
        a.future = a.handle.run.remote(order, self.rl.chunk_steps, relay)
        a.op = "extract" if isinstance(order, ExtractOrder) else "step"

    def _on_result(self, ray, a: _RolloutActor, fut) -> None:
        from ray.exceptions import RayActorError

        op, a.future, a.op = a.op, None, ""
        try:
            out: StepReply | ExtractReply = ray.get(fut)
        except RayActorError:
            lost = self.manager.died(a.name)
            LOG.warning(
                "%s died: %d in-flight requests re-queued; waiting for Ray to restart it", a.name, lost
            )
            return
        self.cpu.see(a.name, out.pid, out.cpu_s)
        if out.pid != a.pid:  # Ray restarted it between two calls: what it held is gone
            lost = self.manager.restarted(a.name, after_step=op == "step")
            a.pid = out.pid
            LOG.warning("%s was restarted (pid %d): %d requests re-queued", a.name, a.pid, lost)
        if op == "extract":
            dst = self.manager.extract_done(a.name, out.partials, out.queued, out.status)
            if dst is not None:
                self.poke(dst)  # the handed-over work rides the receiver's next call
        else:
            self.manager.step_done(a.name, out.finished, out.status, out.pulled)
        self.timeline["samples"].append(
            {
                "t": time.perf_counter() - self.t0,
                "rollout": a.name,
                "occupancy": out.status.active / max(1, out.status.capacity),
                "active": out.status.active,
            }
        )

    def _revive(self, ray) -> None:
        for a in self.rollouts.values():
            if self.manager.rollouts[a.name].alive:
                continue
            try:
                info = ray.get(a.handle.ping.remote(), timeout=0.5)
            except Exception:  # noqa: BLE001 - still restarting (or gone for good)
                continue
            self.manager.revived(a.name)  # pulls from its relay on the next dispatch
            a.pid = info.pid
            LOG.warning("%s is back (pid %d)", a.name, a.pid)

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
        self.relays[new] = self._Relay.options(scheduling_strategy=self._pin(node)).remote(new, KEEP_VERSIONS)
        self.chain.add(new, node)
        self.chain.remove(name)
        self.manager.counts["relay_failures"] += 1
        self.timeline["events"].append(
            {
                "t": time.perf_counter() - self.t0,
                "rollout": "",
                "kind": "relay_dead",
                "version": self.manager.version,
                "relay": name,
            }
        )
        self._wire_chain()
        if was_master:
            ray.get(self.trainer.lead.set_master.remote(self.relays[self.chain.master]))
            ray.get(self.trainer.lead.republish.remote())
        else:
            ray.get(self.relays[self.chain.master].forward_latest.remote())
            self._forward_chain(ray)
        for r in self.manager.rollouts.values():
            r.relay = self.chain.relay_for(r.node)
        LOG.warning("relay %s died: cut out of the chain, rebuilt as %s", name, new)

    def _forward_chain(self, ray) -> None:
        for a, b in self.chain.links():
            if b is not None:
                ray.get(self.relays[a].forward_latest.remote())

    # ------------------------------------------------------------------------------------------ updates
    def _after_update(self, ray, reply: TrainReply, wall: float) -> None:
        m = self.manager.updated(reply.stats.version, reply.stats, wall, reply.train_s)
        version = self.manager.version
        self.timeline["updates"].append({"t": time.perf_counter() - self.t0, "version": version})
        m.publish_stall_s, m.publish_cpu_s = reply.publish_stall_s, reply.publish_cpu_s
        m.wall_seconds = time.perf_counter() - self.t0
        keep = sorted(self.manager.retained_versions(KEEP_VERSIONS))
        for relay in self.relays.values():  # fire and forget: a dead relay is the health check's
            relay.retain.remote(keep)
        if (
            self.evaluate is not None
            and self.rl.eval_every > 0
            and version % self.rl.eval_every == 0
            and version < self.rl.steps
        ):
            self._start_eval(m, self.trainer.get(ray, "state"))
        self.result.history.append(m)
        if self.on_step is not None:
            self.on_step(m)
        if self.checkpoint_dir and self.rl.checkpoint_every and version % self.rl.checkpoint_every == 0:
            self._checkpoint_due = True
        # a checkpoint holds the history with every evaluation's metrics: one due while an evaluation
        # still runs beside the loop is written at the first update after it finished, so the loop
        # never waits for the evaluation (it did, 5-8 s per evaluation on the 2-core default task)
        if self._checkpoint_due and version < self.rl.steps and not self._eval_running():
            self._checkpoint(ray)
            self._checkpoint_due = False

    def _start_eval(self, m: StepMetrics, state: dict) -> None:
        """Held-out evaluation of the version just trained, beside the loop: a thread of the driver on
        its own copy of the policy, so the trainer and rollouts keep being fed meanwhile (the in-process
        sync loop waits for it). Its metrics join the step's history entry ``m``; a checkpoint falling
        due meanwhile waits for the first update after it (``_after_update``); ``_join_eval`` waits for
        it at the end of the run (and before a checkpoint) and re-raises its error."""
        import copy
        import threading

        self._join_eval()
        if self.eval_model is None:
            self.eval_model = copy.deepcopy(self.local_engine.model)
        load_published(self.eval_model, state)

        def work() -> None:
            try:
                m.extra.update(self.evaluate(self.eval_model))
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

    # ------------------------------------------------------------------------------------------ checkpoints
    def _checkpoint(self, ray) -> None:
        self._join_eval()  # the history it writes holds the evaluation's metrics
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

    # ------------------------------------------------------------------------------------------ report
    def _finish_summary(self) -> None:
        m = self.manager
        hist = self.result.history
        wall = time.perf_counter() - self.t0
        trained = sum(h.trained_tokens for h in hist)
        self.summary = {
            "mode": self.mode.name,
            "updates": len(hist),
            "wall_seconds": wall,
            "trained_tokens": trained,
            "tokens_per_s": trained / max(wall, 1e-9),
            "staleness_histogram": {str(k): v for k, v in sorted(m.buffer.stats.staleness.items())},
            "duplicates_ignored": m.buffer.stats.duplicates,
            "stale_dropped": m.buffer.stats.stale_dropped,
            **{k: v for k, v in m.counts.items() if k != "idle_spins"},
            "publish_stall_s": [h.publish_stall_s for h in hist],
            "publish_cpu_s": [h.publish_cpu_s for h in hist],
            "rollouts": self.cluster.rollouts,
            "relays": list(self.chain.order),
            "relay_nodes": {n: self.chain.node_of[n] for n in self.chain.order},
            "rollout_relays": {r.name: r.relay for r in m.rollouts.values()},
            "rollout_nodes": {r.name: r.node for r in m.rollouts.values()},
            "trainer_backend": self.trainer_cfg.backend,
            "trainer_nodes": self.trainer_nodes,
            "trained_uids": m.trained_uids,
            "response_lengths": m.response_lengths,
            "trained_prompts": m.trained_prompts,
            **self.cpu.report(),
        }
        LOG.info(
            "CPU over the loop (%.1f s, %d cores%s): %s",
            self.summary["loop_seconds"],
            self.summary["cores"],
            f", {100 * self.summary['machine_busy']:.0f}% busy" if "machine_busy" in self.summary else "",
            ", ".join(f"{n} {v:.1f} s" for n, v in self.summary["cpu_seconds"].items()),
        )


class _CpuLedger:
    """CPU seconds each role's process spent over the loop (``summary["cpu_seconds"]``): its CPU time
    when the loop starts and the latest seen. Rollouts report theirs with every result; the trainer
    ranks and relays answer a ping at both ends; the driver counts all its threads (scoring, HIVE's
    prompt entropy, the in-run evaluation). A restarted process counts from its first report. Plus
    the head machine's busy share over the loop (``psutil.cpu_times``), to tell a CPU-bound loop
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
            self.see(name, info.pid, info.cpu_s)

    def report(self) -> dict:
        out = {
            "loop_seconds": time.perf_counter() - self.t0,
            "cores": os.cpu_count(),
            "cpu_seconds": {n: self.done.get(n, 0.0) + c[2] - c[1] for n, c in sorted(self.procs.items())},
        }
        m1 = _machine_jiffies()
        if m1[1] > self.machine0[1]:
            out["machine_busy"] = (m1[0] - self.machine0[0]) / (m1[1] - self.machine0[1])
        return out


def _machine_jiffies() -> tuple[float, float]:
    """(busy, total) CPU seconds of this machine since boot (``psutil``; iowait counts as idle, guest
    time is already inside user time)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(
        getattr(t, k, 0.0) for k in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    )
    return total - idle, total
