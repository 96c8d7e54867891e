"""The Ray roles of the Laminar runtime: trainer, relay, rollout.

Each class is a plain Python class; ``training.rl.drivers.ray`` wraps it with ``ray.remote``. Weights
travel as ``{name: numpy array}`` dicts put once into the object store by the trainer; relays hold
the ObjectRef (one copy per node, shared zero-copy by that node's rollouts) and forward the ref
along the chain, never the bytes. No pickle files: checkpoints are safetensors + JSON.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np

from training.rl.records import (
    ActorInfo,
    ExtractOrder,
    ExtractReply,
    Published,
    PullResult,
    StepOrder,
    StepReply,
    TrainReply,
)
from training.rl.rollout import run_order


def _setup(threads: int, seed: int) -> None:
    import torch

    from generation.setup import setup_torch

    setup_torch(threads, seed)
    torch.set_num_interop_threads(1) if torch.get_num_interop_threads() != 1 else None


def lower_priority(priority: str) -> None:
    """Lower this process's CPU priority (``cluster.rollout_priority``): ``idle`` =
    SCHED_IDLE, ``low`` = 10 more niceness, ``normal`` = unchanged. Set on the calling thread (the
    actor's, which runs every call) and inherited by threads started later; only ever lowered, which
    needs no privilege. Where the OS has no SCHED_IDLE, ``idle`` falls back to ``low``."""
    from conf.schema import ROLLOUT_PRIORITIES

    if priority not in ROLLOUT_PRIORITIES:
        raise ValueError(f"rollout priority {priority!r}: expected one of {ROLLOUT_PRIORITIES}")
    if priority == "normal":
        return
    if priority == "idle" and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError as e:  # a sandbox that forbids it: lower the niceness instead
            logging.getLogger("laminar.training").warning(
                "SCHED_IDLE refused (%s): rollout niceness +10 instead", e
            )
    try:
        os.nice(10)
    except (OSError, AttributeError) as e:
        logging.getLogger("laminar.training").warning("could not lower the rollout's CPU priority: %s", e)


class RelayWorker:
    """Holds recent weight versions (as object refs) in this node's host memory and forwards each
    new version to the next relay in the chain in the background."""

    def __init__(self, name: str, keep_recent: int = 2):
        self.name = name
        self.keep_recent = keep_recent
        self.versions: dict[int, object] = {}
        self.next = None
        self.pinned: set[int] = set()
        self._local: dict[int, dict] = {}

    def ping(self) -> ActorInfo:
        return ActorInfo(
            self.name, os.getpid(), _node_id(), time.process_time(), versions=tuple(sorted(self.versions))
        )

    def set_next(self, handle) -> None:
        self.next = handle

    def push(self, version: int, box: list) -> int:
        """Receive ``box = [ObjectRef]`` of version ``version``; materialise it on this node (so the
        node's rollouts read it from local shared memory), keep it, forward the ref onwards."""
        import ray

        if version in self.versions:
            return version
        ref = box[0]
        self._local[version] = ray.get(ref)  # pulls one copy to this node; arrays stay zero-copy views
        self.versions[version] = ref
        if self.next is not None:
            try:
                self.next.push.remote(version, box)  # fire and forget: the chain pipelines
            except Exception:  # noqa: BLE001 - a dead successor is the manager's to cut out
                pass
        self._retain()
        return version

    def forward_latest(self) -> int:
        """Send the newest version to the successor again (after a rebuilt relay joined)."""
        if self.next is not None and self.versions:
            v = max(self.versions)
            self.next.push.remote(v, [self.versions[v]])
            return v
        return -1

    def retain(self, versions: list[int]) -> None:
        self.pinned = set(versions)
        self._retain()

    def _retain(self) -> None:
        if not self.versions:
            return
        latest = max(self.versions)
        keep = {v for v in self.versions if v > latest - self.keep_recent} | self.pinned
        for v in [v for v in self.versions if v not in keep]:
            self.versions.pop(v)
            self._local.pop(v, None)

    def latest(self, min_version: int = -1) -> Published | None:
        if not self.versions or max(self.versions) < min_version:
            return None
        v = max(self.versions)
        return Published(v, [self.versions[v]])

    def get(self, version: int) -> Published | None:
        return Published(version, [self.versions[version]]) if version in self.versions else None


class RolloutWorker:
    """A rollout: the continuous-batching engine behind one Ray actor. ``run`` is the only busy
    call: the manager's order as the local driver runs it in process (``training.rl.rollout``), its
    pulls from the node's relay.
    ``run`` (``training.rl.sections.RLSections``): ``run.rl`` gives its capacity and sampling,
    ``run.rollout`` its engine, ``run.env`` its episodes, ``run.cluster`` its threads and priority."""

    def __init__(self, name: str, model_dir: str, run, *, device: str):
        _setup(run.cluster.actor_threads, run.seed)
        lower_priority(run.cluster.rollout_priority)
        from generation.adapter import adapter_rank, model_dir_for_sampling
        from generation.engines import make_engine

        self.name = name
        # a LoRA run's rollouts load the bare base: every adapter version (0 first) is merged into it on
        # pull; a vLLM worker is started for the adapters' rank
        self.engine = make_engine(
            model_dir_for_sampling(model_dir),
            run.engine_options(run.rl.rollout_capacity, lora_rank=adapter_rank(model_dir)),
            device=device,
        )  # torch | torch-process | vllm: all speak the rollout protocol
        env, sandbox = run.env, run.sandbox
        if env is not None and not env.is_default():  # episodes: the engine in an episode runner
            from environments.registry import wrap_engine
            from generation.model import load_tokenizer

            self.engine = wrap_engine(self.engine, env, load_tokenizer(model_dir), sandbox)
        self.engine.version = -1  # no published version loaded yet: the first step pulls

    def ping(self) -> ActorInfo:
        sched = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
        return ActorInfo(
            self.name,
            os.getpid(),
            _node_id(),
            time.process_time(),
            version=self.engine.version,
            idle_priority=sched == getattr(os, "SCHED_IDLE", -1),
        )

    def pull(self, relay, min_version: int = -1, wait_s: float = 10.0) -> PullResult:
        """Load the relay's latest version (at least ``min_version``, waiting up to ``wait_s``)."""
        import ray

        t0 = time.perf_counter()
        while True:
            try:
                got = ray.get(relay.latest.remote(min_version), timeout=wait_s)
            except Exception as e:  # noqa: BLE001 - dead or unreachable relay: the manager bypasses it
                return PullResult(False, seconds=time.perf_counter() - t0, error=type(e).__name__)
            if got is not None:
                break
            if time.perf_counter() - t0 > wait_s:
                return PullResult(False, seconds=time.perf_counter() - t0, error="timeout")
            time.sleep(0.005)
        if got.version != self.engine.version:
            state = ray.get(got.box[0])
            self.engine.load_state(state, got.version)
        return PullResult(True, got.version, time.perf_counter() - t0)

    def run(self, order: StepOrder | ExtractOrder, chunk: int, relay=None) -> StepReply | ExtractReply:
        """The manager's ``order`` (``training.rl.rollout.run_order``); a pull loads from ``relay``."""
        return run_order(
            self.engine, order, chunk, (lambda v: self.pull(relay, v)) if relay is not None else None
        )

    def wake(self) -> None:
        """The manager has news for this rollout: a ``run`` in flight that waits on its episodes' tools
        returns now (``EpisodeEngine.wake``; engines that never wait have none). The Ray driver calls it
        in the ``wake`` concurrency group, beside the ``run`` it cuts short."""
        wake = getattr(self.engine, "wake", None)
        if wake is not None:
            wake()

    def score(self, tokens: list[int]) -> tuple[int, list[float]]:
        """(the version this rollout holds, the log-probs its engine gives ``tokens[1:]``): what the
        rollout-equals-trainer check compares (in-process engines only)."""
        from generation.adapter import sequence_logprobs

        return self.engine.version, sequence_logprobs(self.engine.model, tokens)


class TrainerWorker:
    """One rank of the policy trainer behind a Ray actor: ``train`` takes one publishable update
    from whole scored groups; rank 0 then pushes ``(version, weights)`` once to the master relay.

    ``trainer`` (``conf.schema.TrainerConfig``): ``backend`` ``torch`` (AdamW) or ``deepspeed`` (ZeRO
    from the JSON ``trainer.deepspeed`` names). With ``world_size`` > 1 (or DeepSpeed) the ranks form a
    ``torch.distributed`` group: the driver asks rank 0 for a
    rendezvous ``address()`` and then calls ``start(addr, port)`` on every rank together; a single
    torch rank needs no group and starts at once."""

    def __init__(
        self,
        model_dir: str,
        params,
        rl,
        trainer=None,
        *,
        device: str,
        seed: int,
        threads: int = 1,
        rank: int = 0,
        world_size: int = 1,
        dist_backend: str = "gloo",
        extensions_dir: str | None = None,
    ):
        """``params``: the resolved objective; ``rl``: ``conf.schema.RLConfig`` (optimizer and batch
        settings, read by ``PolicyTrainer.from_config``)."""
        _setup(threads, seed)
        from training.lora import load_for_rl

        if extensions_dir:  # DeepSpeed's JIT-built ops stay inside the workspace
            os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir
        model, tokenizer = load_for_rl(Path(model_dir), device)  # an adapter folder: LoRA on a frozen base
        self.params, self.rl, self.device, self.pad_id = params, rl, device, tokenizer.pad_token_id
        self._model = model
        self.backend = trainer.backend if trainer is not None else "torch"
        self.deepspeed = trainer.deepspeed if trainer is not None else ""
        self.dist_backend = dist_backend
        self.rank, self.world_size = rank, world_size
        self.trainer = None
        self.master = None
        self._last_box: list | None = None
        if not self.needs_group():
            self.start()

    def needs_group(self) -> bool:
        return self.world_size > 1 or self.backend == "deepspeed"

    def address(self) -> tuple[str, int]:
        """A rendezvous address on this actor's node (rank 0): its IP and a free port."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, master_addr: str | None = None, master_port: int | None = None) -> ActorInfo:
        """Join the process group (when there is one) and build the trainer."""
        from training.rl.trainer import DeepSpeedPolicyTrainer, PolicyTrainer, init_distributed

        if self.trainer is None:
            if self.needs_group():
                init_distributed(
                    self.dist_backend,
                    self.rank,
                    self.world_size,
                    master_addr,
                    master_port,
                    deepspeed_comm=self.backend == "deepspeed",
                )
            place = dict(pad_id=self.pad_id, device=self.device, rank=self.rank, world_size=self.world_size)
            if self.backend == "deepspeed":
                from conf.loader import deepspeed_config

                self.trainer = DeepSpeedPolicyTrainer.from_config(
                    self._model, self.params, self.rl, ds_config=deepspeed_config(self.deepspeed), **place
                )
            else:
                self.trainer = PolicyTrainer.from_config(self._model, self.params, self.rl, **place)
            self._model = None
        return self.ping()

    def ping(self) -> ActorInfo:
        return ActorInfo(
            f"trainer-{self.rank}",
            os.getpid(),
            _node_id(),
            time.process_time(),
            rank=self.rank,
            version=self.trainer.version if self.trainer is not None else None,
        )

    def set_master(self, relay) -> None:
        self.master = relay

    def _gathered_state(self) -> dict[str, np.ndarray] | None:
        """The full weights on rank 0 (None elsewhere); with ZeRO-3 every rank joins the gather."""
        if self.rank == 0 or self.trainer.zero_stage == 3:
            state = self.trainer.full_state()
            return state if self.rank == 0 else None
        return None

    def publish(self) -> float:
        """Put the current weights into the object store once and hand the ref to the master relay
        without waiting for it: the stall is the device-to-host copy plus one ``ray.put`` (rank 0;
        with ZeRO-3 every rank joins the gather, only rank 0 puts).
        ``self.last_publish_cpu_s`` is the same stall in this thread's CPU time (what the trainer
        itself spends, without the waits a crowded machine adds)."""
        import ray

        c0 = time.thread_time()
        t0 = time.perf_counter()
        state = self._gathered_state()
        if self.rank == 0:
            self._last_box = [ray.put(state)]
            if self.master is not None:
                self.master.push.remote(self.trainer.version, self._last_box)
        self.last_publish_cpu_s = time.thread_time() - c0
        return time.perf_counter() - t0

    def republish(self) -> int:
        if self._last_box is not None and self.master is not None:
            self.master.push.remote(self.trainer.version, self._last_box)
        return self.trainer.version

    def train(self, groups) -> TrainReply:
        t0 = time.perf_counter()
        stats = self.trainer.update(groups)
        train_s = time.perf_counter() - t0
        stall = self.publish()
        return TrainReply(stats, train_s, stall, self.last_publish_cpu_s)

    def state(self) -> dict[str, np.ndarray] | None:
        return self._gathered_state()

    def score(self, tokens: list[int]) -> tuple[int, list[float]]:
        """(this trainer's version, the log-probs its model gives ``tokens[1:]``), rank 0."""
        from generation.adapter import sequence_logprobs

        return self.trainer.version, sequence_logprobs(self.trainer.model, tokens)

    def save(self, directory: str) -> None:
        """Every rank calls: DeepSpeed writes its shards through its own API (inside the caller's
        atomic checkpoint folder, on storage every trainer node sees); rank 0 writes the version and
        RNG (and, with torch, the weights and optimizer) as safetensors + JSON."""
        from training.rl.checkpoint import save_trainer_extras, save_trainer_state

        if self.backend == "deepspeed":
            self.trainer.save(directory)
            if self.rank == 0:
                save_trainer_state(Path(directory), None, None, version=self.trainer.version)
        elif self.rank == 0:
            save_trainer_state(
                Path(directory), self.trainer.model, self.trainer.opt, version=self.trainer.version
            )
        if self.rank == 0:  # the critic is replicated: rank 0's copy is every rank's
            save_trainer_extras(Path(directory), self.trainer)

    def load(self, directory: str) -> int:
        from training.rl.checkpoint import load_trainer_extras, load_trainer_state

        if self.backend == "deepspeed":
            self.trainer.load(directory)
            info = load_trainer_state(Path(directory), None, None)
        else:
            info = load_trainer_state(Path(directory), self.trainer.model, self.trainer.opt)
        load_trainer_extras(Path(directory), self.trainer)
        self.trainer.version = int(info["version"])
        return self.trainer.version


def _node_id() -> str:
    """This actor's Ray node, or "local" outside Ray (never starting a Ray of its own to ask)."""
    try:
        import ray

        if not ray.is_initialized():
            return "local"
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray (unit tests)
        return "local"
