"""Rollout engine throughput, same model, same prompts, same run.

Default: the built-in engine's batch call against Hugging Face ``generate`` (tokens/s of each and the
ratio). ``--ab DIR``: an A/B of seconds per batch (16 prompts x 8 samples of 64 new tokens on the
default tiny model shape unless told otherwise), alternating, a few rounds: the engine of the
checkout in ``DIR`` (its ``generation.engine.TorchEngine``, imported in a subprocess with
``PYTHONPATH=DIR``) against this checkout's ``Engine.generate`` and ``Engine.submit``/``step`` (the
whole batch submitted at once, as the synchronous RL rollouts do), with the same torch thread count.

    .venv/bin/python benchmarks/engine_throughput.py [--batch 64] [--new-tokens 48] [--repeats 3]
    .venv/bin/python benchmarks/engine_throughput.py --ab /work/before [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conf.schema import EngineOptions, ModelConfig  # noqa: E402
from generation.engine import Engine  # noqa: E402
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt  # noqa: E402
from generation.records import GenRequest, PromptItem  # noqa: E402

# the other checkout's engine, one batch per line read from stdin, seconds per batch written back
_BEFORE_WORKER = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from conf.schema import ModelConfig
from generation.engine import TorchEngine
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt
from generation.records import GenRequest, PromptItem
prompts, samples, new_tokens = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tok = build_char_tokenizer()
model = build_tiny_model(ModelConfig(), tok, seed=0).eval()
items = [PromptItem(f"p{i}", "", "", encode_prompt(tok, f"What is {i % 10}+{i % 7}?\\n"))
         for i in range(prompts)]
reqs = [GenRequest(p, s, group_uid=i) for i, p in enumerate(items) for s in range(samples)]
engine = TorchEngine(model, tok, batch_size=len(reqs))
engine.eos_id = -1
print("ready", flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    out = engine.generate(reqs, new_tokens, 1.0, torch.Generator().manual_seed(0))
    assert sum(len(t.response_tokens) for t in out) == len(reqs) * new_tokens
    print(time.perf_counter() - t0, flush=True)
"""


def _prompts(tok, n: int) -> list[PromptItem]:
    return [PromptItem(f"p{i}", "", "", encode_prompt(tok, f"What is {i % 10}+{i % 7}?\n")) for i in range(n)]


def ab(args) -> None:
    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(), tok, seed=0).eval()
    reqs = [
        GenRequest(p, s, group_uid=i)
        for i, p in enumerate(_prompts(tok, args.prompts))
        for s in range(args.samples)
    ]
    engine = Engine(model, tok, EngineOptions(capacity=len(reqs), max_new_tokens=args.new_tokens, seed=0))
    engine.eos_id = -1  # never stops early: equal work on every side
    want = len(reqs) * args.new_tokens

    def run_generate() -> float:
        t0 = time.perf_counter()
        out = engine.generate(reqs, args.new_tokens, 1.0, seed=0)
        assert sum(len(t.response_tokens) for t in out) == want
        return time.perf_counter() - t0

    def run_step() -> float:
        t0 = time.perf_counter()
        engine.submit(reqs)
        n = 0
        while engine.status()["active"] or engine.status()["queued"]:
            n += sum(len(t.response_tokens) for t in engine.step(args.new_tokens))
        assert n == want
        return time.perf_counter() - t0

    env = {**os.environ, "PYTHONPATH": str(Path(args.ab).resolve()), "OMP_NUM_THREADS": str(args.threads)}
    worker = subprocess.Popen(
        [sys.executable, "-c", _BEFORE_WORKER, str(args.threads), str(args.prompts), str(args.samples)]
        + [str(args.new_tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=args.ab,
        env=env,
    )
    assert worker.stdout.readline().strip() == "ready"

    def run_before() -> float:
        worker.stdin.write("go\n")
        worker.stdin.flush()
        return float(worker.stdout.readline())

    sides = {
        "before TorchEngine.generate": run_before,
        "Engine.generate": run_generate,
        "Engine.submit/step": run_step,
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for fn in sides.values():  # warm-up: kernel builds, first allocations
            fn()
        for r in range(args.rounds):
            for name, fn in sides.items():
                times[name].append(fn())
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
    finally:
        worker.stdin.close()
        worker.wait(timeout=60)
    base = sorted(times["before TorchEngine.generate"])[len(times["before TorchEngine.generate"]) // 2]
    print(
        f"\n{len(reqs)} samples ({args.prompts} prompts x {args.samples}) of {args.new_tokens} new tokens, "
        f"{args.threads} torch thread(s), median of {args.rounds} alternating rounds:"
    )
    for name, ts in times.items():
        med = sorted(ts)[len(ts) // 2]
        print(f"  {name:<28} {med:.3f} s/batch, best {min(ts):.3f} s  ({med / base:.2f}x before's median)")


def versus_hf(args) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(), tok, seed=0).eval()
    model.generation_config.eos_token_id = None  # both sides decode the full length
    prompts = _prompts(tok, args.batch)
    engine = Engine(model, tok, EngineOptions(capacity=args.batch))
    engine.eos_id = -1  # never stops early: equal work on both sides
    reqs = [GenRequest(p, 0) for p in prompts]

    def run_engine() -> int:
        out = engine.generate(reqs, args.new_tokens, 1.0, seed=0)
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
            f"{name:<12} {best:10.0f} tokens/s  "
            f"(batch {args.batch}, {args.new_tokens} new tokens, best of {args.repeats})"
        )
    print(f"ratio engine/hf_generate: {results['engine'] / results['hf_generate']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None, help="default: 48 (vs HF), 64 (--ab)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ab", default=None, help="a checkout of the code before, e.g. /work/before")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    if args.ab:
        args.new_tokens = args.new_tokens or 64
        ab(args)
    else:
        args.new_tokens = args.new_tokens or 48
        versus_hf(args)


if __name__ == "__main__":
    main()
