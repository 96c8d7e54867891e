"""The test that would have caught verl's asynchronous LoRA bug (its issue 7495: the adapter never
reached the rollouts): on the Laminar runtime's real Ray actors, after each LoRA update in every mode
(sync, one_step, partial, laminar), the log-probs each rollout computes for a fixed sequence equal
the trainer's for the version the rollout says it holds. Negative control: a trainer whose publish
drops the adapter tensors (the version still moves) fails the same check."""

from __future__ import annotations

import sys

import pytest

from conf.schema import ClusterConfig, RLConfig
from generation.model import encode_problem, load_model
from generation.records import PromptItem
from tests.training.lora_probe import (
    EvenLengthVerifier,
    check_rollouts_match,
    probe_tokens,
    versions_differ,
    write_base_and_adapter,
)
from training.objectives import PRESETS
from training.rl.sections import RLSections

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_base_and_adapter(tmp_path_factory.mktemp("lora-rt"))


def probe_run(adapter_dir, mode: str, *, steps: int = 3, rollouts: int = 1):
    """A short LoRA run of ``mode``; after every update, the trainer's probe log-probs (by version)
    and every rollout's (with the version it holds)."""
    from generation.adapter import sequence_logprobs
    from training.rl.drivers.ray import LaminarRuntime

    model, tok = load_model(adapter_dir)  # PEFT's own merge of the starting adapter: version 0
    seq = probe_tokens(tok)
    trainer_lp: dict[int, list[float]] = {0: sequence_logprobs(model, seq)}
    seen: list[tuple[str, int, list[float]]] = []
    prompts = [
        PromptItem(
            f"p{i}",
            f"{i % 7}+{i % 5}",
            str(i % 7 + i % 5),
            encode_problem(tok, "{problem}=", f"{i % 7}+{i % 5}"),
            1,
        )
        for i in range(64)
    ]
    rl = RLConfig(
        mode=mode,
        steps=steps,
        prompts_per_step=2,
        group_size=4,
        lr=2e-2,
        max_new_tokens=8,
        rollout_capacity=8,
        chunk_steps=2,
        max_staleness=2,
        admit_lag=1,
        repack_interval_s=0.2,
        checkpoint_every=0,
        eval_every=0,
        micro_batch_tokens=0,
    )
    rt = None

    def on_step(_m):
        v, lp = ray.get(rt.trainer.lead.score.remote(seq))
        trainer_lp[v] = lp
        for name, a in rt.rollouts.items():
            rv, rlp = ray.get(a.handle.score.remote(seq))
            if rv >= 0:
                seen.append((name, rv, rlp))

    rt = LaminarRuntime(
        adapter_dir,
        prompts,
        EvenLengthVerifier(),
        PRESETS["grpo"],
        RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=rollouts, rollout_priority="normal")),
        device="cpu",
        on_step=on_step,
    )
    rt.run()
    return trainer_lp, seen, rt


# laminar (two rollouts, relays) runs in `make test`; the other modes (about 20 s each here, mostly actor
# start-up) in `make test-slow`, beside the in-process sync check in test_lora.py
@pytest.mark.parametrize(
    "mode,rollouts",
    [
        pytest.param("sync", 1, marks=pytest.mark.slow),
        pytest.param("one_step", 1, marks=pytest.mark.slow),
        pytest.param("partial", 1, marks=pytest.mark.slow),
        ("laminar", 2),
    ],
)
def test_rollouts_hold_the_trainers_weights_for_their_version_after_each_lora_update(
    local_ray, dirs, mode, rollouts
):
    trainer_lp, seen, rt = probe_run(dirs[1], mode, rollouts=rollouts)
    versions_differ(trainer_lp)  # each update moves the probe: a stale rollout cannot pass by chance
    assert sorted(trainer_lp) == [0, 1, 2, 3]
    assert check_rollouts_match(trainer_lp, seen) >= 1, f"{mode}: no rollout ever held an updated adapter"
    assert rt.final_state is not None and all("lora_" in k for k in rt.final_state if not k.startswith("__"))


def test_negative_control_a_trainer_that_drops_the_adapter_fails_the_check(local_ray, dirs, monkeypatch):
    import training.rl.actors as actors
    from generation.adapter import SCALING_KEY

    class DroppingTrainer(actors.TrainerWorker):
        """verl's bug on purpose: the version moves, the adapter tensors never leave the trainer."""

        def _gathered_state(self):
            state = super()._gathered_state()
            return None if state is None else {k: v for k, v in state.items() if k == SCALING_KEY}

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor process gets the subclass
    try:
        monkeypatch.setattr(actors, "TrainerWorker", DroppingTrainer)
        trainer_lp, seen, _ = probe_run(dirs[1], "laminar", steps=2)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    with pytest.raises(AssertionError, match="says it holds version"):
        check_rollouts_match(trainer_lp, seen)
