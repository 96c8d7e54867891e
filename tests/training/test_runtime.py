"""The Ray driver (the Laminar runtime) on real Ray actors: modes, whole-group training, failure
isolation, resume.

Fault tests use real processes and real signals (SIGKILL of a rollout, a relay, the trainer).
"""

from __future__ import annotations

import os
import sys
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from conf.schema import ModelConfig, RolloutConfig, TrainerConfig
from generation.model import build_char_tokenizer, build_tiny_model, encode_problem, save_model
from training.objectives import PRESETS
from generation.records import PromptItem

from tests.training.rl_fakes import Verdict
from training.rl.sections import RLSections

ray = pytest.importorskip("ray")

TINY = ModelConfig(
    hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=64
)


class ExactVerifier:
    def verify_batch(self, texts, answers):
        return [Verdict(t.strip().endswith(a)) for t, a in zip(texts, answers)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rt-model")
    tok = build_char_tokenizer()
    save_model(build_tiny_model(TINY, tok, seed=0), tok, d)
    return d


@pytest.fixture(scope="module")
def prompts(model_dir):
    from generation.model import load_tokenizer

    tok = load_tokenizer(model_dir)
    return [
        PromptItem(
            f"p{i}",
            f"{i % 7}+{i % 5}",
            str(i % 7 + i % 5),
            encode_problem(tok, "{problem}\n", f"{i % 7}+{i % 5}"),
            1,
        )
        for i in range(200)
    ]


def make_runtime(
    model_dir,
    prompts,
    mode,
    *,
    steps=5,
    on_step=None,
    state_dir=None,
    checkpoint_every=0,
    max_staleness=4,
    eval_every=0,
    evaluate=None,
    trainer=None,
    rollout=None,
    **cluster_kw,
):
    """A small run in the schema's own config sections (what a user's config builds)."""
    from conf.schema import ClusterConfig, RLConfig, RolloutConfig, TrainerConfig
    from training.rl.drivers.ray import LaminarRuntime

    rl = RLConfig(
        mode=mode,
        steps=steps,
        prompts_per_step=4,
        group_size=4,
        lr=1e-3,
        max_new_tokens=24,
        rollout_capacity=16,
        chunk_steps=4,
        max_staleness=max_staleness,
        repack_interval_s=0.2,
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        micro_batch_tokens=0,
    )
    return LaminarRuntime(
        model_dir,
        prompts,
        ExactVerifier(),
        PRESETS["grpo"],
        RLSections(
            rl,
            seed=0,
            rollout=rollout or RolloutConfig(),
            trainer=trainer or TrainerConfig(),
            cluster=ClusterConfig(**{"rollouts": 2, **cluster_kw}),
        ),
        device="cpu",
        state_dir=state_dir,
        on_step=on_step,
        evaluate=evaluate,
    )


def check_whole_groups_once(rt, result, group_size=4):
    uids = rt.summary["trained_uids"]
    assert len(uids) == len(set(uids)), "a group was trained twice"
    assert all(m.trained_trajectories == group_size * 4 for m in result.history), "a half-trained group"
    assert sum(result.consumed.values()) == group_size * len(uids)


@pytest.mark.slow  # make test keeps tests/e2e/test_laminar_run.py (the same runtime through the pipeline)
def test_laminar_mode_trains_whole_groups_and_draws_a_timeline(local_ray, model_dir, prompts, tmp_path):
    rt = make_runtime(model_dir, prompts, "laminar", steps=6)
    result = rt.run()
    assert len(result.history) == 6 and rt.summary["updates"] == 6
    check_whole_groups_once(rt, result)
    hist = {int(k): v for k, v in rt.summary["staleness_histogram"].items()}
    assert sum(hist.values()) == 24 and max(hist) <= 4
    assert rt.summary["pulls"] >= 2  # the rollouts moved to newer versions while running
    cpu = rt.summary["cpu_seconds"]  # each role's CPU over the loop
    assert set(cpu) == {"driver", "trainer-0", "relay-0", "rollout-0", "rollout-1"}
    assert min(cpu["trainer-0"], cpu["rollout-0"], cpu["rollout-1"]) > 0 and rt.summary["loop_seconds"] > 0
    kinds = Counter(e["kind"] for e in rt.timeline["events"])
    assert kinds["pull"] >= 2 and len(rt.timeline["updates"]) == 6 and rt.timeline["samples"]
    for m in result.history:
        assert m.tokens_per_s > 0 and 0 <= m.occupancy <= 1 and m.publish_stall_s >= 0
    from evaluation.timeline import plot_timeline

    assert plot_timeline(rt.timeline, tmp_path / "t.png").stat().st_size > 1000


@pytest.mark.slow
def test_sync_has_no_staleness_and_one_step_at_most_one(local_ray, model_dir, prompts):
    rt = make_runtime(model_dir, prompts, "sync", steps=3)
    result = rt.run()
    check_whole_groups_once(rt, result)
    assert set(rt.summary["staleness_histogram"]) == {"0"}
    rt = make_runtime(model_dir, prompts, "one_step", steps=4)
    result = rt.run()
    check_whole_groups_once(rt, result)
    assert {int(k) for k in rt.summary["staleness_histogram"]} <= {0, 1}
    assert "1" in rt.summary["staleness_histogram"]  # it really ran a step ahead


@pytest.mark.slow
def test_partial_mode_interrupts_and_continues_under_new_weights(local_ray, model_dir, prompts):
    rt = make_runtime(model_dir, prompts, "partial", steps=5)
    result = rt.run()
    check_whole_groups_once(rt, result)
    assert rt.summary.get("interrupts", 0) >= 1


@pytest.mark.slow
def test_sigkill_a_rollout_mid_generation_loses_only_its_work(local_ray, model_dir, prompts):
    killed = {}

    def on_step(m):
        if m.step == 2 and not killed:
            victim = rt.rollouts["rollout-0"]
            assert victim.future is not None  # it is mid-generation
            os.kill(victim.pid, signal.SIGKILL)
            killed["pid"] = victim.pid
            # the tiny run is fast: hold the driver until Ray reports the death ...
            ray.wait([victim.future], timeout=30)
        if m.step == 6:  # ... and, later, until Ray has restarted the actor
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    ray.get(rt.rollouts["rollout-0"].handle.ping.remote(), timeout=5)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    time.sleep(0.2)  # still restarting
            time.sleep(1.2)  # the manager notices within a second
            # every rollout, the restarted one too, at the idle CPU priority (asked while they live:
            # the run's teardown kills them)
            killed["idle"] = [ray.get(r.handle.ping.remote()).idle_priority for r in rt.rollouts.values()]

    rt = make_runtime(model_dir, prompts, "laminar", steps=30, on_step=on_step)
    result = rt.run()
    assert killed and rt.summary["rollout_failures"] >= 1 and rt.summary["requeued_requests"] > 0
    assert rt.rollouts["rollout-0"].pid != killed["pid"]  # Ray restarted it ...
    if (
        sys.platform == "linux"
    ):  # ... at the rollouts' idle CPU priority (cluster.rollout_priority), as the others
        assert killed["idle"] == [True, True]
    restarted = [e for e in rt.timeline["events"] if e["rollout"] == "rollout-0"]
    assert any(e["kind"] == "restart" for e in restarted)
    assert any(
        e["kind"] == "pull" and e["t"] > next(x["t"] for x in restarted if x["kind"] == "restart")
        for e in restarted
    )  # ... and it pulled weights from its relay again
    check_whole_groups_once(rt, result)
    assert len(result.history) == 30


@pytest.mark.slow
def test_a_killed_relay_is_bypassed_and_rebuilt(local_ray, model_dir, prompts):
    state = {}

    def on_step(m):
        if m.step == 2 and not state:
            info = ray.get(rt.relays[rt.chain.master].ping.remote())
            os.kill(info.pid, signal.SIGKILL)
            state["version"] = int(m.step)
            time.sleep(1.2)  # the tiny run is fast: let the manager's relay check (every second) come due

    rt = make_runtime(model_dir, prompts, "laminar", steps=12, on_step=on_step)
    result = rt.run()
    assert rt.summary["relay_failures"] >= 1 and rt.summary["relays"] != ["relay-0"]
    later_pulls = [
        e for e in rt.timeline["events"] if e["kind"] == "pull" and e["version"] > state["version"]
    ]
    assert later_pulls, "rollouts got no new version after the relay died"
    check_whole_groups_once(rt, result)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_sigkill_the_trainer_then_resume_from_the_last_checkpoint(
    local_ray, model_dir, prompts, tmp_path, backend
):
    from training.rl.checkpoint import RUN_STATE, latest_checkpoint, load_json

    from conf.schema import TrainerConfig

    state_dir = tmp_path / "state"
    ckpt = state_dir / "checkpoints"
    kw = dict(trainer=TrainerConfig(backend=backend, deepspeed="zero2"), state_dir=state_dir)

    def on_step(m):
        if m.step == 5:
            os.kill(ray.get(rt.trainer.lead.ping.remote()).pid, signal.SIGKILL)

    rt = make_runtime(model_dir, prompts, "laminar", steps=8, on_step=on_step, checkpoint_every=2, **kw)
    with pytest.raises(ray.exceptions.RayActorError):
        rt.run()
    last = latest_checkpoint(ckpt)
    assert last is not None and last.name == "step-000004"
    saved = load_json(last, RUN_STATE)
    buffered = {t["group_uid"] for t in saved["buffer"]["partial"] + saved["buffer"]["ready"]}
    in_flight = {q["group_uid"] for q in saved["in_flight"]}
    if backend == "deepspeed":  # DeepSpeed's own checkpoint files, inside the atomic folder
        assert (last / "deepspeed").is_dir() and not (last / "optimizer.safetensors").exists()
    rt2 = make_runtime(model_dir, prompts, "laminar", steps=8, checkpoint_every=2, **kw)
    result = rt2.run()
    assert rt2.summary.get("resumed") == 1 and len(result.history) == 8
    assert rt2.summary["trainer_backend"] == backend
    uids = rt2.summary["trained_uids"]
    assert uids[: len(saved["trained_uids"])] == saved["trained_uids"] and len(uids) == len(set(uids))
    # the same prompt order: uid k is the k-th prompt of the seeded cursor in both runs
    from training.rl.loop import PromptCursor

    order = [p.prompt_id for p in PromptCursor(prompts, 0).take(max(uids) + 1)]
    by_uid = {uid: pid for uid, pid in rt2.summary["trained_prompts"]}
    assert all(order[uid] == pid for uid, pid in by_uid.items())  # uid k is still the k-th prompt
    # buffered and in-flight groups at the checkpoint were kept: trained after the resume
    after = set(uids[len(saved["trained_uids"]) :])
    assert (buffered | in_flight) & after, "nothing buffered at the checkpoint was trained after resuming"


@pytest.mark.slow
def test_two_node_cluster_one_relay_per_node_rollouts_pull_locally(model_dir, prompts):
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
        cluster.wait_for_nodes()
        rt = make_runtime(
            model_dir,
            prompts,
            "laminar",
            steps=3,
            rollouts=2,
            address=cluster.address,
            trainer_cpus=0.25,
            rollout_cpus=0.25,
            relay_cpus=0.05,
        )
        result = rt.run()
        s = rt.summary
        assert len(s["relays"]) == 2 and len(set(s["relay_nodes"].values())) == 2  # one relay per node
        for name, relay in s["rollout_relays"].items():  # each rollout pulls from its own node's relay
            assert s["relay_nodes"][relay] == s["rollout_nodes"][name]
        assert len(set(s["rollout_nodes"].values())) == 2
        check_whole_groups_once(rt, result)
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_two_node_cluster_places_trainer_ranks_and_rollouts_per_config(model_dir, prompts):
    """cluster.trainer_strategy=STRICT_SPREAD puts the two trainer ranks on different nodes;
    cluster.rollout_nodes=[1] puts both rollouts on the second node, pulling from its relay."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
        cluster.wait_for_nodes()
        rt = make_runtime(
            model_dir,
            prompts,
            "laminar",
            steps=3,
            rollouts=2,
            address=cluster.address,
            trainer_cpus=0.25,
            rollout_cpus=0.25,
            relay_cpus=0.05,
            trainer=TrainerConfig(ranks=2),
            trainer_strategy="STRICT_SPREAD",
            rollout_nodes=[1],
        )
        result = rt.run()
        s = rt.summary
        head, worker = rt.nodes
        assert sorted(s["trainer_nodes"]) == sorted([head, worker])  # one rank per node
        assert set(s["rollout_nodes"].values()) == {worker}
        assert all(s["relay_nodes"][relay] == worker for relay in s["rollout_relays"].values())
        assert len(s["relays"]) == 2
        check_whole_groups_once(rt, result)
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow
def test_rollouts_with_the_engine_behind_the_worker_protocol(local_ray, model_dir, prompts):
    """rollout.engine=torch-process: each rollout actor drives a worker process over the rollout
    protocol's wire format (the path a vLLM worker takes) and the run trains whole groups once."""
    rt = make_runtime(model_dir, prompts, "laminar", steps=3, rollout=RolloutConfig(engine="torch-process"))
    result = rt.run()
    assert len(result.history) == 3
    check_whole_groups_once(rt, result)
    assert rt.summary["pulls"] >= 2


@pytest.mark.slow
def test_bounded_laminar_generates_nothing_that_goes_stale_and_evaluates_beside_the_loop(
    local_ray, model_dir, prompts, tmp_path
):
    """Flow control counts the batch in the trainer's hands: with ``max_staleness=1`` every admitted
    group is trained in time (none is dropped stale and regenerated). The in-run evaluation runs in a
    thread beside the loop and its metrics land in its step's history entry. A checkpoint falling due
    while it runs does not stop the loop: it is written after the evaluation, with its metrics."""
    import threading

    from training.rl.checkpoint import RUN_STATE, checkpoint_step, list_checkpoints, load_json

    seen, waited_out = [], []

    def evaluate(model):
        seen.append(threading.current_thread().name)
        until = 5 if len(seen) == 1 else 0  # version 3's evaluation lasts until the loop is past the
        deadline = time.monotonic() + 60  # checkpoint due at 4 (one the loop waited for would time out)
        while rt.version < until and time.monotonic() < deadline:
            time.sleep(0.02)
        waited_out.append(rt.version < until)
        return {"eval_probe": float(sum(p.detach().abs().sum() for p in model.parameters()))}

    rt = make_runtime(
        model_dir,
        prompts,
        "laminar",
        steps=8,
        max_staleness=1,
        state_dir=tmp_path,
        checkpoint_every=2,
        eval_every=3,
        evaluate=evaluate,
    )
    result = rt.run()
    check_whole_groups_once(rt, result)
    assert rt.summary["stale_dropped"] == 0
    assert max(int(k) for k in rt.summary["staleness_histogram"]) <= 1
    assert seen == ["laminar-eval", "laminar-eval"]  # versions 3 and 6, never on the loop's thread
    assert waited_out == [False, False]
    evals = [m.extra.get("eval_probe") for m in result.history]
    assert [i + 1 for i, v in enumerate(evals) if v is not None] == [3, 6]
    assert evals[2] != evals[5]  # each saw its own version's weights
    steps = [checkpoint_step(c) for c in list_checkpoints(tmp_path / "checkpoints")]  # the last two are kept
    assert 4 not in steps and max(steps) >= 5  # due at 4 while version 3 was evaluated: written after it
    history = load_json(tmp_path / "checkpoints" / f"step-{max(steps):06d}", RUN_STATE)["history"]
    assert (
        len(history) == max(steps) and history[2]["eval_probe"] == evals[2]
    )  # with the evaluation's metrics


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE and niceness as Linux has them")
@pytest.mark.parametrize("priority", ["idle", "low", "normal"])
def test_lower_priority_sets_the_calling_process_as_asked(priority):
    """``cluster.rollout_priority`` in a fresh process (it lowers the calling thread for good)."""
    import subprocess

    code = (
        "import os; from training.rl.actors import lower_priority; n = os.getpriority(os.PRIO_PROCESS, 0); "
        f"lower_priority({priority!r}); "
        "print(os.sched_getscheduler(0) == os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, 0) - n)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.split()
    assert out == {"idle": ["True", "0"], "low": ["False", "10"], "normal": ["False", "0"]}[priority]


def test_actor_env_keeps_freed_memory_in_the_heap_unless_the_caller_says_otherwise(monkeypatch):
    from training.rl.drivers.ray import actor_env

    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(k, raising=False)
    env = actor_env(1)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20) and env["MALLOC_TRIM_THRESHOLD_"] == str(256 << 20)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the driver's own tuning wins
    env = actor_env(2)
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536" and env["OMP_NUM_THREADS"] == "2"
