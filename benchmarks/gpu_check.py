"""GPU check: one prepared script for a lent CUDA machine. Prints one markdown table and writes JSON.

    python benchmarks/gpu_check.py                 # on a CUDA machine: the full check (a few minutes)
    python benchmarks/gpu_check.py --cpu-smoke     # tiny shapes, few steps: proves the script on a CPU

Sections:
- **engine**: tokens/s of the built-in continuous-batching engine at batch 1, 64 and 256, in three
  variants: ``dynamic`` (``ContinuousEngine``: bf16 on CUDA, lazy host syncs), ``static``
  (``StaticSlotEngine``: static slot KV cache) and ``graphs`` (the same with the decode forward
  captured as a CUDA graph; CUDA only), for the tiny model and a random Qwen2.5-0.5B-shaped Llama
  (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151,936; built from a config,
  nothing downloaded), against a plain eager KV-cache loop (model forward with ``past_key_values``,
  sample, repeat) on the same model, batch and token count. No EOS: every row decodes the full length.
- **publish**: the trainer's publish path (``PolicyTrainer.publish``: weights -> numpy arrays for the
  object store) against the raw device-to-pinned-host copy of the same weights; and ``ray.put`` of the
  arrays when Ray is importable.
- **trainer**: ``trainer_rows`` (filled by the trainer backend section).

JSON goes to ``--out``, else ``$OUT/gpu_check.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf.schema import ModelConfig  # noqa: E402
from training.model import build_char_tokenizer, build_tiny_model  # noqa: E402
from training.rl.continuous import ContinuousEngine  # noqa: E402
from training.rl.records import GenRequest, PromptItem  # noqa: E402
from training.rl.static_slots import StaticSlotEngine  # noqa: E402

QWEN05_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6,
                    tie_word_embeddings=True)
SMOKE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=4096, max_position_embeddings=512, rope_theta=1e6,
                   tie_word_embeddings=True)


class _NoTextTokenizer:
    """What the engine needs of a tokenizer for a random model: no EOS (rows decode the full length),
    pad 0, and a decode that returns nothing."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_models(args, device: torch.device):
    """[(name, model, tokenizer, dtype name)]: the tiny model and the 0.5B shape, in the engine's dtype
    (bf16 on CUDA, float32 on CPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = []
    if "tiny" in args.models:
        tok = build_char_tokenizer()
        tiny = build_tiny_model(ModelConfig(), tok, seed=0)
        out.append(("tiny", tiny, _NoTextTokenizer(), len(tok)))
    if "0.5b" in args.models:
        shape = SMOKE_SHAPE if args.cpu_smoke else QWEN05_SHAPE
        torch.manual_seed(0)
        cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        with torch.device(device):
            big = LlamaForCausalLM(cfg)
        out.append(("0.5b-shape" if not args.cpu_smoke else "0.5b-shape(smoke)", big, _NoTextTokenizer(),
                    cfg.vocab_size))
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return [(name, m.to(device=device, dtype=dtype).eval(), tok, vocab, str(dtype).replace("torch.", ""))
            for name, m, tok, vocab in out]


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=g)


ENGINE_VARIANTS = {
    "dynamic": "ContinuousEngine (concat/select KV cache)",
    "static": "StaticSlotEngine (static slot KV cache, eager forward)",
    "graphs": "StaticSlotEngine + CUDA graph of the decode forward",
}


def time_engine(model, tok, device, batch: int, prompt: torch.Tensor, new_tokens: int,
                variant: str = "dynamic") -> dict:
    """The built-in engine: ``batch`` requests, capacity ``batch``, every row ``new_tokens`` long."""
    kw = dict(device=str(device), capacity=batch, max_new_tokens=new_tokens, temperature=1.0, seed=0)
    if variant == "dynamic":
        engine = ContinuousEngine(model, tok, **kw)
    else:
        engine = StaticSlotEngine(model, tok, cuda_graphs=variant == "graphs", **kw)
    reqs = [GenRequest(PromptItem(f"p{i}", "", "", tuple(prompt[i].tolist())), 0, group_uid=i) for i in range(batch)]

    def run() -> int:
        engine.submit(reqs)
        n = 0
        while engine.status()["queued"] or engine.status()["active"]:
            n += sum(len(t.response_tokens) for t in engine.step(new_tokens))
        return n

    run()  # warm-up (kernels, allocator, graph capture)
    _sync(device)
    t0 = time.perf_counter()
    n = run()
    _sync(device)
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "ms_per_step": 1000 * dt / new_tokens,
            "sync_every": engine.sync_every, "graph_captures": getattr(engine, "graph_captures", 0)}


@torch.inference_mode()
def time_eager_loop(model, device, batch: int, prompt: torch.Tensor, new_tokens: int) -> dict:
    """The baseline: prefill, then ``new_tokens - 1`` forwards with ``past_key_values``, multinomial
    sampling at temperature 1, no stopping."""
    from transformers import DynamicCache

    ids = prompt[:batch].to(device)

    def run() -> int:
        cache = DynamicCache()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1, :]
        out = []
        for i in range(new_tokens):
            nxt = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1)
            out.append(nxt)
            if i == new_tokens - 1:
                break
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1, :]
        return int(torch.cat(out, 1).numel())

    run()
    _sync(device)
    t0 = time.perf_counter()
    n = run()
    _sync(device)
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "ms_per_step": 1000 * dt / new_tokens}


def engine_rows(args, device, models) -> list[dict]:
    rows = []
    variants = [v for v in args.variants if v != "graphs" or device.type == "cuda"]
    for name, model, tok, vocab, dtype in models:
        prompt = _prompts(max(args.batches), args.prompt_len, vocab)
        for b in args.batches:
            base = time_eager_loop(model, device, b, prompt, args.new_tokens)
            for variant in variants:  # graphs last: a failed capture must not spoil the others
                row = {"section": "engine", "model": name, "dtype": dtype, "batch": b, "variant": variant,
                       "new_tokens": args.new_tokens, "eager_tokens_per_s": base["tokens_per_s"],
                       "eager_ms_per_step": base["ms_per_step"]}
                try:
                    eng = time_engine(model, tok, device, b, prompt[:b], args.new_tokens, variant)
                except Exception as e:  # noqa: BLE001 - reported in the table, the check goes on
                    row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                    print(f"  engine {name} {variant} batch {b}: FAILED {row['error']}", file=sys.stderr)
                    rows.append(row)
                    continue
                row.update(engine_tokens_per_s=eng["tokens_per_s"], engine_ms_per_step=eng["ms_per_step"],
                           ratio=eng["tokens_per_s"] / base["tokens_per_s"], sync_every=eng["sync_every"],
                           graph_captures=eng["graph_captures"])
                rows.append(row)
                print(f"  engine {name} {variant} batch {b}: {eng['tokens_per_s']:.0f} tok/s vs eager "
                      f"{base['tokens_per_s']:.0f}", file=sys.stderr)
    return rows


def _best_of(fn, repeats: int, device) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def trainer_publish(model):
    """The trainer's publish path (``PolicyTrainer.publish``: its ``full_state`` host arrays) bound
    to ``model`` without building an optimizer: what the trainer actor does before ``ray.put``."""
    from training.rl.trainer import PolicyTrainer

    ns = types.SimpleNamespace(model=model, version=0)
    if hasattr(PolicyTrainer, "full_state"):
        ns.full_state = types.MethodType(PolicyTrainer.full_state, ns)
    return lambda: PolicyTrainer.publish(ns)


def publish_rows(args, device, models) -> list[dict]:
    """The trainer's publish path vs the raw device-to-pinned-host copy of the same weights, for the
    float32 weights of the torch trainer and the bfloat16 weights of a bf16 (DeepSpeed) trainer."""
    rows = []
    for name, model, _, _, _ in models:
        for dtype in (torch.float32, torch.bfloat16):
            model.to(dtype=dtype)
            params = list(model.state_dict().values())
            nbytes = sum(p.numel() * p.element_size() for p in params)
            pin = device.type == "cuda"
            host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params]

            def raw_copy():
                for h, p in zip(host, params):
                    h.copy_(p, non_blocking=pin)

            publish = trainer_publish(model)
            raw = _best_of(raw_copy, args.repeats, device)
            pub = _best_of(publish, args.repeats, device)
            row = {"section": "publish", "model": name, "dtype": str(dtype).replace("torch.", ""),
                   "gbytes": nbytes / 1e9, "publish_ms": 1000 * pub, "raw_copy_ms": 1000 * raw, "ratio": pub / raw,
                   "raw_gb_per_s": nbytes / raw / 1e9, "ray_put_ms": None}
            if args.ray:
                try:
                    import ray

                    if not ray.is_initialized():
                        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
                    state = publish().state
                    row["ray_put_ms"] = 1000 * _best_of(lambda: ray.put(state), args.repeats, device)
                except ImportError:
                    pass
            rows.append(row)
            print(f"  publish {name} {row['dtype']}: {row['publish_ms']:.1f} ms vs raw copy "
                  f"{row['raw_copy_ms']:.1f} ms", file=sys.stderr)
            del host
        model.to(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return rows


def trainer_rows(args) -> list[dict]:
    """filled by the trainer backend section"""
    return []


def markdown(rows: list[dict]) -> str:
    lines = ["| section | model | case | ours | baseline | ratio |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        if r["section"] == "engine":
            ours = (f"FAILED: {r['error']}" if "error" in r else
                    f"{r['engine_tokens_per_s']:,.0f} ({r['engine_ms_per_step']:.1f} ms/step)")
            ratio = "" if "error" in r else f"{r['ratio']:.2f}x"
            lines.append(f"| engine tokens/s | {r['model']} ({r['dtype']}) | {r['variant']}, batch {r['batch']}, "
                         f"{r['new_tokens']} new tokens | {ours} | eager KV loop {r['eager_tokens_per_s']:,.0f} "
                         f"({r['eager_ms_per_step']:.1f} ms/step) | {ratio} |")
        elif r["section"] == "publish":
            extra = "" if r.get("ray_put_ms") is None else f"; ray.put {r['ray_put_ms']:.1f} ms"
            lines.append(f"| publish stall | {r['model']} ({r['dtype']}, {r['gbytes']:.2f} GB) | trainer publish "
                         f"path{extra} | {r['publish_ms']:.1f} ms | raw D2H copy {r['raw_copy_ms']:.1f} ms "
                         f"({r['raw_gb_per_s']:.0f} GB/s) | {r['ratio']:.2f}x |")
        else:
            lines.append(f"| {r['section']} | {r.get('model', '')} | {r.get('case', '')} | {r.get('ours', '')} | "
                         f"{r.get('baseline', '')} | {r.get('ratio', '')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="GPU check of the built-in engine and the publish stall")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes and few steps, on the CPU (< 60 s)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,64,256)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--models", default="tiny,0.5b")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sections", default="engine,publish,trainer")
    ap.add_argument("--variants", default="dynamic,static,graphs",
                    help="engine variants: dynamic, static, graphs (graphs: CUDA only)")
    ap.add_argument("--ray", action=argparse.BooleanOptionalAction, default=None,
                    help="also time ray.put of the published arrays (default: on CUDA, when Ray imports)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    args.variants = args.variants.split(",")
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.cpu_smoke else "1,64,256")).split(",")]
    args.new_tokens = args.new_tokens or (8 if args.cpu_smoke else 128)
    args.repeats = args.repeats or (2 if args.cpu_smoke else 5)
    if args.ray is None:
        args.ray = not args.cpu_smoke
    if args.cpu_smoke:
        args.prompt_len = min(args.prompt_len, 12)
        torch.set_num_threads(1)  # tiny shapes: one thread beats two contended ones
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    if device.type == "cpu" and not args.cpu_smoke:
        print("no CUDA device: use --cpu-smoke on a CPU machine", file=sys.stderr)
        raise SystemExit(2)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    sections = args.sections.split(",")
    models = build_models(args, device)
    rows: list[dict] = []
    if "engine" in sections:
        rows += engine_rows(args, device, models)
    if "publish" in sections:
        rows += publish_rows(args, device, models)
    if "trainer" in sections:
        rows += trainer_rows(args)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "cpu_smoke": args.cpu_smoke, "seconds": time.perf_counter() - t0}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(markdown(rows))
    print(f"\n{env}")
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"env": env, "rows": rows}, indent=2))
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
