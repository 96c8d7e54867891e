"""One trainer rank in a spawned process (the trainer-backend tests start several of them)."""

from __future__ import annotations

import os

import torch


def random_groups(tok, n_groups: int = 4, group_size: int = 4, seed: int = 0):
    """Scored groups of random responses of mixed lengths (2 to 17 tokens), half rewarded."""
    from generation.model import encode_problem
    from generation.records import PromptItem, ScoredGroup, Trajectory

    p = PromptItem("p", "1+2", "3", encode_problem(tok, "{problem}\n", "1+2"), 1)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(n_groups):
        trajs = []
        for i in range(group_size):
            n = [2, 3, 9, 17][(g + i) % 4]
            toks = tuple(int(x) for x in torch.randint(5, 40, (n,), generator=gen))
            trajs.append(
                Trajectory(
                    "trajectory",
                    p,
                    i,
                    toks,
                    tuple(float(-x) for x in torch.rand(n, generator=gen)),
                    0,
                    i != 3,
                    "3" if i % 2 else "4",
                )
            )
        groups.append(
            ScoredGroup(
                "scored_group",
                f"p{g}",
                tuple(trajs),
                tuple(float(i % 2) for i in range(group_size)),
                tuple(bool(i % 2) for i in range(group_size)),
            )
        )
    return groups


TRAIN_KW = dict(
    lr=1e-3,
    weight_decay=0.0,
    max_grad_norm=100.0,
    temperature=1.0,
    max_new_tokens=20,
    device="cpu",
    micro_batch_tokens=40,
)


def lora_micro_model(tok):
    """The micro model with rank-4 LoRA adapters (peft) on a frozen base, lora_B seeded non-zero."""
    from conf.schema import LoraConfig
    from peft import get_peft_model

    from rl_fakes import MICRO
    from generation.model import build_tiny_model
    from training.lora import peft_config

    torch.manual_seed(0)
    model = get_peft_model(
        build_tiny_model(MICRO, tok, seed=0), peft_config(LoraConfig(enabled=True, rank=4))
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def run_rank(
    rank: int,
    world: int,
    port: int,
    backend: str,
    stage: int,
    updates: int,
    out_dir: str,
    lora: bool = False,
    preset: str = "grpo",
) -> None:
    """Build the micro model (``lora``: with LoRA adapters), join the group, take ``updates`` updates of
    ``preset``; rank 0 writes losses, grad norms (and value losses with a critic) and the final
    published weights (safetensors + JSON) to ``out_dir``."""
    import json

    from safetensors.numpy import save_file

    from rl_fakes import MICRO
    from generation.model import build_char_tokenizer, build_tiny_model
    from training.objectives import PRESETS
    from training.rl.trainer import DeepSpeedPolicyTrainer, PolicyTrainer, init_distributed

    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(out_dir, "ext")
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = lora_micro_model(tok) if lora else build_tiny_model(MICRO, tok, seed=0)
    init_distributed("gloo", rank, world, "127.0.0.1", port, deepspeed_comm=backend == "deepspeed")
    kw = dict(TRAIN_KW, pad_id=tok.pad_token_id, rank=rank, world_size=world)
    if backend == "deepspeed":
        trainer = DeepSpeedPolicyTrainer(
            model, PRESETS[preset], ds_config={"zero_optimization": {"stage": stage}}, **kw
        )
    else:
        trainer = PolicyTrainer(model, PRESETS[preset], **kw)
    stats = [trainer.update(random_groups(tok, seed=s)) for s in range(updates)]
    state = trainer.full_state()
    if rank == 0:
        save_file(state, os.path.join(out_dir, "weights.safetensors"))
        with open(os.path.join(out_dir, "stats.json"), "w") as f:
            rows = [
                {"loss": s.loss, "grad_norm": s.grad_norm, "version": s.version, **s.metrics} for s in stats
            ]
            json.dump(rows, f)
    # leave together, with the process group torn down: a rank exiting while gloo's threads still run
    # aborts ("terminate called without an active exception")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
