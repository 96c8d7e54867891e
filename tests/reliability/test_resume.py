"""Every mode resumes: the local driver checkpoints and a killed run goes on exactly as the unkilled
one (deterministic on the CPU), HIVE's online state included; the Ray driver's checkpoint (the same
record) holds HIVE's state too, so a resumed HIVE run draws the prompts the checkpoint records."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conf.schema import RLConfig
from data_curation.hive import GresoFilter
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import PromptItem
from tests.training.rl_fakes import MICRO, Verdict, saved_model
from training.objectives import PRESETS
from training.rl.checkpoint import RUN_STATE, latest_checkpoint, list_checkpoints, load_json
from training.rl.drivers.local import LocalDriver
from training.rl.loop import HiveSource, PromptCursor
from training.rl.stage import TIMING_KEYS
from training.rl.sections import RLSections


class HalfRight:
    """Right when the response starts with a digit that has the prompt's parity: groups vary."""

    def verify_batch(self, responses, golds):
        return [Verdict(r[:1].isdigit() and int(r[0]) % 2 == int(g) % 2) for r, g in zip(responses, golds)]


def prompts(tok, n=48):
    return [
        PromptItem(
            f"p{i}", f"What is {i}+{i % 3}?", str(i % 2), encode_prompt(tok, f"What is {i}+{i % 3}?\n"), 1
        )
        for i in range(n)
    ]


class Killed(Exception):
    pass


def run(tmp_path, *, kill_at=None, hive=True, ckpt="ckpt", steps=7, params=PRESETS["grpo"], keep=None):
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(MICRO, tok, seed=0)
    rl = RLConfig(
        steps=steps,
        prompts_per_step=4,
        group_size=4,
        lr=1e-2,
        max_new_tokens=3,
        micro_batch_tokens=0,
        checkpoint_every=2,
        eval_every=3,
    )
    source = (
        (lambda cursor, engine: HiveSource(cursor, engine, greso=GresoFilter(None), seed=0)) if hive else None
    )

    def on_step(m):
        if kill_at is not None and m.step == kill_at:
            raise Killed(kill_at)

    def evaluate(m):  # an in-run evaluation that depends on the weights
        return {"eval_probe": float(sum(p.detach().double().abs().sum() for p in m.parameters()))}

    driver = LocalDriver(
        saved_model(tmp_path / f"model-{ckpt}", model, tok),
        prompts(tok),
        HalfRight(),
        params,
        RLSections(rl, seed=0),
        device="cpu",
        source=source,
        evaluate=evaluate,
        on_step=on_step,
        state_dir=tmp_path / ckpt,
    )
    result = driver.run()
    if keep is not None:
        keep["trainer"] = driver.trainer
    return result, {k: v.clone() for k, v in driver.final_model.state_dict().items()}


def test_ppo_killed_midway_resumes_with_its_critic_and_ends_identical(tmp_path):
    """The critic's weights and optimizer are in the checkpoint: a killed PPO run (value pre-training
    across the kill, an entropy bonus adapting) resumes and ends exactly as the unkilled one."""
    params = dataclasses.replace(PRESETS["ppo"], value_warmup_steps=5, entropy_coef=0.01, entropy_target=9.0)
    whole_keep, killed_keep = {}, {}
    whole, w_whole = run(tmp_path, hive=False, ckpt="whole", params=params, keep=whole_keep)
    with pytest.raises(Killed):
        run(tmp_path, kill_at=5, hive=False, ckpt="killed", params=params)
    last = latest_checkpoint(tmp_path / "killed" / "checkpoints")
    assert last.name == "step-000004" and (last / "critic.safetensors").exists()
    assert (last / "critic_optimizer.safetensors").exists()
    resumed, w_resumed = run(tmp_path, hive=False, ckpt="killed", params=params, keep=killed_keep)
    assert [m.extra["value_loss"] for m in resumed.history] == [m.extra["value_loss"] for m in whole.history]
    assert all(torch.equal(w_whole[k], w_resumed[k]) for k in w_whole)
    a, b = whole_keep["trainer"], killed_keep["trainer"]
    ca, cb = a.critic.state_dict(), b.critic.state_dict()
    assert all(torch.equal(ca[k], cb[k]) for k in ca)
    assert a.entropy_coef == b.entropy_coef


@pytest.mark.parametrize("hive", [True, False])
def test_sync_mode_killed_midway_resumes_where_it_stopped_and_ends_identical(tmp_path, hive):
    whole, w_whole = run(tmp_path, hive=hive, ckpt="whole")
    with pytest.raises(Killed):
        run(tmp_path, kill_at=5, hive=hive, ckpt="killed")  # dies after step 5: the last checkpoint is step 4
    last = latest_checkpoint(tmp_path / "killed" / "checkpoints")
    assert last is not None and last.name == "step-000004"
    state = load_json(last, RUN_STATE)
    assert state["version"] == 4 and state["mode"] == "sync" and len(state["history"]) == 4
    if hive:  # HIVE's online state is in the checkpoint
        assert state["source"]["greso"]["observed"] and "rng" in state["source"]
    resumed, w_resumed = run(tmp_path, hive=hive, ckpt="killed")
    assert len(resumed.history) == 7

    def untimed(history):
        return json.dumps(
            [{k: v for k, v in m.as_dict().items() if k not in TIMING_KEYS} for m in history], sort_keys=True
        )

    assert untimed(resumed.history) == untimed(whole.history)  # what history.jsonl keeps, to the bit
    assert resumed.rewards == whole.rewards and resumed.consumed == whole.consumed
    assert all(torch.equal(w_whole[k], w_resumed[k]) for k in w_whole)
    assert [c.name for c in list_checkpoints(tmp_path / "whole" / "checkpoints")] == [
        "step-000004",
        "step-000006",
    ]


def test_hive_source_state_round_trips_to_the_same_prompts():
    from generation.engine import Engine

    tok = build_char_tokenizer()
    engine = Engine(build_tiny_model(MICRO, tok, seed=0), tok)
    items = prompts(tok, 64)
    greso = GresoFilter(None)
    a = HiveSource(PromptCursor(items, 0), engine, greso=greso, seed=0)
    a.take(5)
    for i in range(0, 64, 3):
        greso.observe(f"p{i}", 1.0)
    greso.end_step(0.5, 0.0)
    state = json.loads(json.dumps(a.state()))  # through JSON, as a checkpoint stores it
    b = HiveSource(PromptCursor(items, 0), engine, greso=GresoFilter(None), seed=0)
    b.load_state(state)
    assert [p.prompt_id for p in b.take(12)] == [p.prompt_id for p in a.take(12)]
    assert b.greso.p_easy == a.greso.p_easy and b.step_counts() == a.step_counts()


@pytest.mark.slow
def test_a_hive_laminar_run_killed_after_a_checkpoint_draws_the_prompts_it_records(tmp_path):
    """The Ray runtime's checkpoint holds HIVE's online state: after the trainer is SIGKILLed, the
    resumed run trains the checkpoint's groups under their prompts and issues new groups in the
    order of the prompts HIVE had filtered and buffered when the checkpoint was written."""
    import os
    import signal

    ray = pytest.importorskip("ray")
    from conf.schema import ClusterConfig
    from generation.model import save_model
    from training.rl.drivers.ray import LaminarRuntime

    tok = build_char_tokenizer()
    model_dir = tmp_path / "model"
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, model_dir)
    items = prompts(tok, 200)
    rl = RLConfig(
        mode="laminar",
        steps=8,
        prompts_per_step=4,
        group_size=4,
        lr=1e-3,
        max_new_tokens=8,
        rollout_capacity=16,
        chunk_steps=4,
        repack_interval_s=0.2,
        checkpoint_every=2,
        eval_every=0,
        micro_batch_tokens=0,
        max_staleness=4,
    )

    def runtime(on_step=None):
        return LaminarRuntime(
            model_dir,
            items,
            HalfRight(),
            PRESETS["grpo"],
            RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=2)),
            device="cpu",
            state_dir=tmp_path / "state",
            on_step=on_step,
            source=lambda cursor, engine: HiveSource(cursor, engine, greso=GresoFilter(None), seed=0),
        )

    def kill_trainer(m):
        if m.step == 5:
            os.kill(ray.get(rt.trainer.lead.ping.remote()).pid, signal.SIGKILL)

    rt = runtime(kill_trainer)
    with pytest.raises(ray.exceptions.RayActorError):
        rt.run()
    last = latest_checkpoint(tmp_path / "state" / "checkpoints")
    assert last is not None and last.name == "step-000004"
    saved = load_json(last, RUN_STATE)
    hive = saved["source"]
    assert hive["greso"]["observed"] and hive["cursor"]["position"] > 0
    rt2 = runtime()
    rt2.run()
    assert rt2.summary.get("resumed") == 1 and rt2.summary["updates"] == 8
    by_uid = dict(rt2.summary["trained_prompts"])
    recorded = {q["group_uid"]: q["prompt"]["prompt_id"] for q in saved["in_flight"]}
    recorded.update(
        {
            t["group_uid"]: t["prompt"]["prompt_id"]
            for t in saved["buffer"]["partial"] + saved["buffer"]["ready"]
        }
    )
    assert all(
        by_uid[u] == p for u, p in recorded.items() if u in by_uid
    )  # the checkpoint's groups keep their prompts
    first_new = saved["queue"]["next_uid"]
    buffered = [p["prompt_id"] for p in hive["buffer"]]
    new = [
        (u - first_new, p) for u, p in sorted(by_uid.items()) if first_new <= u < first_new + len(buffered)
    ]
    assert new and all(buffered[i] == p for i, p in new)  # new groups draw HIVE's buffered prompts, in order


# both backends in the slow suite (Ray, ~70 s under load): make test keeps the trainer-level PPO resume
# (test_ppo_killed_midway_resumes_with_its_critic_and_ends_identical) and the laminar HIVE resume above
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_a_ppo_laminar_run_killed_after_a_checkpoint_resumes_its_critic(tmp_path, backend):
    """PPO on the Ray runtime (``rl.mode=laminar``; torch or DeepSpeed ZeRO-2 trainer): the trainer is
    SIGKILLed after step 5, the rerun resumes from step 4 and runs to the end, and its critic's
    optimizer continues from the checkpoint's (AdamW's step count at the next checkpoint is 6, not
    the 2 a fresh critic would have)."""
    import os
    import signal

    ray = pytest.importorskip("ray")
    from safetensors.torch import load_file

    from conf.schema import ClusterConfig, TrainerConfig
    from generation.model import save_model
    from training.rl.drivers.ray import LaminarRuntime

    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    tok = build_char_tokenizer()
    model_dir = tmp_path / "model"
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, model_dir)
    rl = RLConfig(
        mode="laminar",
        algorithm="ppo",
        steps=8,
        prompts_per_step=4,
        group_size=4,
        lr=1e-3,
        max_new_tokens=8,
        rollout_capacity=16,
        chunk_steps=4,
        checkpoint_every=2,
        eval_every=0,
        micro_batch_tokens=0,
        max_staleness=4,
    )

    def runtime(on_step=None):
        return LaminarRuntime(
            model_dir,
            prompts(tok, 200),
            HalfRight(),
            PRESETS["ppo"],
            RLSections(rl, seed=0, trainer=TrainerConfig(backend=backend), cluster=ClusterConfig(rollouts=1)),
            device="cpu",
            state_dir=tmp_path / "state",
            on_step=on_step,
        )

    def kill_trainer(m):
        if m.step == 5:
            os.kill(ray.get(rt.trainer.lead.ping.remote()).pid, signal.SIGKILL)

    rt = runtime(kill_trainer)
    with pytest.raises(ray.exceptions.RayActorError):
        rt.run()
    ckpts = tmp_path / "state" / "checkpoints"
    assert latest_checkpoint(ckpts).name == "step-000004"

    def critic_steps(ckpt):
        state = load_file(str(ckpt / "critic_optimizer.safetensors"))
        return {float(v) for k, v in state.items() if k.endswith(".step")}

    assert critic_steps(latest_checkpoint(ckpts)) == {4.0}
    rt2 = runtime()
    result = rt2.run()
    assert rt2.summary.get("resumed") == 1 and rt2.summary["updates"] == 8
    assert critic_steps(latest_checkpoint(ckpts)) == {6.0}
    assert all("value_loss" in m.extra for m in result.history) and len(result.history) == 8
