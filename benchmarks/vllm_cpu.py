"""vLLM's CPU build against the project's engine, same model, same machine, one core each (vLLM's CPU
worker binds one core and reserves the other; the built-in engine runs one torch thread):

- ``throughput``: 128 completions (capacity 128, temperature 1), 3 rounds, tokens/s per round;
- ``update``: weight-update latency, publish to first token under the new version: ``load_weights``
  of new full weights (and, with ``--lora-rank``, of a random rank-r adapter on every linear layer),
  then one request submitted and one step (its prefill and first token);
- ``mismatch``: the training-inference log-prob mismatch: one batch's behaviour log-probs (what the
  engine reports while sampling) against the trainer's recomputation on the same tokens
  (``generation.adapter.sequence_logprobs``, float32, the sampling temperature): mean and p99 of
  |difference| per token and the distribution of the TIS weight exp(trainer - behaviour), with the
  engine in float32 and in bfloat16.

    .venv/bin/python benchmarks/vllm_cpu.py --shape tiny_vllm
    .venv/bin/python benchmarks/vllm_cpu.py --shape tiny_vllm --model-dir WORKSPACE/artifacts/model/<sha>
    .venv/bin/python benchmarks/vllm_cpu.py --shape 0.5b --parts throughput,update --lora-rank 16
    .venv/bin/python benchmarks/vllm_cpu.py --reconcile WORKSPACE/artifacts/model/<rl checkpoint> ...

``--reconcile`` reads RL checkpoints' records instead (``runtime.json``, ``history.jsonl``,
``consumed.json``) and checks that every trained group was trained once (group ids unique; the
prompts consumed add up to the trajectories trained) and prints the in-run sampler/trainer log-prob
gap.

Shapes: ``tiny_vllm`` (``conf/model/tiny_vllm.yaml``) and ``0.5b``, Qwen2.5-0.5B's transformer
(hidden 896, 24 layers, 14 heads of 64, 2 KV heads, intermediate 4864) over the character tokenizer's
vocabulary (the random models need a tokenizer vLLM loads; the 151,936-row embedding is left out, so
the model has 358 M parameters, not 494 M). ``--model-dir`` measures a saved checkpoint instead
(e.g. a trained one: a random model's near-uniform distributions understate the mismatch). Needs
``make vllm-env``. Writes ``benchmarks/results/vllm_cpu/<date>_<shape>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conf.schema import EngineOptions, ModelConfig, RolloutConfig  # noqa: E402 - after the repository is on sys.path
from generation.adapter import SCALING_KEY, sequence_logprobs  # noqa: E402
from generation.engines import make_engine  # noqa: E402
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, load_model, save_model  # noqa: E402
from generation.records import GenRequest, PromptItem  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "tiny_vllm": {
        k: v
        for k, v in yaml.safe_load((ROOT / "conf/model/tiny_vllm.yaml").read_text()).items()
        if k != "kind"
    },
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        max_seq_len=512,
        rope_theta=1e6,
    ),
}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def build_dir(shape: str, out: Path, seed: int = 0) -> Path:
    tok = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(**SHAPES[shape]), tok, seed=seed)
    save_model(model, tok, out)
    return out


def requests(tok, n: int, round_: int = 0) -> list[GenRequest]:
    items = [
        PromptItem(f"r{round_}p{i}", "", "", encode_prompt(tok, f"What is {i % 10} + {(i * 7) % 13}?"))
        for i in range(n)
    ]
    return [GenRequest(p, 0, group_uid=round_ * n + i) for i, p in enumerate(items)]


def start(kind: str, model_dir: Path, args, dtype: str, lora_rank: int = 0):
    t0 = time.perf_counter()
    opts = EngineOptions(
        capacity=args.completions,
        max_new_tokens=args.new_tokens,
        temperature=args.temperature,
        seed=0,
        lora_rank=lora_rank,
        rollout=RolloutConfig(engine=kind, dtype=dtype, vllm_enforce_eager=True),
    )
    eng = make_engine(str(model_dir), opts, device="cpu", env={"OMP_NUM_THREADS": "1"})
    return eng, time.perf_counter() - t0


def drain(eng, reqs) -> tuple[list, float]:
    t0 = time.perf_counter()
    eng.submit(reqs)
    out = []
    while len(out) < len(reqs):
        out += eng.step(8)
    return out, time.perf_counter() - t0


def throughput(eng, tok, args) -> list[dict]:
    rounds = []
    for r in range(args.rounds):
        out, s = drain(eng, requests(tok, args.completions, r + 1))
        n = sum(len(t.response_tokens) for t in out)
        rounds.append({"tokens": n, "seconds": round(s, 3), "tokens_per_s": round(n / s, 1)})
        print(f"  round {r + 1}: {n} tokens in {s:.2f} s = {n / s:.0f} tok/s", flush=True)
    return rounds


def random_full(model, seed: int) -> dict[str, np.ndarray]:
    """New full weights: the model's, each perturbed by N(0, 0.02^2) noise."""
    g = np.random.default_rng(seed)
    return {
        k: (v.detach().numpy() + 0.02 * g.standard_normal(v.shape)).astype(np.float32)
        for k, v in model.state_dict().items()
    }


def random_adapter(model_dir: Path, rank: int, seed: int) -> dict[str, np.ndarray]:
    """A published adapter (``generation.adapter``'s names): rank ``rank`` on every linear layer."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or h // cfg["num_attention_heads"])
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    dims |= {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    g = np.random.default_rng(seed)
    state = {SCALING_KEY: np.array([2.0], dtype=np.float32)}
    for i in range(layers):
        for lin in LINEARS:
            fan_in, fan_out = dims[lin.rsplit(".", 1)[1]]
            base = f"base_model.model.model.layers.{i}.{lin}"
            state[base + ".lora_A.weight"] = (g.standard_normal((rank, fan_in)) / fan_in**0.5).astype(
                np.float32
            )
            state[base + ".lora_B.weight"] = (0.01 * g.standard_normal((fan_out, rank))).astype(np.float32)
    return state


def update_latency(eng, tok, states, first_version: int) -> list[dict]:
    """Publish each state as a new version, then one request and one step: its first token."""
    out = []
    for i, state in enumerate(states):
        v = first_version + i
        t0 = time.perf_counter()
        eng.load_weights(v, state=state)
        t1 = time.perf_counter()
        eng.submit(requests(tok, 1, 1000 + v))
        eng.step(1)
        t2 = time.perf_counter()
        assert eng.status()["version"] == v
        eng.abort(None)
        out.append({"version": v, "load_s": round(t1 - t0, 4), "publish_to_first_token_s": round(t2 - t0, 4)})
        print(f"  version {v}: load {t1 - t0:.3f} s, publish -> first token {t2 - t0:.3f} s", flush=True)
    return out


def mismatch(trajs, trainer, temperature: float) -> dict:
    diffs, logw = [], []
    for t in trajs:
        resp = list(t.response_tokens)
        full = list(t.prompt.prompt_tokens) + resp
        lp = np.asarray(sequence_logprobs(trainer, full, temperature)[-len(resp) :])
        b = np.asarray(t.behaviour_logprobs)
        diffs.append(np.abs(lp - b))
        logw.append(lp - b)
    d, w = np.concatenate(diffs), np.exp(np.concatenate(logw))
    q = lambda a, p: float(np.quantile(a, p))  # noqa: E731 - a one-line helper
    return {
        "tokens": int(d.size),
        "abs_diff_mean": float(d.mean()),
        "abs_diff_p99": q(d, 0.99),
        "abs_diff_max": float(d.max()),
        "tis_weight": {
            "mean": float(w.mean()),
            "p1": q(w, 0.01),
            "p50": q(w, 0.5),
            "p99": q(w, 0.99),
            "min": float(w.min()),
            "max": float(w.max()),
            "frac_outside_0.5_2": float(np.mean((w < 0.5) | (w > 2))),
        },
    }


def reconcile(ckpt: Path) -> dict:
    run = json.loads((ckpt / "runtime.json").read_text())
    hist = [json.loads(line) for line in (ckpt / "history.jsonl").read_text().splitlines() if line]
    consumed = json.loads((ckpt / "consumed.json").read_text())
    uids = run["trained_uids"]
    gaps = [h["sampler_logprob_gap"] for h in hist]
    out = {
        "checkpoint": ckpt.name[:12],
        "updates": len(hist),
        "trained_groups": len(uids),
        "unique_groups": len(set(uids)),
        "trained_trajectories": int(sum(h["trained_trajectories"] for h in hist)),
        "consumed_trajectories": int(sum(consumed.values())),
        "generated_trajectories": int(sum(h["generated_trajectories"] for h in hist)),
        "stale_dropped_groups": run["stale_dropped"],
        "duplicates_ignored": run["duplicates_ignored"],
        "repacks": run["repacks"],
        "sampler_logprob_gap_mean": float(np.mean(gaps)),
        "sampler_logprob_gap_max": float(np.max(gaps)),
        "loop_seconds": round(run["loop_seconds"], 1),
    }
    out["trained_once"] = (
        out["trained_groups"] == out["unique_groups"]
        and out["trained_trajectories"] == out["consumed_trajectories"]
        and out["duplicates_ignored"] == 0
    )
    return out


def main() -> None:
    if sys.argv[1:2] == ["--reconcile"]:
        for d in sys.argv[2:]:
            print(json.dumps(reconcile(Path(d))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny_vllm")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--engines", default="vllm,torch")
    ap.add_argument("--parts", default="throughput,update,mismatch")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes of the mismatch part")
    ap.add_argument("--completions", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=0, help="also time adapter updates of this rank")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    parts = set(args.parts.split(","))
    tmp = tempfile.TemporaryDirectory(prefix="laminar-vllm-bench-")
    model_dir = Path(args.model_dir) if args.model_dir else build_dir(args.shape, Path(tmp.name) / "model")
    tok = build_char_tokenizer()
    trainer, _ = load_model(model_dir, "cpu")
    n_params = sum(p.numel() for p in trainer.parameters())
    result = {
        "date": datetime.date.today().isoformat(),
        "shape": args.shape,
        "model_dir": args.model_dir,
        "params": n_params,
        "completions": args.completions,
        "new_tokens": args.new_tokens,
        "temperature": args.temperature,
        "engines": {},
    }
    print(f"{args.shape}: {n_params / 1e6:.2f} M parameters", flush=True)
    for kind in args.engines.split(","):
        res = result["engines"].setdefault(kind, {})
        if parts & {"throughput", "update"}:
            eng, s = start(kind, model_dir, args, "float32")
            res["startup_s"] = round(s, 2)
            print(f"{kind}: started in {s:.1f} s", flush=True)
            if "throughput" in parts:
                res["throughput"] = throughput(eng, tok, args)
            if "update" in parts:
                states = (
                    random_full(trainer, seed) for seed in range(args.updates)
                )  # one in memory at a time
                res["update_full"] = update_latency(eng, tok, states, 1)
            eng.close()
            if "update" in parts and args.lora_rank:
                eng, s = start(kind, model_dir, args, "float32", lora_rank=args.lora_rank)
                print(f"{kind}: started for LoRA rank {args.lora_rank} in {s:.1f} s", flush=True)
                states = (random_adapter(model_dir, args.lora_rank, seed) for seed in range(args.updates))
                res[f"update_lora_r{args.lora_rank}"] = update_latency(eng, tok, states, 1)
                eng.close()
        if "mismatch" in parts:
            for dtype in args.dtypes.split(","):
                eng, s = start(kind, model_dir, args, dtype)
                out, _ = drain(eng, requests(tok, args.completions, 0))
                eng.close()
                res[f"mismatch_{dtype}"] = m = mismatch(out, trainer, args.temperature)
                print(
                    f"{kind} {dtype}: |diff| mean {m['abs_diff_mean']:.2e} p99 {m['abs_diff_p99']:.2e}; "
                    f"TIS weight p1 {m['tis_weight']['p1']:.4f} p50 {m['tis_weight']['p50']:.4f} "
                    f"p99 {m['tis_weight']['p99']:.4f} max {m['tis_weight']['max']:.4f}",
                    flush=True,
                )
    out = (
        Path(args.out)
        if args.out
        else ROOT / f"benchmarks/results/vllm_cpu/{result['date']}_{args.shape}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
