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

``--decode-table SMOLLM2_DIR``: the decode table beside ``benchmarks/engine_smollm2.py``, on the same
prompts (its ``prompts`` through the same templates) and new-token count (16, EOS off: every side
decodes the full length), at batch 1, 16, 64 and 128, on SmolLM2-135M-Instruct and the tiny model in
the shape vLLM's CPU build runs (``tiny_vllm``: head_dim 32; the default tiny's head_dim 16 is not a
head size vLLM's CPU attention takes): vLLM's tokens/s per batch and dtype, and the project's engine
(fp32 and bf16, its default decode paths) measured interleaved with it, per batch, in the same run
(the ratios are the result; absolute numbers move with the machine's load, recorded per row). vLLM
runs in its own environment (``LAMINAR_VLLM_PYTHON`` or ``.venv-vllm``) as a worker process that
stays up for the whole table (started once per model and dtype, ``enforce_eager`` unless
``--compile``; no prefix caching, which would skip the repeated prompts' prefill). Then the log-prob
mismatch on the same tokens: vLLM's behaviour log-probs (fp32, and bf16 with ``--vllm-dtypes``) and
the engine's (fp32, bf16) against the trainer's float32 recomputation of the very tokens each sampled.
Writes ``--out`` (JSON, rewritten after every row).

    .venv/bin/python benchmarks/vllm_cpu.py --decode-table WS/artifacts/pretrained/<sha> --threads 1 \
        --out benchmarks/results/vllm_cpu/vllm_cpu_smollm2_2026-12-06.json

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


# ------------------------------------------------------------------------------ --decode-table


def decode_worker(argv: list[str]) -> None:
    """vLLM's side of the decode table, in vLLM's environment: starts ``vllm.LLM`` once, then answers
    JSON lines on stdin (``decode``: best seconds of ``repeats`` timed runs after one warm-up;
    ``sample``: tokens and behaviour log-probs) on the stdout it started with (vLLM logs to stderr)."""
    import os

    ap = argparse.ArgumentParser()
    for k in ("--model-dir", "--dtype"):
        ap.add_argument(k, required=True)
    ap.add_argument("--capacity", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints and logs go to stderr; stdout is the protocol
    from vllm import LLM, SamplingParams

    cfg = json.loads((Path(a.model_dir) / "config.json").read_text())
    max_len = min(a.max_model_len, cfg.get("max_position_embeddings") or a.max_model_len)
    t0 = time.perf_counter()
    llm = LLM(
        model=a.model_dir,
        tokenizer=a.model_dir,
        dtype=a.dtype,
        seed=0,
        max_num_seqs=a.capacity,
        max_model_len=max_len,
        enforce_eager=not a.compile,
        enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
    )
    import vllm

    proto.write(json.dumps({"startup_s": time.perf_counter() - t0, "vllm": vllm.__version__}) + "\n")

    def run(prompts, new_tokens, logprobs=None):
        sp = SamplingParams(
            temperature=1.0,
            top_p=1.0,
            max_tokens=new_tokens,
            ignore_eos=True,  # not min_tokens: that masks EOS, which shifts every log-prob
            logprobs=logprobs,
            detokenize=False,
        )
        return llm.generate([{"prompt_token_ids": q} for q in prompts], sp, use_tqdm=False)

    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "decode":
            lp = req.get("logprobs")  # 0: each sampled token's log-prob, as an RL rollout needs
            run(req["prompts"], req["new_tokens"], lp)  # warm-up
            best, n = float("inf"), 0
            for _ in range(req["repeats"]):
                t = time.perf_counter()
                outs = run(req["prompts"], req["new_tokens"], lp)
                best = min(best, time.perf_counter() - t)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
            proto.write(json.dumps({"seconds": best, "tokens": n}) + "\n")
        else:  # sample
            outs = run(req["prompts"], req["new_tokens"], logprobs=0)
            rows = []
            for o in outs:
                c = o.outputs[0]
                rows.append([list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]])
            proto.write(json.dumps({"samples": rows}) + "\n")


class VllmDecoder:
    """The decode worker process (``decode_worker``) from the driver's side."""

    def __init__(self, model_dir: Path, dtype: str, args):
        import os
        import subprocess

        from generation.engines import vllm_python
        from generation.vllm_worker import cpu_defaults

        py = vllm_python(None)
        if py is None:
            raise SystemExit("--decode-table needs vLLM's environment: make vllm-env, or LAMINAR_VLLM_PYTHON")
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB: SmolLM2's 128 x ~80 tokens need 0.5
        cpu_defaults(env)
        cmd = [py, __file__, "--decode-worker", "--model-dir", str(model_dir), "--dtype", dtype]
        cmd += ["--capacity", str(max(args.batches))] + (["--compile"] if args.compile else [])
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._read()
        self.ready["wall_startup_s"] = time.perf_counter() - t0

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM decode worker exited ({self.proc.wait()}): see its stderr above")
        return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.ask(op="quit")
        except (BrokenPipeError, RuntimeError, ValueError):
            pass
        self.proc.wait(timeout=120)


def uptime() -> str:
    import subprocess

    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def table_models(args, tmp: Path):
    """(name, model folder, template) of the table, in ``--models``' order: SmolLM2 and the tiny model
    in vLLM's shape."""
    tiny = build_dir("tiny_vllm", tmp / "tiny_vllm")
    out = [("smollm2", Path(args.decode_table), None), ("tiny_vllm", tiny, "{problem}\n")]
    return sorted((m for m in out if m[0] in args.models), key=lambda m: args.models.index(m[0]))


def logprob_gap(model, samples, prompts_ids, temperature: float = 1.0) -> dict:
    """``mismatch`` of (tokens, behaviour log-probs) sampled for ``prompts_ids`` against ``model``."""
    from types import SimpleNamespace as NS

    trajs = [
        NS(prompt=NS(prompt_tokens=p), response_tokens=t, behaviour_logprobs=b)
        for p, (t, b) in zip(prompts_ids, samples)
    ]
    return mismatch(trajs, model, temperature)


def engine_samples(model, tok, items, new_tokens: int, dtype: str) -> list:
    from generation.engine import Engine

    rollout = RolloutConfig(dtype=dtype)
    eng = Engine(model, tok, EngineOptions(capacity=len(items), max_new_tokens=new_tokens, rollout=rollout))
    eng.eos_id = -1
    out = eng.generate([GenRequest(p, 0) for p in items], new_tokens, 1.0, seed=0)
    return [(list(t.response_tokens), list(t.behaviour_logprobs)) for t in out]


def engine_tps(model, tok, items, new_tokens: int, dtype: str, repeats: int) -> float:
    """The engine's decode tokens/s over ``items`` with ``model`` cast to ``dtype`` in place (the
    caller casts it back): one warm-up, then the best of ``repeats`` (``engine_smollm2``'s engine side)."""
    from benchmarks.engine_smollm2 import _best_seconds, engine_side

    run = engine_side(model.to(getattr(torch, dtype)), tok, items, new_tokens)
    run()  # warm-up (and the native kernels' build, once per machine)
    return len(items) * new_tokens / _best_seconds(run, repeats)


def decode_rows(name, model, tok, template, vllm: dict, args, result, save) -> None:
    """Per batch size: vLLM (each started dtype) and the engine (fp32, bf16), alternating who goes first."""
    from benchmarks.engine_smollm2 import SMOLLM2_TEMPLATE, prompts

    table = result["models"][name].setdefault("batches", {})
    for i, batch in enumerate(args.batches):
        if str(batch) in table:
            continue  # --resume: measured already
        items = prompts(tok, template or SMOLLM2_TEMPLATE, batch)
        ids = [list(p.prompt_tokens) for p in items]
        row = {"load_before": uptime()}
        sides = [(f"vllm_{d}", d) for d in vllm] + [("engine_fp32", "float32"), ("engine_bf16", "bfloat16")]
        for key, dtype in sides if i % 2 == 0 else sides[::-1]:
            if key.startswith("vllm"):
                r = vllm[dtype].ask(
                    op="decode",
                    prompts=ids,
                    new_tokens=args.new_tokens,
                    repeats=args.repeats,
                    logprobs=0 if args.vllm_logprobs else None,
                )
                assert r["tokens"] == batch * args.new_tokens, r
                row[key] = r["tokens"] / r["seconds"]
            else:
                row[key] = engine_tps(model, tok, items, args.new_tokens, dtype, args.repeats)
            model.float()
        for d in vllm:
            row[f"engine_fp32_over_vllm_{d}"] = row["engine_fp32"] / row[f"vllm_{d}"]
            row[f"engine_bf16_over_vllm_{d}"] = row["engine_bf16"] / row[f"vllm_{d}"]
        row["load_after"] = uptime()
        table[str(batch)] = row
        print(
            f"{name} batch {batch}: "
            + "  ".join(f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float)),
            flush=True,
        )
        save()


def mismatch_rows(name, model, tok, template, vllm: dict, args, result, save) -> None:
    from benchmarks.engine_smollm2 import SMOLLM2_TEMPLATE, prompts

    items = prompts(tok, template or SMOLLM2_TEMPLATE, args.mismatch_prompts)
    ids = [list(p.prompt_tokens) for p in items]
    res = result["models"][name].setdefault("mismatch_vs_trainer_fp32", {})
    if res:
        return  # --resume: measured already
    for d, w in vllm.items():
        samples = w.ask(op="sample", prompts=ids, new_tokens=args.new_tokens)["samples"]
        res[f"vllm_{d}"] = logprob_gap(model, samples, ids)
    for d in ("float32", "bfloat16"):
        samples = engine_samples(model, tok, items, args.new_tokens, d)
        model.float()  # the trainer's float32 (a bf16 engine may have cast the model it was given)
        res[f"engine_{d}"] = logprob_gap(model, samples, ids)
    for k, m in res.items():
        print(
            f"{name} {k}: |diff| mean {m['abs_diff_mean']:.2e} p99 {m['abs_diff_p99']:.2e} "
            f"TIS p1 {m['tis_weight']['p1']:.4f} p99 {m['tis_weight']['p99']:.4f}",
            flush=True,
        )
    save()


def decode_table(args) -> None:
    torch.set_num_threads(args.threads)
    out = Path(
        args.out or ROOT / f"benchmarks/results/vllm_cpu/vllm_cpu_smollm2_{datetime.date.today()}.json"
    )
    result = {
        "date": datetime.date.today().isoformat(),
        "threads": args.threads,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "batches": args.batches,
        "vllm_dtypes": args.vllm_dtypes,
        "enforce_eager": not args.compile,
        "vllm_logprobs": args.vllm_logprobs,
        "uptime_start": uptime(),
        "models": {},
    }
    if args.resume and out.is_file():  # a run cut short (OOM, deadline): keep its rows, measure the rest
        old = json.loads(out.read_text())
        result["models"] = old["models"]
        result["resumed_from"] = {k: old.get(k) for k in ("uptime_start", "uptime_last")}

    def save() -> None:
        result["uptime_last"] = uptime()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="laminar-vllm-table-") as tmp:
        for name, model_dir, template in table_models(args, Path(tmp)):
            model, tok = load_model(model_dir, "cpu")
            model.eval()
            entry = result["models"].setdefault(name, {})
            entry["model_dir"] = str(model_dir) if name == "smollm2" else None
            entry["parameters"] = sum(p.numel() for p in model.parameters())
            vllm = {}
            try:
                for d in args.vllm_dtypes:
                    vllm[d] = VllmDecoder(model_dir, d, args)
                    entry.setdefault(f"vllm_{d}_startups", []).append(vllm[d].ready)
                    print(f"{name}: vLLM {d} started {vllm[d].ready}", flush=True)
                    save()
                mismatch_rows(name, model, tok, template, vllm, args, result, save)
                decode_rows(name, model, tok, template, vllm, args, result, save)
            finally:
                for w in vllm.values():
                    w.close()
    print(f"wrote {out}")


def decode_table_args(argv: list[str]):
    ap = argparse.ArgumentParser(description="vLLM CPU decode table beside benchmarks/engine_smollm2.py")
    ap.add_argument("--decode-table", required=True, metavar="SMOLLM2_DIR")
    ap.add_argument("--models", nargs="+", default=["smollm2", "tiny_vllm"], choices=["smollm2", "tiny_vllm"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm-dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--mismatch-prompts", type=int, default=16)
    ap.add_argument(
        "--compile", action="store_true", help="let vLLM compile the model (default: enforce_eager)"
    )
    ap.add_argument(
        "--vllm-logprobs",
        action="store_true",
        help="vLLM returns each sampled token's log-prob, as the engine does (what RL needs)",
    )
    ap.add_argument("--resume", action="store_true", help="keep --out's rows, measure only the missing")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main() -> None:
    if sys.argv[1:2] == ["--decode-worker"]:
        return decode_worker(sys.argv[2:])
    if any(a == "--decode-table" or a.startswith("--decode-table=") for a in sys.argv[1:]):
        return decode_table(decode_table_args(sys.argv[1:]))
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
