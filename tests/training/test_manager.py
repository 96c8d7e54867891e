"""The rollout manager (``training.rl.manager``): driven directly, by the simulator, by the local
driver and by the Ray driver, with the same methods; and the Ray driver's settings are the schema's own."""

from __future__ import annotations

from collections import Counter

import pytest

from conf.schema import ClusterConfig, Config, RLConfig, RolloutConfig, TrainerConfig
from generation.records import Partial, PromptItem, ScoredGroup, Trajectory
from training.objectives import PRESETS
from training.rl.control import MODES
from training.rl.loop import PromptCursor
from training.rl.manager import ManagerSettings, RolloutManager
from training.rl.records import ExtractOrder, PullResult, RolloutStatus, StepOrder
from training.rl.sections import RLSections

DRIVEN = (
    "dispatch",
    "step_done",
    "extract_done",
    "next_batch",
    "updated",
    "maybe_open_batch",
    "repack",
    "requeue",
    "retained_versions",
)


class Outside:
    """A recording stand-in for the runtime or the simulator."""

    def __init__(self):
        self.refreshed, self.poked, self.notes = 0, [], []

    def refresh(self):
        self.refreshed += 1

    def poke(self, rollout):
        self.poked.append(rollout)

    def note(self, rollout, kind, version):
        self.notes.append((rollout, kind, version))


def prompts(n=40):
    return [PromptItem(f"p{i}", str(i), str(i), (1, 2), 1) for i in range(n)]


def score_by(right: dict[str, float]):
    """Scores a group with response i right iff i < right[prompt] x group size."""

    def score(trajs):
        k = right.get(trajs[0].prompt.prompt_id, 0.0) * len(trajs)
        correct = tuple(t.sample_idx < k for t in trajs)
        return ScoredGroup(
            "scored_group", trajs[0].prompt.prompt_id, tuple(trajs), tuple(map(float, correct)), correct
        )

    return score


def finish(order: StepOrder, version: int) -> list[Trajectory]:
    return [
        Trajectory(
            "trajectory", q.prompt, q.sample_idx, (5,), (-0.1,), version, True, "x", group_uid=q.group_uid
        )
        for q in order.submit
    ]


def manager(mode="sync", *, rollouts=2, dynamic=False, rounds=5, right=None, n=4, group=2, capacity=8):
    settings = ManagerSettings(
        mode=MODES[mode],
        steps=3,
        prompts_per_step=n,
        group_size=group,
        capacity=capacity,
        max_staleness=None,
        max_sampling_rounds=rounds if dynamic else 1,
    )
    out = Outside()
    keep = (lambda g: len(set(g.correct)) > 1) if dynamic else None
    m = RolloutManager(
        settings,
        PromptCursor(prompts(), 0),
        score_by(right or {}),
        out,
        [(f"rollout-{i}", "node", "relay-0") for i in range(rollouts)],
        keep=keep,
    )
    return m, out


def run_batch(m: RolloutManager) -> None:
    """Every rollout with work steps once and finishes all it was given, at the batch's version."""
    for name in m.rollouts:
        order = m.dispatch(name)
        if order is not None:
            m.step_done(
                name,
                finish(order, m.batches.min_version),
                RolloutStatus(m.batches.min_version, 0, 0, 8),
                PullResult(True, m.batches.min_version) if order.pull else None,
            )


def test_sync_batch_is_dealt_by_group_trained_once_and_version_gated():
    m, out = manager("sync")
    assert m.maybe_open_batch() == "issued" and m.batches.idx == 1
    assert out.refreshed == 1 and sorted(out.poked) == ["rollout-0", "rollout-1"]  # both got whole groups
    assert m.maybe_open_batch() == ""  # nothing finished yet
    first = m.dispatch("rollout-0")
    assert first.pull and {q.group_uid for q in first.submit} == {0, 2}  # whole groups, round-robin
    m.step_done("rollout-0", finish(first, 0), RolloutStatus(0, 0, 0, 8), PullResult(True, 0))
    assert m.maybe_open_batch() == ""  # rollout-1's groups are still out
    run_batch(m)
    assert m.maybe_open_batch() == "closed" and m.maybe_open_batch() == ""  # sync waits for the update
    groups = m.next_batch()
    assert [u for u, _ in groups] == [0, 1, 2, 3] and m.training_responses == 8 and m.next_batch() == []
    m.updated(1)
    assert m.trained_uids == [0, 1, 2, 3] and sum(m.consumed.values()) == 8 and len(m.rewards) == 4
    assert m.maybe_open_batch() == "issued" and m.batches.min_version == 1


def test_dynamic_sampling_rounds_fill_the_batch_and_an_empty_batch_repeats():
    right = {f"p{i}": 0.5 for i in range(0, 40, 2)}  # odd prompts: every response wrong, no signal
    m, _ = manager("sync", dynamic=True, right=right)
    m.maybe_open_batch()
    for _ in range(4):
        run_batch(m)
        if m.maybe_open_batch() == "closed":
            break
    assert m.counts["extra_rounds"] >= 1 and m.buffer.stats.filtered >= 1
    groups = m.next_batch()
    assert len(groups) == 4 and all(len(set(g.correct)) > 1 for _, g in groups)
    # a batch whose groups are all filtered: no update, and the batch index is issued again
    m2, _ = manager("sync", dynamic=True, rounds=1, right={})
    m2.maybe_open_batch()
    run_batch(m2)
    assert m2.maybe_open_batch() == "closed" and m2.next_batch() == [] and m2.counts["empty_batches"] == 1
    assert m2.batches.idx == 0 and m2.maybe_open_batch() == "issued"


def test_relays_keep_the_latest_versions_and_every_version_a_rollout_still_decodes_with():
    m, _ = manager("laminar")
    m.start_at(7)
    m.rollouts["rollout-0"].version, m.rollouts["rollout-0"].active = 3, 5  # a long response on version 3
    m.rollouts["rollout-1"].version, m.rollouts["rollout-1"].active = 5, 0  # idle: holds nothing
    assert m.retained_versions(2) == {6, 7, 3}
    assert m.retained_versions(1, latest=8) == {8, 3}  # the simulator asks before the update lands
    m.rollouts["rollout-0"].active = 0
    assert m.retained_versions(2) == {6, 7}


def test_the_step_metrics_round_trip_and_keep_the_history_keys():
    from training.rl.records import StepMetrics, UpdateStats

    m, _ = manager("sync")
    m.maybe_open_batch()
    run_batch(m)
    m.maybe_open_batch()
    m.next_batch()
    stats = UpdateStats(
        "update_stats", 1, 0.5, 2.0, 8, 8, {"clipfrac": 0.25, "kl": 0.1, "staleness_max": 9.0}
    )
    got = m.updated(1, stats, wall=2.0, train_s=0.5)
    assert (got.step, got.trained_trajectories, got.trained_tokens, got.sampling_rounds) == (1, 8, 8, 1)
    lengths = {"response_length_wrong": 1.0, "repeated_ngram_rate": 0.0}  # no response is correct
    assert got.clipfrac == 0.25 and got.extra == {"kl": 0.1, **lengths} and got.staleness_max == 0.0
    assert got.gen_seconds == 1.5 and got.tokens_per_s == 4.0
    d = got.as_dict()
    assert all(isinstance(v, float) for v in d.values()) and {"step", "reward", "loss", "kl"} <= set(d)
    assert StepMetrics.from_dict(d) == got
    with pytest.raises(ValueError, match="lack"):
        StepMetrics.from_dict({"step": 1.0})


def test_a_dead_rollout_loses_only_its_work_and_a_repack_hands_partials_over():
    m, out = manager("laminar", capacity=4, n=2, group=2)
    a, b = m.dispatch("rollout-0"), m.dispatch("rollout-1")
    assert a.pull and len(a.submit) == 4 and len(b.submit) == 4  # continuous: free slots from the queue
    held = set(m.rollouts["rollout-0"].assigned)
    assert m.died("rollout-0") == 4 and [(q.group_uid, q.sample_idx) for q in m.queue.retry] == sorted(held)
    assert sorted((q.group_uid, q.sample_idx) for q in m.in_flight()) == sorted(
        held | set(m.rollouts["rollout-1"].assigned)
    )
    m.revived("rollout-0")
    assert m.rollouts["rollout-0"].alive and m.rollouts["rollout-0"].version == -1
    # rollout-1 in its long tail (1 of 4 active, falling), rollout-0 idle at the same version: repack
    m.step_done("rollout-1", [], RolloutStatus(0, 3, 0, 4), PullResult(True, 0))
    m.rollouts["rollout-1"].busy = True
    m.step_done("rollout-1", [], RolloutStatus(0, 1, 0, 4), None)
    r0 = m.dispatch("rollout-0")
    m.step_done("rollout-0", [], RolloutStatus(0, 2, 0, 4), PullResult(True, 0))
    m.repack()
    assert m.rollouts["rollout-1"].extract_to == "rollout-0" and "rollout-1" in out.poked
    assert isinstance(m.dispatch("rollout-1"), ExtractOrder)
    req = next(iter(m.rollouts["rollout-1"].assigned.values()))
    dst = m.extract_done("rollout-1", [Partial(req, (7,), (-0.2,), 0)], [], RolloutStatus(0, 0, 0, 4))
    assert dst == "rollout-0" and m.rollouts["rollout-0"].pending_inject[0].request == req
    assert ("rollout-1", "repack_out", 0) in out.notes and r0 is not None


def test_a_laminar_rollout_holding_only_parked_episodes_pulls_and_takes_any_parked_hand_over():
    m, out = manager("laminar", capacity=4, n=2, group=2)
    m.dispatch("rollout-0")
    m.step_done("rollout-0", [], RolloutStatus(0, 4, 0, 4, parked=3), PullResult(True, 0))
    m.updated(1)
    order = m.dispatch("rollout-0")
    assert not order.pull and not order.admitting  # one turn still decodes: drain
    m.step_done("rollout-0", [], RolloutStatus(0, 3, 0, 4, parked=3), None)
    assert m.dispatch("rollout-0").pull  # only parked episodes: the new weights now
    # a parked episode (version -1) continues on a rollout of another version; a turn in flight does not
    r1 = m.rollouts["rollout-1"]
    r1.version = 1
    reqs = list(m.rollouts["rollout-0"].assigned.values())[:2]
    kept = m.repacks.same_version(r1, [Partial(reqs[0], (), (), -1), Partial(reqs[1], (5,), (-0.1,), 0)])
    assert [p.request for p in kept] == [reqs[0]] and m.counts["repack_lost"] == 1


def test_runtime_settings_are_the_schema_defaults():
    """No second copy of the config: the runtime keeps the schema's sections and the manager's
    settings are read from them in one place."""
    import training.rl.drivers.ray as runtime

    assert not hasattr(runtime, "RuntimeConfig")
    cfg = Config()
    rl = cfg.rl.model_copy(update={"mode": "laminar"})
    rt = runtime.LaminarRuntime("unused", [], None, PRESETS["grpo"], RLSections(rl, seed=0), device="cpu")
    assert rt.rl is rl and rt.cluster == ClusterConfig() == cfg.cluster
    assert rt.trainer_cfg == TrainerConfig() and rt.rollout_cfg == RolloutConfig()
    s = rt.settings
    assert (s.max_staleness, s.capacity, s.steps, s.prompts_per_step, s.group_size, s.repack_b) == (
        RLConfig().max_staleness,
        RLConfig().rollout_capacity,
        RLConfig().steps,
        RLConfig().prompts_per_step,
        RLConfig().group_size,
        RLConfig().repack_b,
    )
    assert s.mode.admit_lag == RLConfig().admit_lag and s.max_sampling_rounds == 1
    assert rt.cluster.driver_threads == 1 and rt.cluster.trainer_threads == 0  # what users run


def test_the_learning_rate_reaches_the_optimizer_in_three_hops(tmp_path):
    """``RLConfig`` travels as one object: (1) ``training.rl.stage.rl`` hands it to ``LaminarRuntime``
    (or ``LocalDriver``), (2) the runtime hands it to each ``TrainerWorker``, (3) the worker builds
    ``PolicyTrainer.from_config(rl)``, which gives ``rl.lr`` to ``torch.optim.AdamW``."""
    from conf.schema import ModelConfig
    from generation.model import build_char_tokenizer, build_tiny_model, save_model
    from training.rl.actors import TrainerWorker

    tok = build_char_tokenizer()
    save_model(
        build_tiny_model(
            ModelConfig(
                hidden_size=16,
                intermediate_size=32,
                num_layers=1,
                num_heads=2,
                num_kv_heads=1,
                max_seq_len=32,
            ),
            tok,
            seed=0,
        ),
        tok,
        tmp_path,
    )
    rl = RLConfig(lr=0.0123, weight_decay=0.01, max_grad_norm=0.5)
    worker = TrainerWorker(str(tmp_path), PRESETS["grpo"], rl, device="cpu", seed=0)  # hop 2
    group = worker.trainer.opt.param_groups[0]
    assert group["lr"] == 0.0123 and group["weight_decay"] == 0.01 and worker.trainer.max_grad_norm == 0.5


def spy_on_manager(monkeypatch) -> Counter:
    calls: Counter = Counter()
    for name in DRIVEN:
        fn = getattr(RolloutManager, name)

        def wrapped(self, *a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(self, *a, **k)

        monkeypatch.setattr(RolloutManager, name, wrapped)
    return calls


def test_the_simulator_and_both_drivers_drive_the_same_manager(monkeypatch, tmp_path):
    """Spies on the manager's methods: the simulator, the real Ray driver (a tiny laminar and a tiny
    sync run) and the local driver (the same sync run) call the same ones, so a behaviour added to
    the manager is in all three."""
    pytest.importorskip("ray")
    from conf.simulate import simulate_config
    from training.rl.drivers import sim

    calls = spy_on_manager(monkeypatch)
    cfg = simulate_config(
        {
            "cluster": {"nodes": 1, "gpus_per_node": 4, "trainer_share": 0.25},
            "workload": {
                "prompts_per_step": 4,
                "group_size": 4,
                "steps": 4,
                "max_output": 512,
                "prompt_len": 16,
                "lengths": {"median": 60, "p99_over_median": 12},
            },
            "sched": {"capacity": 8, "repack_interval_s": 0.5},
            "cost": {"mfu_train": 0.02},
        }
    )
    for mode in ("laminar", "sync"):
        sim.Simulator(cfg, mode).run()
    by_sim = {k for k, v in calls.items() if v}
    calls.clear()

    from conf.schema import ModelConfig
    from generation.model import build_char_tokenizer, build_tiny_model, encode_problem, save_model
    from training.rl.drivers.local import LocalDriver
    from training.rl.drivers.ray import LaminarRuntime

    tok = build_char_tokenizer()
    save_model(
        build_tiny_model(
            ModelConfig(
                hidden_size=32,
                intermediate_size=64,
                num_layers=1,
                num_heads=2,
                num_kv_heads=1,
                max_seq_len=64,
            ),
            tok,
            seed=0,
        ),
        tok,
        tmp_path,
    )
    items = [
        PromptItem(
            f"p{i}",
            f"{i % 7}+{i % 5}",
            str(i % 7 + i % 5),
            encode_problem(tok, "{problem}\n", f"{i % 7}+{i % 5}"),
            1,
        )
        for i in range(64)
    ]

    class Verifier:
        def verify_batch(self, texts, answers):
            from tests.training.rl_fakes import Verdict

            return [Verdict(t.strip().endswith(a)) for t, a in zip(texts, answers)]

    import ray

    from training.rl.drivers.ray import actor_env

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": actor_env(1)},
    )

    def rl_for(mode: str) -> RLConfig:
        return RLConfig(
            mode=mode,
            steps=3,
            prompts_per_step=4,
            group_size=4,
            max_new_tokens=24,
            rollout_capacity=16,
            chunk_steps=4,
            repack_interval_s=0.05,
            micro_batch_tokens=0,
        )

    by_ray_sync: set = set()
    try:
        for mode in ("laminar", "sync"):
            rl = rl_for(mode)
            before = Counter(calls)
            rt = LaminarRuntime(
                tmp_path,
                items,
                Verifier(),
                PRESETS["grpo"],
                RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=2)),
                device="cpu",
            )
            assert len(rt.run().history) == 3
            if mode == "sync":
                by_ray_sync = {k for k, v in (calls - before).items() if v}
    finally:
        ray.shutdown()
    by_runtime = {k for k, v in calls.items() if v}
    calls.clear()
    local = LocalDriver(
        tmp_path, items, Verifier(), PRESETS["grpo"], RLSections(rl_for("sync"), seed=0), device="cpu"
    )
    assert len(local.run().history) == 3
    by_local = {k for k, v in calls.items() if v}
    core = {"dispatch", "step_done", "next_batch", "updated", "maybe_open_batch"}
    assert (
        core | {"repack", "retained_versions"} <= by_sim
        and core | {"repack", "retained_versions"} <= by_runtime
    )
    assert core <= by_local and by_local == by_ray_sync - {"retained_versions"}, (by_local, by_ray_sync)
