"""The engine where compute is real: SmolLM2-135M-Instruct and the tiny default side by side, one run.

Per model: decode tokens/s of the project's engine (fp32 and bf16 weights) and of Hugging Face
``generate`` (fp32) at each batch size, on the same prompts (the arithmetic task through the model's
prompt format), every side decoding exactly ``--new-tokens`` tokens (EOS disabled); the bf16 log-prob
mismatch against fp32 on the same sampled sequences (teacher-forced); and the machine's limits measured
in the same run (fp32 and bf16 GEMM peak, memory bandwidth), as a roofline fraction: at batch B a
decode step needs at least max(2 x params x B / GEMM peak, weight bytes / bandwidth) seconds.

vLLM's CPU build is measured only where ``.venv-vllm`` exists (``make vllm-env``, 3.5 GB).
Timings on a shared machine are noisy: compare the ratios within one run.

    .venv/bin/python benchmarks/engine_smollm2.py --smollm2 WS/artifacts/pretrained/<sha> \\
        [--batches 1 16 64 128] [--new-tokens 16] [--threads 2] [--out benchmarks/results/engine/...json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conf.schema import EngineOptions, ModelConfig, RolloutConfig  # noqa: E402
from generation.engine import Engine  # noqa: E402
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, load_model  # noqa: E402
from generation.records import GenRequest, PromptItem  # noqa: E402

SMOLLM2_TEMPLATE = "Answer with 'The answer is N.' Example: What is 2+3? The answer is 5.\n\n{problem}"


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def machine_limits(repeats: int = 5) -> dict:
    """GEMM peak (GFLOP/s) in fp32 and bf16 at 2048^2, and copy bandwidth (GB/s, read + write)."""
    out = {}
    n = 2048
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        out[f"gemm_{name}_gflops"] = 2 * n**3 / _best_seconds(lambda a=a, b=b: torch.mm(a, b), repeats) / 1e9
    src = torch.ones(64 * 2**20)  # 256 MB
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _best_seconds(lambda: dst.copy_(src), repeats)
    out["copy_bandwidth_gbs"] = 2 * src.numel() * 4 / seconds / 1e9
    return out


def tiny_model():
    tok = build_char_tokenizer()
    return build_tiny_model(ModelConfig(), tok, seed=0).eval(), tok, "{problem}\n"


def prompts(tok, template: str, n: int) -> list[PromptItem]:
    texts = [f"What is {i % 10}+{i % 7}-{i % 3}?" for i in range(n)]
    return [
        PromptItem(f"p{i}", t, "", encode_prompt(tok, template.replace("{problem}", t)))
        for i, t in enumerate(texts)
    ]


def engine_tps(model, tok, items, new_tokens: int, dtype: str, repeats: int, **paths: bool) -> float:
    """``paths``: the engine's decode-path switches (``waves``, ``fused_decode``, ``native_kernels``,
    ``static_cache``); none given = the defaults."""
    rollout = RolloutConfig(dtype=dtype, static_cache=paths.pop("static_cache", False))
    engine = Engine(
        model, tok, EngineOptions(capacity=len(items), max_new_tokens=new_tokens, rollout=rollout), **paths
    )
    engine.eos_id = -1  # every side decodes the full length
    reqs = [GenRequest(p, 0) for p in items]

    def run() -> None:
        out = engine.generate(reqs, new_tokens, 1.0, seed=0)
        assert sum(len(t.response_tokens) for t in out) == len(reqs) * new_tokens

    run()  # warm-up (and the native kernels' build, once per machine)
    return len(reqs) * new_tokens / _best_seconds(run, repeats)


def hf_tps(model, tok, items, new_tokens: int, repeats: int) -> float:
    model = model.float()
    model.generation_config.eos_token_id = None
    width = max(len(p.prompt_tokens) for p in items)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((len(items), width), pad)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(items):
        ids[i, width - len(p.prompt_tokens) :] = torch.tensor(p.prompt_tokens)
        attn[i, width - len(p.prompt_tokens) :] = 1

    @torch.inference_mode()
    def run() -> None:
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            pad_token_id=pad,
        )
        assert out.shape[1] - width == new_tokens

    run()
    return len(items) * new_tokens / _best_seconds(run, repeats)


@torch.inference_mode()
def logprob_mismatch(model, tok, items, new_tokens: int) -> dict:
    """bf16 against fp32 token log-probs of the same sequences (sampled by the fp32 engine), teacher-forced:
    mean and max |delta log p| and the mean |ratio - 1| an off-policy correction would see."""
    engine = Engine(
        model,
        tok,
        EngineOptions(capacity=len(items), max_new_tokens=new_tokens, rollout=RolloutConfig(dtype="float32")),
    )
    seqs = engine.generate([GenRequest(p, 0) for p in items], new_tokens, 1.0, seed=0)
    deltas = []
    bf16 = type(model)(model.config).to(torch.bfloat16).eval()
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    for t in seqs:
        ids = torch.tensor([list(t.prompt.prompt_tokens) + list(t.response_tokens)])
        n, r = len(t.prompt.prompt_tokens), len(t.response_tokens)
        target = ids[0, n : n + r]
        lp = []
        for m in (model.float(), bf16):
            logits = m(ids).logits[0, n - 1 : n - 1 + r].float()
            lp.append(torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0])
        deltas.append(lp[1] - lp[0])
    d = torch.cat(deltas)
    return {
        "mean_abs_dlogp": float(d.abs().mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "mean_abs_ratio_minus_1": float((d.exp() - 1).abs().mean()),
        "tokens": int(d.numel()),
    }


def roofline(model, tps: float, batch: int, limits: dict, dtype: str) -> float:
    """Measured tokens/s over the bound at this batch (weights read once per step, 2 FLOP/param/token)."""
    params = sum(p.numel() for p in model.parameters())
    peak = limits[f"gemm_{dtype}_gflops"] * 1e9
    step = max(
        2 * params * batch / peak,
        params * (4 if dtype == "fp32" else 2) / (limits["copy_bandwidth_gbs"] * 1e9),
    )
    return tps / (batch / step)


def measure_model(name, model, tok, template, args, limits) -> dict:
    res: dict = {"parameters": sum(p.numel() for p in model.parameters()), "batches": {}}
    for batch in args.batches:
        items = prompts(tok, template, batch)
        row = {
            "engine_fp32": engine_tps(model, tok, items, args.new_tokens, "float32", args.repeats),
            "engine_bf16": engine_tps(model, tok, items, args.new_tokens, "bfloat16", args.repeats),
            "hf_generate_fp32": hf_tps(model.float(), tok, items, args.new_tokens, args.repeats),
        }
        model.float()
        row["engine_fp32_over_hf"] = row["engine_fp32"] / row["hf_generate_fp32"]
        row["engine_bf16_over_hf"] = row["engine_bf16"] / row["hf_generate_fp32"]
        row["roofline_engine_fp32"] = roofline(model, row["engine_fp32"], batch, limits, "fp32")
        row["roofline_engine_bf16"] = roofline(model, row["engine_bf16"], batch, limits, "bf16")
        res["batches"][batch] = row
        print(f"{name} batch {batch}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    res["bf16_mismatch"] = logprob_mismatch(model.float(), tok, prompts(tok, template, 16), args.new_tokens)
    print(f"{name} bf16 vs fp32: {res['bf16_mismatch']}", flush=True)
    return res


PATHS = {
    "default": {},
    "no_native": {"native_kernels": False},
    "no_fused": {"fused_decode": False},
    "no_waves": {"waves": False},
    "static_cache": {"static_cache": True},
}
"""The engine's decode paths (``generation/engine.py``): waves with the fused decoder and the native
kernels (the default), each switched off in turn, and the static slot cache."""


def compare_paths(models, args) -> dict:
    """fp32 tokens/s of each decode path at each batch, alternating paths within a batch size."""
    out: dict = {}
    for name, (model, tok, template) in models:
        out[name] = {}
        for batch in args.batches:
            items = prompts(tok, template, batch)
            row = {
                p: engine_tps(model, tok, items, args.new_tokens, "float32", args.repeats, **kw)
                for p, kw in PATHS.items()
            }
            out[name][batch] = row
            print(
                f"paths {name} batch {batch}: " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()),
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", required=True, help="the fetched folder (`laminar model fetch smollm2`)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=None)
    ap.add_argument("--paths", action="store_true", help="compare the engine's decode paths instead (fp32)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    limits = machine_limits()
    print(f"limits: {limits}", flush=True)
    result = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "limits": limits,
    }
    result["args"] = {k: v for k, v in vars(args).items() if k != "out"}
    smol, smol_tok = load_model(args.smollm2)
    models = (("tiny", tiny_model()), ("smollm2", (smol.eval(), smol_tok, SMOLLM2_TEMPLATE)))
    if args.paths:
        result["paths"] = compare_paths(models, args)
    else:
        for name, (model, tok, template) in models:
            result[name] = measure_model(name, model, tok, template, args, limits)
    result["limits_after"] = machine_limits()
    print(f"limits after: {result['limits_after']}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
