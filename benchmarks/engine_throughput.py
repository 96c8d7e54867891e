"""Rollout engine throughput: the built-in KV-cache loop vs Hugging Face ``generate``, same model,
same prompts, same run. Prints tokens/s for each and the ratio (engine / generate).

    .venv/bin/python benchmarks/engine_throughput.py [--batch 64] [--new-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf.schema import ModelConfig  # noqa: E402
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt  # noqa: E402
from generation.engine import TorchEngine  # noqa: E402
from generation.records import GenRequest, PromptItem  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(), tok, seed=0).eval()
    model.generation_config.eos_token_id = None  # both sides decode the full length
    prompts = [
        PromptItem(f"p{i}", "", "", encode_prompt(tok, f"What is {i % 10}+{i % 7}?\n"))
        for i in range(args.batch)
    ]
    engine = TorchEngine(model, tok, batch_size=args.batch)
    engine.eos_id = -1  # never stops early: equal work on both sides
    reqs = [GenRequest(p, 0) for p in prompts]

    def run_engine() -> int:
        out = engine.generate(reqs, args.new_tokens, 1.0, torch.Generator().manual_seed(0))
        return sum(len(t.response_tokens) for t in out)

    width = max(len(p.prompt_tokens) for p in prompts)
    ids = torch.full((args.batch, width), tok.pad_token_id)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p.prompt_tokens) :] = torch.tensor(p.prompt_tokens)
        attn[i, width - len(p.prompt_tokens) :] = 1

    @torch.inference_mode()
    def run_generate() -> int:
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=True,
            pad_token_id=tok.pad_token_id,
        )
        return int((out.shape[1] - width) * args.batch)

    results = {}
    for name, fn in (("engine", run_engine), ("hf_generate", run_generate)):
        fn()  # warm-up
        best = 0.0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = fn()
            best = max(best, n / (time.perf_counter() - t0))
        results[name] = best
        print(
            f"{name:<12} {best:10.0f} tokens/s  (batch {args.batch}, {args.new_tokens} new tokens, "
            f"best of {args.repeats})"
        )
    print(f"ratio engine/hf_generate: {results['engine'] / results['hf_generate']:.2f}x")


if __name__ == "__main__":
    main()
