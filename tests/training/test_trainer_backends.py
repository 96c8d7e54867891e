"""Trainer backends: DeepSpeed ZeRO (CPU, gloo) and data-parallel ranks give the same updates as
one torch rank, because each rank's loss weight is its share of the whole batch."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
import torch.multiprocessing as mp
from dist_worker import TRAIN_KW, lora_micro_model, random_groups, run_rank
from rl_fakes import MICRO
from safetensors.numpy import load_file

from generation.model import build_char_tokenizer, build_tiny_model
from training.objectives import PRESETS
from training.rl.trainer import PolicyTrainer, deepspeed_config

UPDATES = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(lora: bool = False, preset: str = "grpo"):
    tok = build_char_tokenizer()
    model = lora_micro_model(tok) if lora else build_tiny_model(MICRO, tok, seed=0)
    trainer = PolicyTrainer(model, PRESETS[preset], pad_id=tok.pad_token_id, **TRAIN_KW)
    stats = [trainer.update(random_groups(tok, seed=s)) for s in range(UPDATES)]
    return stats, trainer.full_state()


def _spawn(
    world: int, backend: str, stage: int, tmp_path, lora: bool = False, preset: str = "grpo"
) -> tuple[list[dict], dict]:
    mp.start_processes(
        run_rank,
        args=(world, _free_port(), backend, stage, UPDATES, str(tmp_path), lora, preset),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return json.loads((tmp_path / "stats.json").read_text()), load_file(str(tmp_path / "weights.safetensors"))


def _assert_same(stats, state, ref_stats, ref_state):
    for got, want in zip(stats, ref_stats):
        assert got["loss"] == pytest.approx(want.loss, rel=1e-4, abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-4)
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():  # two AdamW steps of lr 1e-3 from the same start
        np.testing.assert_allclose(state[k], v, atol=2e-5, err_msg=k)


def test_deepspeed_config_sets_what_the_trainer_owns():
    cfg = deepspeed_config(
        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, "_comment": "x"},
        max_grad_norm=0.5,
        world_size=4,
        device="cpu",
    )
    assert (
        cfg["gradient_clipping"] == 0.5 and cfg["train_batch_size"] == 4 and cfg["bf16"] == {"enabled": False}
    )
    assert "_comment" not in cfg and cfg["gradient_accumulation_steps"] == 1


@pytest.mark.parametrize("world,backend,stage", [(2, "torch", 0), (1, "deepspeed", 2)])
def test_backend_matches_one_torch_rank(world, backend, stage, tmp_path):
    ref_stats, ref_state = _reference()
    stats, state = _spawn(world, backend, stage, tmp_path)
    _assert_same(stats, state, ref_stats, ref_state)


@pytest.mark.parametrize("world,backend,stage", [(2, "torch", 0), (1, "deepspeed", 2)])
def test_lora_backend_matches_one_torch_rank_and_trains_only_the_adapter(world, backend, stage, tmp_path):
    """LoRA on a frozen base: two data-parallel torch ranks and DeepSpeed ZeRO-2 (optimizer over the
    adapters only) take the same updates as one torch rank, and publish the adapter tensors only."""
    from generation.adapter import SCALING_KEY

    ref_stats, ref_state = _reference(lora=True)
    assert SCALING_KEY in ref_state and all("lora_" in k for k in ref_state if k != SCALING_KEY)
    stats, state = _spawn(world, backend, stage, tmp_path, lora=True)
    _assert_same(stats, state, ref_stats, ref_state)
    start = {k: v.detach().numpy() for k, v in lora_micro_model(build_char_tokenizer()).named_parameters()}
    moved = [k for k in ref_state if "lora_B" in k]
    assert moved and any(
        not np.allclose(ref_state[k], start[k.replace(".weight", ".default.weight")]) for k in moved
    )


@pytest.mark.parametrize("world,backend,stage,lora", [(2, "torch", 0, False), (1, "deepspeed", 2, True)])
def test_ppo_with_its_critic_matches_one_torch_rank(world, backend, stage, lora, tmp_path):
    """The critic is replicated on every rank and trained on the whole batch there: data-parallel
    ranks and DeepSpeed ZeRO (LoRA policy) take the same policy and value updates as one torch rank."""
    ref_stats, ref_state = _reference(lora=lora, preset="ppo")
    stats, state = _spawn(world, backend, stage, tmp_path, lora=lora, preset="ppo")
    _assert_same(stats, state, ref_stats, ref_state)
    for got, want in zip(stats, ref_stats):
        assert got["value_loss"] == pytest.approx(want.metrics["value_loss"], rel=1e-4)
        assert got["explained_variance"] == pytest.approx(want.metrics["explained_variance"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_deepspeed_ranks_match_one_torch_rank(stage, tmp_path):
    ref_stats, ref_state = _reference()
    stats, state = _spawn(2, "deepspeed", stage, tmp_path)
    _assert_same(stats, state, ref_stats, ref_state)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_lora_under_zero3_matches_one_torch_rank(world, tmp_path):
    """ZeRO-3 partitions the frozen base and the adapters alike; the adapters' updates and the
    published adapter tensors still equal one torch rank's."""
    ref_stats, ref_state = _reference(lora=True)
    stats, state = _spawn(world, "deepspeed", 3, tmp_path, lora=True)
    _assert_same(stats, state, ref_stats, ref_state)
