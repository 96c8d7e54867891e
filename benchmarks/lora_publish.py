"""LoRA vs full weights through the publish path, on the CPU: bytes per publish, the trainer's stall
per publish (``PolicyTrainer.publish`` + the ``ray.put`` the trainer actor does), what a rollout
spends applying a version (full ``load_state`` vs merging the adapter into its base), and the
rollout's decode speed with the adapter merged vs run unmerged (PEFT's LoRA layers in the forward).

    .venv/bin/python benchmarks/lora_publish.py                       # tiny default + the 0.5B shape
    .venv/bin/python benchmarks/lora_publish.py --models tiny --no-ray

Models: the default tiny model (``conf/schema.py`` ModelConfig) and a random Qwen2.5-0.5B-shaped
Llama (``benchmarks/gpu_check.py`` QWEN05_SHAPE: hidden 896, 24 layers, vocab 151,936, tied
embeddings), float32. LoRA: rank 16, alpha 32, every linear layer of the blocks (the config's
default). Writes ``benchmarks/results/lora/lora_publish_<date>.json``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf.schema import EngineOptions, LoraConfig, ModelConfig
from generation.adapter import merge_adapter
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model
from generation.records import GenRequest, PromptItem
from training.lora import peft_config
from training.objectives import PRESETS
from training.rl.trainer import PolicyTrainer

QWEN05_SHAPE = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


class _Tok:
    """What the engine needs of a tokenizer for a random model: no EOS (rows decode the full length)."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def build(name: str):
    if name == "tiny":
        tok = build_char_tokenizer()
        return build_tiny_model(ModelConfig(), tok, seed=0).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(**QWEN05_SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ).eval()


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _trainer(model) -> PolicyTrainer:
    return PolicyTrainer(
        model,
        PRESETS["grpo"],
        lr=1e-4,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        max_new_tokens=8,
        pad_id=0,
        device="cpu",
    )


def publish_costs(trainer: PolicyTrainer, repeats: int, ray) -> dict:
    state = trainer.publish().state
    out = {
        "bytes": int(sum(a.nbytes for a in state.values())),
        "tensors": len(state),
        "publish_ms": 1000 * _median_s(trainer.publish, repeats),
    }
    if ray is not None:  # the trainer actor's stall: host arrays + one ray.put
        out["publish_put_ms"] = 1000 * _median_s(lambda: ray.put(trainer.publish().state), repeats)
    return out


def decode_tok_s(model, vocab: int, batch: int, new_tokens: int, repeats: int) -> float:
    """Tokens/s of the built-in engine decoding ``batch`` rows of ``new_tokens`` (prompts of 16 tokens)."""
    g = torch.Generator().manual_seed(0)
    prompts = [
        PromptItem(f"p{i}", "", "", tuple(torch.randint(3, vocab, (16,), generator=g).tolist()))
        for i in range(batch)
    ]

    def run():
        eng = Engine(model, _Tok(), EngineOptions(capacity=batch, max_new_tokens=new_tokens, seed=0))
        eng.submit([GenRequest(p, 0) for p in prompts])
        done = 0
        while done < batch:
            done += len(eng.step(new_tokens))

    run()  # warm-up
    return batch * new_tokens / _median_s(run, repeats)


def measure(name: str, args, ray) -> dict:
    from peft import get_peft_model

    lora = LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank)
    t0 = time.perf_counter()
    model = build(name)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    row: dict = {
        "model": name,
        "parameters": n_params,
        "rank": args.rank,
        "target_modules": list(lora.target_modules),
    }
    # full weights: the trainer publishes every tensor; a rollout loads every tensor
    rollout = copy.deepcopy(model)
    row["full"] = publish_costs(_trainer(model), args.repeats, ray)
    full_state = _trainer(model).publish().state
    eng = Engine(rollout, _Tok(), EngineOptions(capacity=1, max_new_tokens=1))
    row["full"]["apply_ms"] = 1000 * _median_s(functools.partial(eng.load_state, full_state, 1), args.repeats)
    del full_state
    # LoRA: the trainer publishes the adapter tensors; a rollout merges them into its copy of the base
    torch.manual_seed(0)
    peft_model = get_peft_model(model, peft_config(lora))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)  # a trained adapter (B = 0 only at the start)
    trainer = _trainer(peft_model)
    row["trainable_parameters"] = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    row["lora"] = publish_costs(trainer, args.repeats, ray)
    adapter = trainer.publish().state
    row["lora"]["apply_ms"] = 1000 * _median_s(lambda: eng.load_state(adapter, 2), args.repeats)
    row["bytes_ratio"] = row["full"]["bytes"] / row["lora"]["bytes"]
    key = "publish_put_ms" if ray is not None else "publish_ms"
    row["stall_ratio"] = row["full"][key] / max(row["lora"][key], 1e-9)
    # decode: adapter merged into the rollout's base vs PEFT's unmerged LoRA layers in every forward
    batch, steps = (args.decode_batch, args.decode_tokens) if name == "tiny" else (4, 8)
    merge_adapter(rollout, adapter)
    peft_model.eval()
    row["decode"] = {
        "batch": batch,
        "new_tokens": steps,
        "merged_tok_s": decode_tok_s(rollout, vocab, batch, steps, args.repeats),
        "unmerged_tok_s": decode_tok_s(peft_model, vocab, batch, steps, args.repeats),
    }
    row["decode"]["merged_vs_unmerged"] = row["decode"]["merged_tok_s"] / row["decode"]["unmerged_tok_s"]
    row["seconds"] = time.perf_counter() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,qwen05", help="tiny, qwen05 (the 0.5B shape), comma-separated")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-ray", action="store_true", help="time the host copy only, not the ray.put")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ray = None
    if not args.no_ray:
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    load0 = os.getloadavg()
    rows = [measure(m, args, ray) for m in args.models.split(",")]
    if ray is not None:
        ray.shutdown()
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} CPUs",
        "torch_threads": args.threads,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    out = (
        Path(args.out)
        if args.out
        else (Path(__file__).resolve().parent / "results" / "lora" / f"lora_publish_{result['date']}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"load {load0[0]:.1f} -> {result['loadavg_end'][0]:.1f}; {args.threads} torch thread(s)")
    print(
        "| model | params | LoRA params | bytes full | bytes LoRA | ratio | stall full ms | stall LoRA ms | "
        "apply full ms | merge LoRA ms | decode merged / unmerged tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    key = "publish_put_ms" if ray is not None else "publish_ms"
    for r in rows:
        d = r["decode"]
        print(
            f"| {r['model']} | {r['parameters']:,} | {r['trainable_parameters']:,} | "
            f"{r['full']['bytes']:,} | {r['lora']['bytes']:,} | {r['bytes_ratio']:.1f}x | "
            f"{r['full'][key]:.1f} | {r['lora'][key]:.2f} | "
            f"{r['full']['apply_ms']:.1f} | {r['lora']['apply_ms']:.1f} | {d['merged_tok_s']:.0f} / "
            f"{d['unmerged_tok_s']:.0f} ({d['merged_vs_unmerged']:.2f}x) |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
