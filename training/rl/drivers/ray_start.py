"""Starting (or joining) the Ray cluster of a Laminar run, the CPUs its roles need, killing its actors.

``start_ray`` is the Ray driver's first step (``training.rl.drivers.ray``): it joins
``cluster.address`` when one is set, else starts a local Ray of its own that serves this machine only
(loopback, a 0600 auth token), with every actor's environment from ``actor_env``.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from conf.schema import ClusterConfig

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


def cpus_needed(cluster: ClusterConfig, trainer_ranks: int, nodes: int) -> float:
    """Ray CPUs the RL roles take: every trainer rank, every rollout and one relay per node."""
    c = cluster
    return trainer_ranks * c.trainer_cpus + c.rollouts * c.rollout_cpus + nodes * c.relay_cpus


def live_nodes(ray) -> list[str]:
    """The cluster's live nodes, the driver's (head) first, the others in ID order."""
    nodes = sorted((n["NodeID"] for n in ray.nodes() if n.get("Alive")), key=lambda n: n)
    head = ray.get_runtime_context().get_node_id()
    return [head] + [n for n in nodes if n != head]


def check_capacity(ray, cluster: ClusterConfig, trainer_ranks: int, nodes: int) -> None:
    """Fail unless the cluster has the CPUs every role needs (the actors would wait for them forever)."""
    c = cluster
    have = ray.cluster_resources().get("CPU", 0.0)
    need = cpus_needed(c, trainer_ranks, nodes)
    if have + 1e-9 < need:
        raise RuntimeError(
            f"the Ray cluster has {have:g} CPUs but the RL roles need {need:g} "
            f"(trainer {trainer_ranks} x {c.trainer_cpus:g} + "
            f"{c.rollouts} rollouts x {c.rollout_cpus:g} + "
            f"{nodes} relays x {c.relay_cpus:g}): lower cluster.rollout_cpus / cluster.trainer_cpus "
            "or add nodes; the actors would otherwise wait for resources forever"
        )


def kill_actors(ray, handles: list) -> None:
    """Kill every actor of ``handles`` for good (no restart); one already gone is skipped."""
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001
            pass


def start_ray(cluster: ClusterConfig, trainer_ranks: int):
    """``(ray, own)``: the ``ray`` module, initialised, and whether this call started it (then the run
    shuts it down at the end). An initialised Ray is used as it is."""
    import ray

    if ray.is_initialized():
        return ray, False
    kw = dict(
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=True,
        runtime_env={"env_vars": actor_env(cluster.actor_threads)},
    )
    if cluster.address:
        ray.init(address=cluster.address, **kw)
        return ray, True
    num_cpus = max(cluster.num_cpus or os.cpu_count(), math.ceil(cpus_needed(cluster, trainer_ranks, 1)))
    _start_local(ray, num_cpus, kw)
    return ray, True


def _start_local(ray, num_cpus: int, kw: dict) -> None:
    """A local Ray that serves this machine only: its auth token (on by default for a new local cluster)
    goes in a 0600 file before Ray reads it (Ray writes ~/.ray/auth_token with the umask, 0644), and
    every server of it listens on the loopback. Ray resolves _node_ip_address="127.0.0.1" to the outward
    address except in its single-node mode, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read at import, so its
    constant too): set for the start (the processes Ray starts inherit it)."""
    from ray._private import ray_constants

    _ensure_auth_token()
    var, saved = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, ray_constants.ENABLE_RAY_CLUSTER
    saved_env = os.environ.get(var)
    os.environ[var], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:  # Ray's CPUs are a scheduling resource: enough for every role, however many cores
        # address="local": always a new Ray of its own, never one a killed run left recorded in
        # /tmp/ray/ray_current_cluster (single-node mode would try to join that)
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kw)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved_env


def _ensure_auth_token() -> None:
    """Ray's auth token file, created 0600 (or made 0600) unless auth is off or the token is given in
    the environment."""
    import secrets

    if os.environ.get("RAY_AUTH_MODE", "token").lower() == "disabled" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    token.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(token, 0o600)
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # as Ray generates it
