"""The cluster-scale simulator: deterministic, conserving, within the staleness bound, driving the
real control plane (no copy of it), and ``laminar simulate`` end to end on a tiny shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conf.simulate import SimulateConfig, simulate_config
from training.rl import control
from training.rl.drivers import sim


def tiny(**over) -> SimulateConfig:
    base = {
        "cluster": {"nodes": 2, "gpus_per_node": 4, "trainer_share": 0.25},
        "workload": {
            "prompts_per_step": 8,
            "group_size": 4,
            "steps": 6,
            "max_output": 2048,
            "prompt_len": 64,
            "lengths": {"median": 200, "p99_over_median": 10},
        },
        "sched": {"capacity": 16, "repack_interval_s": 1.0},
        "cost": {"train_gen_share": 0.0, "mfu_train": 0.02},
        "warmup_updates": 1,
    }
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return simulate_config(base)


@pytest.mark.parametrize("mode", sorted(sim.SIM_MODES))
def test_deterministic_and_conserving(mode):
    cfg = tiny()
    a, b = sim.Simulator(cfg, mode).run(), sim.Simulator(cfg, mode).run()
    assert a.summary() == b.summary()
    assert a.timeline == b.timeline
    # every group trained at most once; trained groups == steps x batch
    assert (
        len(a.trained_uids) == len(set(a.trained_uids)) == cfg.workload.steps * cfg.workload.prompts_per_step
    )
    assert a.updates == cfg.workload.steps
    assert sum(a.staleness_histogram.values()) == a.trained_groups
    assert a.trained_tokens > 0 and a.wall_s > 0


def test_seed_changes_the_lengths():
    a = sim.Simulator(tiny(), "laminar").run()
    b = sim.Simulator(tiny(seed=1), "laminar").run()
    assert a.trained_tokens != b.trained_tokens


@pytest.mark.parametrize("mode", ["partial", "laminar"])
def test_staleness_bound_respected(mode):
    cfg = tiny(sched={"max_staleness": 1}, workload={"steps": 8})
    r = sim.Simulator(cfg, mode).run()
    assert max(int(k) for k in r.staleness_histogram) <= 1
    assert len(r.trained_uids) == len(set(r.trained_uids))


def test_batched_modes_staleness():
    assert set(sim.Simulator(tiny(), "sync").run().staleness_histogram) == {"0"}
    assert set(sim.Simulator(tiny(), "one_step").run().staleness_histogram) <= {"0", "1"}


def test_laminar_beats_sync_on_a_long_tail():
    cfg = tiny(workload={"steps": 8, "lengths": {"median": 150, "p99_over_median": 12}})
    res = sim.simulate(cfg, ["sync", "laminar"])
    assert res["laminar"].steady_tokens_per_s > 1.3 * res["sync"].steady_tokens_per_s
    assert res["laminar"].idle_share < res["sync"].idle_share


def test_simulator_drives_the_runtimes_manager_and_control_plane(monkeypatch):
    """The simulator holds no copy of the manager: it drives ``training.rl.manager.RolloutManager``
    (the runtime's, see tests/training/test_manager.py), whose decisions come from
    ``training.rl.control`` (spied here)."""
    calls = {
        "plan_repack": 0,
        "dispatch_plan": 0,
        "add": 0,
        "take_uids": 0,
        "may_open_batch": 0,
        "admission_room": 0,
        "staleness_gate": 0,
    }

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(control, "plan_repack", spy("plan_repack", control.plan_repack))
    monkeypatch.setattr(control, "dispatch_plan", spy("dispatch_plan", control.dispatch_plan))
    monkeypatch.setattr(control, "may_open_batch", spy("may_open_batch", control.may_open_batch))
    monkeypatch.setattr(control, "admission_room", spy("admission_room", control.admission_room))
    monkeypatch.setattr(control, "staleness_gate", spy("staleness_gate", control.staleness_gate))
    for name in ("add", "take_uids"):
        monkeypatch.setattr(
            control.ExperienceBuffer, name, spy(name, getattr(control.ExperienceBuffer, name))
        )
    a = sim.Simulator(tiny(sched={"max_staleness": 1}), "laminar")
    a.run()
    sim.Simulator(tiny(), "sync").run()
    assert all(calls[k] > 0 for k in calls), calls
    from training.rl.manager import RolloutManager

    assert type(a.m) is RolloutManager and a.queue is a.m.queue and a.buffer is a.m.buffer
    src = "\n".join(p.read_text() for p in Path(sim.__file__).parent.glob("*.py"))
    for copied in (
        "def plan_repack",
        "class ExperienceBuffer",
        "def _trainable",
        "def _requeue",
        "dispatch_plan(",
        "admission_room(",
        "take_uids(",
    ):
        assert copied not in src, copied
    assert all(sim.SIM_MODES[m] is control.MODES[m] for m in control.MODES)


def test_dynamic_sampling_resamples_rounds_until_the_batch_is_full():
    """DAPO's dynamic sampling in the simulator, through the manager: groups whose responses all
    agree are dropped and a batched mode samples further rounds until its batch is full; the
    continuous modes keep admitting until enough groups with signal are ready."""
    base = {"workload": {"pass_rates": [0.0, 0.5, 0.5, 1.0]}, "sched": {"dynamic_sampling": True}}
    for mode in ("sync", "one_step", "laminar"):
        r = sim.Simulator(tiny(**base), mode).run()
        n, steps = 8, 6
        assert r.updates == steps and r.trained_groups == n * steps, mode  # every batch full
        assert r.dropped_groups > 0, mode  # about three prompts in five have no variance
        if mode != "laminar":
            assert r.extra_rounds > 0, mode
    off = sim.Simulator(tiny(workload={"pass_rates": [0.0, 0.5, 1.0]}), "sync").run()
    assert off.dropped_groups == 0 and off.extra_rounds == 0
    capped = sim.Simulator(
        tiny(**{**base, "sched": {"dynamic_sampling": True, "max_sampling_rounds": 1}}), "sync"
    ).run()
    assert capped.extra_rounds == 0 and capped.trained_groups < 8 * 6  # one round: batches stay short


def test_flow_control_under_a_staleness_bound_cuts_regeneration(monkeypatch):
    """With ``max_staleness`` the simulator admits as the runtime does (``control.admission_room``,
    the trainer's batch included). On a long tail a few groups still go stale (a slow response can
    finish after newer, shorter ones have filled the batches its bound allows), but against the same
    run admitting whatever fits in the rollouts, regeneration falls to a fraction (9 vs 433 here)."""
    cfg = tiny(
        workload={"steps": 8, "lengths": {"median": 150, "p99_over_median": 12}}, sched={"max_staleness": 1}
    )
    r = sim.Simulator(cfg, "laminar").run()
    assert r.updates == 8 and max(int(k) for k in r.staleness_histogram) <= 1
    monkeypatch.setattr(control, "admission_room", lambda *a, **k: 10**9)
    unlimited = sim.Simulator(cfg, "laminar").run()
    assert unlimited.updates == 8 and unlimited.stale_dropped > 100
    assert r.stale_dropped * 10 < unlimited.stale_dropped


def test_repack_happens_and_is_counted():
    cfg = tiny(
        workload={"steps": 8, "lengths": {"median": 150, "p99_over_median": 15}},
        sched={"repack_interval_s": 0.2},
    )
    r = sim.Simulator(cfg, "laminar").run()
    assert r.repacks > 0
    kinds = {e["kind"] for e in r.timeline["events"]}
    assert {"repack_out", "repack_in", "pull"} <= kinds


def test_relays_keep_only_the_versions_in_flight_and_the_newest():
    s = sim.Simulator(tiny(sched={"keep_versions": 1}), "laminar")
    r = s.run()
    latest = r.updates
    in_flight = {x.version for x in s.m.rollouts.values() if x.active}
    assert latest in s.relays.at and set(s.relays.at) <= {latest} | in_flight
    assert len(s.relays.at) < latest + 1  # older versions were dropped along the way


def test_dispatch_plan_matches_the_modes():
    m = control.MODES
    kw = dict(active=3, queued=0, pending=False, awaiting=0)
    assert control.dispatch_plan(m["laminar"], version=0, latest=1, **kw) == control.DispatchPlan(
        False, -1, False, False
    )
    assert control.dispatch_plan(m["laminar"], version=0, latest=1, **{**kw, "active": 0}).pull
    # the turn rule: episodes parked between turns do not hold a laminar pull back; one decoding does
    assert control.dispatch_plan(m["laminar"], version=0, latest=1, **{**kw, "parked": 3}).pull
    assert not control.dispatch_plan(m["laminar"], version=0, latest=1, **{**kw, "parked": 2}).pull
    p = control.dispatch_plan(m["partial"], version=0, latest=1, **kw)
    assert p.pull and p.interrupt and p.admitting
    assert not control.dispatch_plan(m["sync"], version=0, latest=1, batch_min_version=1, **kw).pull
    assert control.dispatch_plan(
        m["sync"], version=0, latest=1, batch_min_version=1, **{**kw, "active": 0}
    ).pull
    assert control.dispatch_plan(m["one_step"], version=-1, latest=0, **kw).pull


def test_admit_lag_keeps_a_laminar_rollout_admitting_until_the_trainer_is_that_far_ahead():
    import dataclasses

    lag3 = dataclasses.replace(control.MODES["laminar"], admit_lag=3)
    kw = dict(active=3, queued=0, pending=False, awaiting=0)
    assert control.dispatch_plan(lag3, version=4, latest=6, **kw) == control.DispatchPlan(
        False, -1, False, True
    )
    assert not control.dispatch_plan(lag3, version=4, latest=7, **kw).admitting  # 3 behind: drain
    assert control.dispatch_plan(
        lag3, version=4, latest=6, **{**kw, "active": 0}
    ).pull  # empty: pull the latest


def test_admit_lag_raises_simulated_occupancy_with_no_staleness_bound():
    base = tiny(timeline_rollouts=0)
    one = sim.Simulator(base, "laminar").run()
    base.sched.admit_lag = 3
    three = sim.Simulator(base, "laminar").run()
    assert three.mean_occupancy > one.mean_occupancy
    assert max(int(k) for k in three.staleness_histogram) >= max(int(k) for k in one.staleness_histogram)


def test_timeline_plots_with_the_runtime_function(tmp_path):
    from evaluation.timeline import plot_timeline, summarize_timeline

    r = sim.Simulator(tiny(timeline_rollouts=3), "laminar").run()
    assert len(r.timeline["rollouts"]) == 3
    s = summarize_timeline(r.timeline)
    assert s["updates"] == 6 and set(s["rollouts"]) == set(r.timeline["rollouts"])
    assert plot_timeline(r.timeline, tmp_path / "t.png").stat().st_size > 1000


def test_calibrate_train_share_hits_the_share():
    cfg = tiny(cost={"train_gen_share": 0.8}, cluster={"colocate_sync": True})
    new, info = sim.calibrate_train_share(cfg)
    r = sim.Simulator(new, "sync").run()
    assert 0.7 < r.generation_share < 0.9, (r.generation_share, info)


def test_the_simulator_reads_the_conf_schema_with_its_presets():
    """One schema: the simulator takes ``conf.simulate.SimulateConfig`` as it is; ``model.preset``
    fills the architecture and the engine's tensor-parallel size (0 = the preset's)."""
    from conf.schema import ConfigError
    from conf.simulate import MODEL_PRESETS, apply_preset

    s = sim.Simulator(tiny(model={"preset": "qwen2.5-32b"}, cluster={"nodes": 2, "gpus_per_node": 8}), "sync")
    assert s.cfg.model.params_b == MODEL_PRESETS["qwen2.5-32b"]["params_b"] == 32.8
    assert s.cfg.cluster.gpus_per_engine == 4 and len(s.rollouts) == 4
    assert apply_preset(s.cfg) == s.cfg
    own = tiny(model={"preset": "", "name": "mine", "params_b": 1.0, "layers": 4})
    assert sim.Simulator(own, "sync").cfg.model == own.model
    with pytest.raises(ConfigError, match="sched.capcity"):
        tiny(sched={"capcity": 4})
    with pytest.raises(ConfigError, match="model.preset='qwen9'"):
        tiny(model={"preset": "qwen9"})


def test_config_errors_before_any_write(tmp_path):
    from flows.cli import main

    ws = tmp_path / "ws"
    assert main(["simulate", "cluster.nodse=2", "--workspace", str(ws)]) == 2
    assert main(["simulate", "model.preset=qwen9", "--workspace", str(ws)]) == 2
    assert main(["simulate", "modes=[sync,fast]", "--workspace", str(ws)]) == 2
    assert not ws.exists()


def test_cli_end_to_end(tmp_path, capsys):
    from flows.cli import main

    out = tmp_path / "sim"
    rc = main(
        [
            "simulate",
            "cluster.nodes=2",
            "cluster.gpus_per_node=4",
            "workload.prompts_per_step=8",
            "workload.group_size=4",
            "workload.steps=4",
            "workload.max_output=2048",
            "workload.lengths.median=200",
            "sched.capacity=16",
            "timeline_rollouts=4",
            "modes=[sync,laminar]",
            f"out={out}",
            "--workspace",
            str(tmp_path / "ws"),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "| laminar |" in text and "| sync |" in text and "laminar speedup over sync" in text
    summary = json.loads((out / "simulate.json").read_text())
    assert set(summary["modes"]) == {"sync", "laminar"}
    assert summary["calibration"]["train_gen_share"] == 0.83
    for mode in ("sync", "laminar"):
        assert (out / f"timeline_{mode}.png").stat().st_size > 1000
        m = summary["modes"][mode]
        assert m["updates"] == 4 and m["trained_groups"] == 32
        assert {"idle_share", "staleness_histogram", "repacks", "tokens_per_s"} <= set(m)


def test_back_pressure_bounds_what_is_issued():
    cfg = tiny(sched={"max_ahead_batches": 1}, cost={"mfu_train": 0.002})
    s = sim.Simulator(cfg, "laminar")
    r = s.run()
    n = cfg.workload.prompts_per_step
    # never more than one batch beyond the trainer, plus whole-group rounding per rollout
    assert s.queue.issued_groups <= (cfg.workload.steps + 1) * n + r.rollouts
    free = sim.Simulator(tiny(cost={"mfu_train": 0.002}), "laminar")
    free.run()
    assert free.queue.issued_groups > s.queue.issued_groups


def test_lengths_from_a_real_run(tmp_path):
    from conf.schema import ConfigError
    from conf.simulate import load_simulate_config
    from tasks.simulate import resolve

    run = tmp_path / "runtime.json"
    run.write_text(json.dumps({"response_lengths": [20, 30, 40, 230]}))
    cfg = resolve(
        load_simulate_config(["workload.lengths.kind=values", f"workload.lengths.values_file={run}"])
    )
    assert cfg.workload.lengths.values == [20, 30, 40, 230]
    sampler = sim.LengthSampler(cfg.workload.lengths, 320, 8, 0)
    assert set(sampler.group(0)) <= {20, 30, 40, 230}
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError):
        resolve(load_simulate_config(["workload.lengths.kind=values", f"workload.lengths.values_file={bad}"]))


@pytest.mark.parametrize("rule", ["turn", "episode"])
def test_tool_latency_slows_sync_more_than_laminar(rule):
    tool = {"name": "python", "calls": 2, "latency": {"kind": "codex_exec"}}
    plain = tiny(workload={"steps": 4})
    tools = tiny(workload={"steps": 4, "tools": [tool], "version_rule": rule})
    base = {m: sim.Simulator(plain, m).run() for m in ("sync", "laminar")}
    slow = {m: sim.Simulator(tools, m).run() for m in ("sync", "laminar")}
    # the waits add time, never tokens (sync trains the same groups either way)
    assert slow["sync"].trained_tokens == base["sync"].trained_tokens
    assert slow["sync"].wall_s > base["sync"].wall_s
    ratio = lambda r: r["laminar"].steady_tokens_per_s / r["sync"].steady_tokens_per_s  # noqa: E731
    assert ratio(slow) > ratio(base)
    with pytest.raises(Exception, match=r"workload.tools\[0\].latency"):
        tiny(workload={"tools": [{**tool, "latency": {"kind": "fixed"}}]})


# ---------------------------------------------------------------------------- the turn version rule
FAST_TRAINER = {"train_s_per_token": 1e-6, "train_step_overhead_s": 0.05}
"""A trainer much faster than generation: throughput is the rollouts' (else every continuous mode
waits on the trainer alike)."""


def tool_workload(rule: str, latency: dict, calls: int = 1, **workload) -> SimulateConfig:
    """Short responses (median 30 tokens, the tool benchmark's) with ``calls`` tool calls each."""
    tool = {"name": "python", "calls": calls, "latency": latency}
    wl = {"tools": [tool], "version_rule": rule, "lengths": {"median": 30, "p99_over_median": 3}}
    return tiny(workload={**wl, **workload}, cost=FAST_TRAINER)


def watch(s: sim.Simulator) -> dict:
    """Record, at every pull, the episodes between turns and the rows decoding on the rollout, and
    every finished trajectory."""
    seen: dict = {"pulls": [], "trajectories": []}
    start_pull, collect = s.engines.start_pull, s.engines.collect

    def on_pull(r, version, wait, cost):
        seen["pulls"].append((r.eversion, len(r.parked) + len(r.ready), len(r.rows)))
        return start_pull(r, version, wait, cost)

    def on_collect(r):
        finished, pulled = collect(r)
        seen["trajectories"] += [t for t, _ in finished]
        return finished, pulled

    s.engines.start_pull, s.engines.collect = on_pull, on_collect
    return seen


def test_turn_rule_lets_laminar_pull_while_episodes_wait_on_tools():
    """Under the turn rule a laminar rollout pulls as soon as its decoding turns end, while its
    episodes wait on a 20 s tool call (the next turns run under the new weights); under the episode
    rule every pull waits until no episode is in flight, so none spans two versions."""
    fixed = {"kind": "fixed", "seconds": [20.0]}
    turn = sim.Simulator(tool_workload("turn", fixed), "laminar")
    seen_t = watch(turn)
    rt = turn.run()
    episode = sim.Simulator(tool_workload("episode", fixed), "laminar")
    seen_e = watch(episode)
    re = episode.run()
    # turn: pulls with episodes parked and no row decoding; their trajectories span versions
    parked_pulls = [p for p in seen_t["pulls"] if p[0] >= 0 and p[1] > 0]
    assert parked_pulls and all(rows == 0 for _, _, rows in parked_pulls)
    assert any(t.last_version > t.version for t in seen_t["trajectories"])
    # episode: a pull only on an empty rollout; every trajectory under one version
    assert all(between == 0 and rows == 0 for v, between, rows in seen_e["pulls"] if v >= 0)
    assert all(t.last_version == t.version for t in seen_e["trajectories"])
    # both still train every batch, each group once; turn's pulls do not wait out the tool calls
    for r in (rt, re):
        assert r.updates == 6 and len(r.trained_uids) == len(set(r.trained_uids)) == 6 * 8
    assert rt.wall_s < re.wall_s


def test_turn_rule_beats_the_episode_rule_for_laminar_on_a_long_tail():
    """codex_exec latency with its tail doubled: the episode rule pins a draining rollout on its
    slowest tool call; the turn rule pulls and admits under the new weights meanwhile."""
    codex = {"kind": "codex_exec", "tail_scale": 2.0}
    res = {
        rule: sim.Simulator(tool_workload(rule, codex, steps=12), "laminar").run()
        for rule in ("turn", "episode")
    }
    assert res["turn"].steady_tokens_per_s > 1.2 * res["episode"].steady_tokens_per_s
    assert res["turn"].pulls > res["episode"].pulls


@pytest.mark.parametrize("mode", sorted(sim.SIM_MODES))
def test_turn_rule_deterministic_and_conserving(mode):
    """Two tool calls per episode, a long-tailed latency: every mode trains every group exactly once,
    and the same config gives the same run."""
    cfg = tool_workload("turn", {"kind": "codex_exec", "tail_scale": 2.0}, calls=2, steps=5)
    a, b = sim.Simulator(cfg, mode).run(), sim.Simulator(cfg, mode).run()
    assert a.summary() == b.summary() and a.timeline == b.timeline
    assert a.trained_uids == b.trained_uids
    n = cfg.workload.steps * cfg.workload.prompts_per_step
    assert len(a.trained_uids) == len(set(a.trained_uids)) == n and a.updates == cfg.workload.steps
    assert sum(a.staleness_histogram.values()) == a.trained_groups


def test_turn_rule_repack_hands_parked_episodes_over_as_any_version():
    """A laminar repack moves episodes waiting on their tools too, as partials of version -1 with the
    latency they still wait; the receiver (of whatever version) continues them, none is lost."""
    cfg = tool_workload(
        "turn",
        {"kind": "codex_exec", "tail_scale": 2.0},
        steps=10,
        lengths={"median": 150, "p99_over_median": 15},
    )
    cfg.sched.repack_interval_s = 0.2
    s = sim.Simulator(cfg, "laminar")
    handed: list = []
    extract_done = s.m.extract_done

    def spy(name, partials, queued, status):
        handed.extend(partials)
        return extract_done(name, partials, queued, status)

    s.m.extract_done = spy
    r = s.run()
    assert r.repacks > 0 and any(p.version == -1 for p in handed)
    assert len(r.trained_uids) == len(set(r.trained_uids)) == 10 * 8


def test_version_rule_is_checked():
    from conf.schema import ConfigError

    with pytest.raises(ConfigError, match="workload.version_rule='turns'"):
        tiny(workload={"version_rule": "turns"})
