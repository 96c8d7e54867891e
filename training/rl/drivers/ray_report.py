"""What a Ray run reports about itself: the CPU each role spent (``CpuLedger``) and the run's summary
(``run_summary``: ``LaminarRuntime.summary``)."""

from __future__ import annotations

import logging
import os
import time

import psutil

from training.rl.control import RelayChain

LOG = logging.getLogger("laminar.training")


class CpuLedger:
    """CPU seconds each role's process spent over the loop (``summary["cpu_seconds"]``): its CPU time
    when the loop starts and the latest seen. Rollouts report theirs with every result; the trainer
    ranks and relays answer a ping at both ends; the driver counts all its threads (scoring, HIVE's
    prompt entropy, the in-run evaluation). A restarted process counts from its first report. Plus
    the head machine's busy share over the loop (``psutil.cpu_times``), to tell a CPU-bound loop
    from one that waits."""

    def __init__(self):
        self.procs: dict[str, list] = {}  # name -> [pid, cpu at first sight, cpu last seen]
        self.done: dict[str, float] = {}  # CPU of earlier processes of the same role (restarts)
        self.machine0 = machine_jiffies()
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
        m1 = machine_jiffies()
        if m1[1] > self.machine0[1]:
            out["machine_busy"] = (m1[0] - self.machine0[0]) / (m1[1] - self.machine0[1])
        return out


def machine_jiffies() -> tuple[float, float]:
    """(busy, total) CPU seconds of this machine since boot (``psutil``; iowait counts as idle, guest
    time is already inside user time)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(
        getattr(t, k, 0.0) for k in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    )
    return total - idle, total


def run_summary(
    manager, history: list, wall: float, chain: RelayChain, *, rollouts: int, trainer: dict, cpu: dict
) -> dict:
    """The run's summary: updates, throughput, staleness, the manager's counts and what it trained,
    where each role ran (``chain``: the relays; ``trainer``: its backend and nodes) and ``cpu`` (a
    ``CpuLedger.report``). Logs the CPU line."""
    m = manager
    trained = sum(h.trained_tokens for h in history)
    summary = {
        "mode": m.mode.name,
        "updates": len(history),
        "wall_seconds": wall,
        "trained_tokens": trained,
        "tokens_per_s": trained / max(wall, 1e-9),
        "staleness_histogram": {str(k): v for k, v in sorted(m.buffer.stats.staleness.items())},
        "duplicates_ignored": m.buffer.stats.duplicates,
        "stale_dropped": m.buffer.stats.stale_dropped,
        **{k: v for k, v in m.counts.items() if k != "idle_spins"},
        "publish_stall_s": [h.publish_stall_s for h in history],
        "publish_cpu_s": [h.publish_cpu_s for h in history],
        "rollouts": rollouts,
        "relays": list(chain.order),
        "relay_nodes": {n: chain.node_of[n] for n in chain.order},
        "rollout_relays": {r.name: r.relay for r in m.rollouts.values()},
        "rollout_nodes": {r.name: r.node for r in m.rollouts.values()},
        "trainer_backend": trainer["backend"],
        "trainer_nodes": trainer["nodes"],
        "trained_uids": m.trained_uids,
        "response_lengths": m.response_lengths,
        "trained_prompts": m.trained_prompts,
        **cpu,
    }
    LOG.info(
        "CPU over the loop (%.1f s, %d cores%s): %s",
        summary["loop_seconds"],
        summary["cores"],
        f", {100 * summary['machine_busy']:.0f}% busy" if "machine_busy" in summary else "",
        ", ".join(f"{n} {v:.1f} s" for n, v in summary["cpu_seconds"].items()),
    )
    return summary
