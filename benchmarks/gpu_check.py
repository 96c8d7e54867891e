"""GPU check: one prepared script for a lent CUDA machine. Prints one markdown table and writes JSON.

    python benchmarks/gpu_check.py                 # on a CUDA machine: the full check (a few minutes)
    python benchmarks/gpu_check.py --cpu-smoke     # tiny shapes, few steps: proves the script on a CPU

Sections:
- **engine**: tokens/s of the built-in continuous-batching engine at batch 1, 64 and 256, in three
  variants: ``wave`` (``Engine``'s default: a wave of rows that start together, prompt-shared
  static KV cache), ``dynamic`` (``Engine(waves=False)``: bf16 on CUDA, lazy host syncs), ``static``
  (``Engine(static_cache=True)``: static slot KV cache) and ``graphs`` (the same with the decode forward
  captured as a CUDA graph; CUDA only), for the tiny model and a random Qwen2.5-0.5B-shaped Llama
  (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151,936; built from a config,
  nothing downloaded), against a plain eager KV-cache loop (model forward with ``past_key_values``,
  sample, repeat) on the same model, batch and token count. No EOS: every row decodes the full length.
- **publish**: the trainer's publish path (``PolicyTrainer.publish``: weights -> numpy arrays for the
  object store) against the raw device-to-pinned-host copy of the same weights; and ``ray.put`` of the
  arrays when Ray is importable.
- **trainer**: one policy update (``training.rl.trainer``) on the 0.5B shape with torch AdamW and
  DeepSpeed ZeRO-2/3, and each trainer's publish (ZeRO-3: gathered) against the raw D2H copy.

JSON goes to ``--out``, else ``$OUT/gpu_check.json`` when ``$OUT`` is set; it is rewritten after each
section, so a check stopped from outside keeps the sections it finished. ``--time-budget`` skips what
would start past it (each skipped row says so), and a section that fails is one row, not the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf.schema import EngineOptions, ModelConfig, RolloutConfig
from generation.engine import Engine
from generation.model import build_char_tokenizer, build_tiny_model
from generation.records import GenRequest, PromptItem

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
SMOKE_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=4096,
    max_position_embeddings=512,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


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
        out.append(
            (
                "0.5b-shape" if not args.cpu_smoke else "0.5b-shape(smoke)",
                big,
                _NoTextTokenizer(),
                cfg.vocab_size,
            )
        )
    dtype = torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return [
        (name, m.to(device=device, dtype=dtype).eval(), tok, vocab, str(dtype).replace("torch.", ""))
        for name, m, tok, vocab in out
    ]


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=g)


ENGINE_VARIANTS = {
    "wave": "Engine (a wave: prompt-shared static KV cache)",
    "dynamic": "Engine(waves=False) (concat/select KV cache)",
    "static": "Engine(static_cache=True) (static slot KV cache, eager forward)",
    "graphs": "Engine(static_cache=True, cuda_graphs=True): CUDA graph of the decode forward",
}


def time_engine(
    model, tok, device, batch: int, prompt: torch.Tensor, new_tokens: int, variant: str = "dynamic"
) -> dict:
    """The built-in engine: ``batch`` requests, capacity ``batch``, every row ``new_tokens`` long."""
    opts = dict(capacity=batch, max_new_tokens=new_tokens, temperature=1.0, seed=0)
    if variant in ("wave", "dynamic"):
        engine = Engine(model, tok, EngineOptions(**opts), device=str(device), waves=variant == "wave")
    else:
        rollout = RolloutConfig(static_cache=True, cuda_graphs=variant == "graphs")
        engine = Engine(model, tok, EngineOptions(**opts, rollout=rollout), device=str(device))
    reqs = [
        GenRequest(PromptItem(f"p{i}", "", "", tuple(prompt[i].tolist())), 0, group_uid=i)
        for i in range(batch)
    ]

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
    return {
        "tokens": n,
        "seconds": dt,
        "tokens_per_s": n / dt,
        "ms_per_step": 1000 * dt / new_tokens,
        "sync_every": engine.sync_every,
        "graph_captures": getattr(engine, "graph_captures", 0),
    }


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


def over_budget(args) -> bool:
    return args.time_budget is not None and time.perf_counter() - args.t0 > args.time_budget


def engine_rows(args, device, models) -> list[dict]:
    rows = []
    variants = [v for v in args.variants if v != "graphs" or device.type == "cuda"]
    # the 0.5B shape and the largest batch first: what the targets read is measured before a time budget bites
    for name, model, tok, vocab, dtype in sorted(models, key=lambda m: not m[0].startswith("0.5b")):
        prompt = _prompts(max(args.batches), args.prompt_len, vocab)
        for b in sorted(args.batches, reverse=True):
            head = {
                "section": "engine",
                "model": name,
                "dtype": dtype,
                "batch": b,
                "new_tokens": args.new_tokens,
            }
            if "graphs" in args.variants and device.type != "cuda":
                rows.append({**head, "variant": "graphs", "skipped": "no CUDA"})
            if over_budget(args):
                rows += [{**head, "variant": v, "skipped": "time budget"} for v in variants]
                continue
            base = time_eager_loop(model, device, b, prompt, args.new_tokens)
            for variant in variants:  # graphs last: a failed capture must not spoil the others
                row = {
                    "section": "engine",
                    "model": name,
                    "dtype": dtype,
                    "batch": b,
                    "variant": variant,
                    "new_tokens": args.new_tokens,
                    "eager_tokens_per_s": base["tokens_per_s"],
                    "eager_ms_per_step": base["ms_per_step"],
                }
                try:
                    eng = time_engine(model, tok, device, b, prompt[:b], args.new_tokens, variant)
                except Exception as e:  # reported in the table, the check goes on
                    row.update(error=f"{type(e).__name__}: {str(e)[:200]}")
                    print(f"  engine {name} {variant} batch {b}: FAILED {row['error']}", file=sys.stderr)
                    rows.append(row)
                    continue
                row.update(
                    engine_tokens_per_s=eng["tokens_per_s"],
                    engine_ms_per_step=eng["ms_per_step"],
                    ratio=eng["tokens_per_s"] / base["tokens_per_s"],
                    sync_every=eng["sync_every"],
                    graph_captures=eng["graph_captures"],
                )
                rows.append(row)
                print(
                    f"  engine {name} {variant} batch {b}: {eng['tokens_per_s']:.0f} tok/s vs eager "
                    f"{base['tokens_per_s']:.0f}",
                    file=sys.stderr,
                )
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


def _copy_all(host: list, params: list, pin: bool) -> None:
    """The raw device-to-host copy: each of ``params`` into its (pinned) buffer in ``host``."""
    for h, p in zip(host, params):
        h.copy_(p, non_blocking=pin)


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
            publish = trainer_publish(model)
            raw = _best_of(functools.partial(_copy_all, host, params, pin), args.repeats, device)
            pub = _best_of(publish, args.repeats, device)
            row = {
                "section": "publish",
                "model": name,
                "dtype": str(dtype).replace("torch.", ""),
                "gbytes": nbytes / 1e9,
                "publish_ms": 1000 * pub,
                "raw_copy_ms": 1000 * raw,
                "ratio": pub / raw,
                "raw_gb_per_s": nbytes / raw / 1e9,
                "ray_put_ms": None,
            }
            if args.ray:
                try:
                    import ray

                    if not ray.is_initialized():
                        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
                    state = publish().state
                    row["ray_put_ms"] = 1000 * _best_of(
                        functools.partial(ray.put, state), args.repeats, device
                    )
                except ImportError:
                    pass
            rows.append(row)
            print(
                f"  publish {name} {row['dtype']}: {row['publish_ms']:.1f} ms vs raw copy "
                f"{row['raw_copy_ms']:.1f} ms",
                file=sys.stderr,
            )
            del host
        model.to(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    return rows


def _trainer_groups(
    vocab: int, n_groups: int, group_size: int, prompt_len: int, response_len: int, seed: int = 0
):
    """Scored groups of random prompts and responses (half rewarded): a training batch of fixed shape."""
    from generation.records import ScoredGroup, Trajectory

    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(n_groups):
        prompt = PromptItem(
            f"p{i}", "x", "y", tuple(int(t) for t in torch.randint(3, vocab, (prompt_len,), generator=g))
        )
        trajs = tuple(
            Trajectory(
                "trajectory",
                prompt,
                j,
                tuple(int(t) for t in torch.randint(3, vocab, (response_len,), generator=g)),
                tuple(float(-x) for x in torch.rand(response_len, generator=g)),
                0,
                True,
                "y",
            )
            for j in range(group_size)
        )
        groups.append(
            ScoredGroup(
                "scored_group",
                prompt.prompt_id,
                trajs,
                tuple(float(j % 2) for j in range(group_size)),
                tuple(bool(j % 2) for j in range(group_size)),
            )
        )
    return groups


def trainer_rows(args) -> list[dict]:
    """One optimizer update of the policy trainer (``training.rl.trainer``) on the 0.5B shape (the
    smoke shape with ``--cpu-smoke``): torch AdamW, DeepSpeed ZeRO-2 and ZeRO-3 (one rank; nccl on
    CUDA, gloo on the CPU; bf16 where the device has it), each with its publish (ZeRO-3 gathers the
    partitioned weights) against the raw device-to-pinned-host copy of the same weights."""
    import importlib.util
    import socket

    from transformers import LlamaConfig, LlamaForCausalLM

    from training.objectives import PRESETS
    from training.rl.trainer import DeepSpeedPolicyTrainer, PolicyTrainer, init_distributed

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    shape = SMOKE_SHAPE if args.cpu_smoke else QWEN05_SHAPE
    n_groups, group_size, plen, rlen = (2, 4, 12, 16) if args.cpu_smoke else (8, 8, 64, 192)
    groups = _trainer_groups(shape["vocab_size"], n_groups, group_size, plen, rlen)
    tokens = n_groups * group_size * rlen
    kw = dict(
        lr=1e-6,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        max_new_tokens=rlen,
        pad_id=0,
        device=str(device),
        micro_batch_tokens=16384,
    )
    cases = [("torch", None)]
    have_ds = importlib.util.find_spec("deepspeed") is not None
    cases += [("deepspeed", 2), ("deepspeed", 3)]
    rows, base_ms = [], None
    dist_ready = False
    for backend, stage in cases:
        name = f"{backend}" + (f" ZeRO-{stage}" if stage else " AdamW")
        row = {
            "section": "trainer",
            "model": "0.5b-shape" if not args.cpu_smoke else "0.5b-shape(smoke)",
            "case": f"{name}, {n_groups * group_size} seqs x {plen}+{rlen} tokens",
        }
        if backend == "deepspeed" and not have_ds:
            rows.append(
                {**row, "ours": "skipped: deepspeed is not installed (see DESIGN.md: carry its sdist)"}
            )
            continue
        if backend == "deepspeed" and not args.deepspeed:
            rows.append(
                {**row, "ours": "skipped: --no-deepspeed" + (" (no CUDA)" if device.type != "cuda" else "")}
            )
            continue
        if over_budget(args):
            rows.append({**row, "ours": "skipped: time budget"})
            continue
        try:
            torch.manual_seed(0)
            cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
            model = LlamaForCausalLM(cfg).to(device)
            if backend == "torch":
                trainer = PolicyTrainer(model, PRESETS["grpo"], **kw)
            else:
                if not dist_ready:
                    os.environ.setdefault(
                        "TORCH_EXTENSIONS_DIR", str(Path(args.out or "/tmp").parent / "torch_ext")
                    )
                    with socket.socket() as sock:
                        sock.bind(("127.0.0.1", 0))
                        port = sock.getsockname()[1]
                    init_distributed(
                        "nccl" if device.type == "cuda" else "gloo",
                        0,
                        1,
                        "127.0.0.1",
                        port,
                        deepspeed_comm=True,
                    )
                    dist_ready = True
                from conf.loader import deepspeed_config

                trainer = DeepSpeedPolicyTrainer(
                    model, PRESETS["grpo"], ds_config=deepspeed_config(f"zero{stage}"), **kw
                )
            trainer.update(groups)  # warm-up (allocations, kernels)
            step = _best_of(functools.partial(trainer.update, groups), args.repeats, device)
            pub = _best_of(trainer.full_state, args.repeats, device)
            params = [p for p in trainer.model.state_dict().values()]
            if backend == "deepspeed" and stage == 3:  # partitioned: time the copy of the gathered weights
                import deepspeed

                with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
                    params = [p.detach().clone() for p in trainer.model.state_dict().values()]
            pin = device.type == "cuda"
            host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params]
            raw_s = _best_of(functools.partial(_copy_all, host, params, pin), args.repeats, device)
            base_ms = 1000 * step if backend == "torch" else base_ms
            row.update(
                ours=(
                    f"{1000 * step:,.0f} ms/update ({tokens / step:,.0f} tok/s); publish {1000 * pub:.1f} ms"
                ),
                baseline=(f"torch AdamW {base_ms:,.0f} ms/update; " if base_ms and backend != "torch" else "")
                + f"raw D2H copy {1000 * raw_s:.1f} ms",
                ratio=f"publish {pub / raw_s:.2f}x raw",
                update_ms=1000 * step,
                publish_ms=1000 * pub,
                raw_copy_ms=1000 * raw_s,
                dtype=str(params[0].dtype).replace("torch.", ""),
            )
            del trainer, model, params, host
        except Exception as err:  # one failed case shows in the table, the rest still run
            row["ours"] = (
                f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(f"  trainer {row['case']}: {row['ours']}", file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| section | model | case | ours | baseline | ratio |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(
                f"| {r['section']} | {r.get('model', '')} | "
                f"{r.get('variant', '')}, batch {r.get('batch', '')} | "
                f"skipped: {r['skipped']} | | |"
            )
        elif r.get("section_error"):
            lines.append(f"| {r['section']} | | | FAILED: {r['section_error']} | | |")
        elif r["section"] == "engine":
            ours = (
                f"FAILED: {r['error']}"
                if "error" in r
                else f"{r['engine_tokens_per_s']:,.0f} ({r['engine_ms_per_step']:.1f} ms/step)"
            )
            ratio = "" if "error" in r else f"{r['ratio']:.2f}x"
            lines.append(
                f"| engine tokens/s | {r['model']} ({r['dtype']}) | {r['variant']}, batch {r['batch']}, "
                f"{r['new_tokens']} new tokens | {ours} | eager KV loop {r['eager_tokens_per_s']:,.0f} "
                f"({r['eager_ms_per_step']:.1f} ms/step) | {ratio} |"
            )
        elif r["section"] == "publish":
            extra = "" if r.get("ray_put_ms") is None else f"; ray.put {r['ray_put_ms']:.1f} ms"
            lines.append(
                f"| publish stall | {r['model']} ({r['dtype']}, {r['gbytes']:.2f} GB) | trainer publish "
                f"path{extra} | {r['publish_ms']:.1f} ms | raw D2H copy {r['raw_copy_ms']:.1f} ms "
                f"({r['raw_gb_per_s']:.0f} GB/s) | {r['ratio']:.2f}x |"
            )
        else:
            lines.append(
                f"| {r['section']} | {r.get('model', '')} | {r.get('case', '')} | {r.get('ours', '')} | "
                f"{r.get('baseline', '')} | {r.get('ratio', '')} |"
            )
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
    ap.add_argument(
        "--variants",
        default="wave,dynamic,static,graphs",
        help="engine variants: wave, dynamic, static, graphs (graphs: CUDA only)",
    )
    ap.add_argument(
        "--ray",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time ray.put of the published arrays (default: on CUDA, when Ray imports)",
    )
    ap.add_argument(
        "--deepspeed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the DeepSpeed ZeRO-2/3 trainer rows (--no-deepspeed: skipped rows)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: rows that would start past it are skipped (recorded as such)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.t0 = time.perf_counter()
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
    t0 = args.t0
    sections = args.sections.split(",")
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    env = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cpu_smoke": args.cpu_smoke,
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    rows: list[dict] = []

    def write(done: bool) -> None:
        env["seconds"], env["complete"] = time.perf_counter() - t0, done
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps({"env": env, "rows": rows}, indent=2))

    models = build_models(args, device) if {"engine", "publish"} & set(sections) else []
    for section, fn in (
        ("engine", lambda: engine_rows(args, device, models)),
        ("publish", lambda: publish_rows(args, device, models)),
        ("trainer", lambda: trainer_rows(args)),
    ):
        if section not in sections:
            continue
        try:
            rows += fn()
        except Exception as err:  # one failed section is a row; the others still run
            rows.append({"section": section, "section_error": f"{type(err).__name__}: {str(err)[:300]}"})
            print(f"  {section}: FAILED {rows[-1]['section_error']}", file=sys.stderr)
        write(False)
    write(True)
    print(markdown(rows))
    print(f"\n{env}")
    if out:
        print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
