"""The rollout worker process: serves one engine over the rollout protocol's wire format on
stdin/stdout (``generation.protocol``).

    python -m generation.vllm_worker --engine vllm  --model-dir DIR [--capacity 256 ...]
    python -m generation.vllm_worker --engine torch --model-dir DIR [--device cuda ...]

``--engine vllm`` runs in vLLM's own environment (``make vllm-env``; vLLM pins torch, transformers and
fastapi against Prefect's) and imports only vLLM, this module and the protocol module (standard
library, numpy, msgpack, the plain records). ``--engine torch`` hosts the built-in engine behind the
same loop, so the wire path is tested without vLLM.

vLLM is driven through its documented offline interfaces: ``vllm.LLM`` and its ``llm_engine``
(``add_request`` / ``step`` / ``abort_request``), ``SamplingParams(logprobs=0, seed=...)`` with the
engine option ``logprobs_mode="processed_logprobs"`` (the sampled token's log-prob under the
temperature-scaled distribution: the behaviour log-prob the objectives need), and new weights through
``LLM.collective_rpc`` into a worker extension (``WeightLoader``, passed as ``worker_extension_cls``)
whose method reads a safetensors file and calls the model's ``load_weights``; the prefix cache is
reset afterwards so no key/value computed by old weights is reused.

Semantics the runtime relies on, kept by ``VllmEngine``:
- admission is ours: at most ``capacity`` sequences live in vLLM, the rest wait in a queue we can
  abort from and that ``admitting=False`` holds back; injected partials go first;
- a partial is continued by submitting prompt + its tokens as the prompt, with the remaining token
  budget; its earlier tokens and log-probs are prepended to the result;
- ``load_weights`` with sequences live aborts them and re-queues them as partials (they continue under
  the new weights, by re-prefill, like the built-in engine's ``partial`` mode; ``last_version`` says so);
- full-vocabulary entropies are not available from vLLM: ``mean_entropy`` is NaN.
Unlike the built-in engine's counter-hash sampler, a vLLM continuation after a hand-over is not the
uninterrupted one (its seeded generator restarts), only a valid sample from the same policy.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from generation.protocol import (EngineBase, PendingQueue, ProtocolError, SamplingSpec, protocol_streams,
                                  request_id, serve)
from generation.records import GenRequest, Partial, Trajectory


class WeightLoader:
    """vLLM worker extension (``worker_extension_cls="generation.vllm_worker.WeightLoader"``): vLLM
    mixes it into its GPU worker class, so ``self.model_runner`` is the worker's model runner.
    Called through ``LLM.collective_rpc("laminar_load_weights", args=(path,))`` on every worker."""

    def laminar_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model  # unwrapped (no graph wrapper)
        model.load_weights(weights=weights.items())
        return len(weights)


@dataclass
class _Live:
    request: GenRequest
    prefix_tokens: list[int]
    prefix_logprobs: list[float]
    version: int             # version that sampled the first token
    last_version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def _tensor_names(paths: Sequence[str]) -> set[str]:
    """The tensor names in safetensors files (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for p in paths:
        with safe_open(p, framework="numpy") as f:
            names.update(f.keys())
    return names


def _seed_for(seed: int, rid: tuple, offset: int) -> int:
    """A per-request sampler seed (stable across processes): the same request draws the same tokens
    whatever else is in the batch."""
    h = hashlib.blake2b(repr((seed, rid, offset)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


class VllmEngine(EngineBase):
    """``RolloutEngine`` over vLLM's ``LLMEngine`` (see the module docstring)."""

    engine_name = "vllm"

    def __init__(self, model_dir: str, *, capacity: int, max_new_tokens: int, temperature: float, seed: int,
                 dtype: str = "auto", gpu_memory_utilization: float = 0.85, enforce_eager: bool = False,
                 max_model_len: int | None = None):
        from vllm import LLM

        self.capacity = int(capacity)
        self.sampling = SamplingSpec(float(temperature), int(max_new_tokens), int(seed))
        kwargs = dict(model=model_dir, tokenizer=model_dir, dtype=dtype, seed=int(seed), max_num_seqs=self.capacity,
                      gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                      logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                      worker_extension_cls=f"{__name__ if __name__ != '__main__' else 'generation.vllm_worker'}"
                                           ".WeightLoader")
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        tok = self.llm.get_tokenizer()
        self.tokenizer = tok
        self.eos_id = -1 if tok.eos_token_id is None else int(tok.eos_token_id)
        self.version = 0
        self.admitting = True
        self._names = _tensor_names(sorted(str(p) for p in Path(model_dir).glob("*.safetensors")))
        self._pending = PendingQueue()
        self._live: dict[str, _Live] = {}
        self._out: list[Trajectory] = []

    # -- vLLM plumbing
    def _rid(self, req: GenRequest) -> str:
        return repr(request_id(req))

    def _params(self, rid: tuple, done: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(n=1, temperature=self.sampling.temperature, top_p=1.0,
                              max_tokens=self.sampling.max_new_tokens - done, logprobs=0,
                              seed=_seed_for(self.sampling.seed, rid, done), detokenize=False,
                              output_kind=RequestOutputKind.DELTA)

    def _add(self, req: GenRequest, toks: Sequence[int], lps: Sequence[float], version: int | None) -> None:
        rid = request_id(req)
        prompt = {"prompt_token_ids": list(req.prompt.prompt_tokens) + list(toks)}
        self.engine.add_request(self._rid(req), prompt, self._params(rid, len(toks)))
        v = self.version if version is None else version
        self._live[self._rid(req)] = _Live(req, list(toks), list(lps), v, self.version)

    def _finish(self, live: _Live) -> Trajectory:
        ids = live.prefix_tokens + live.tokens
        lps = live.prefix_logprobs + live.logprobs
        finished = bool(ids) and ids[-1] == self.eos_id
        body = ids[:-1] if finished else ids
        return Trajectory(kind="trajectory", prompt=live.request.prompt, sample_idx=live.request.sample_idx,
                          response_tokens=tuple(ids), behaviour_logprobs=tuple(lps), version=live.version,
                          finished=finished, text=self.tokenizer.decode(body, skip_special_tokens=True),
                          mean_entropy=math.nan, group_uid=live.request.group_uid, last_version=live.last_version)

    def _admit(self) -> None:
        while len(self._live) < self.capacity and (self._pending.partials or (self.admitting and self._pending.requests)):
            if self._pending.partials:
                p = self._pending.partials.popleft()
                if p.tokens and (len(p.tokens) >= self.sampling.max_new_tokens or p.tokens[-1] == self.eos_id):
                    live = _Live(p.request, list(p.tokens), list(p.logprobs), p.version, p.version)
                    self._out.append(self._finish(live))
                    continue
                self._add(p.request, p.tokens, p.logprobs, p.version if p.tokens else None)
            else:
                self._add(self._pending.requests.popleft(), (), (), None)

    # -- RolloutEngine
    def submit(self, requests: Sequence[GenRequest], sampling: SamplingSpec | None = None) -> None:
        self.check_sampling(sampling)
        self._pending.requests.extend(requests)

    def inject(self, partials: Sequence[Partial]) -> None:
        self._pending.partials.extend(partials)

    def step(self, max_steps: int) -> list[Trajectory]:
        self._admit()
        for _ in range(max_steps):
            if not self._live:
                break
            for out in self.engine.step():
                live = self._live.get(out.request_id)
                if live is None:
                    continue
                comp = out.outputs[0]
                live.tokens.extend(int(t) for t in comp.token_ids)
                if comp.token_ids:
                    live.last_version = self.version
                for tok, entry in zip(comp.token_ids, comp.logprobs or []):
                    live.logprobs.append(float(entry[tok].logprob))
                if len(live.logprobs) != len(live.tokens):
                    raise ProtocolError(f"vLLM returned {len(live.tokens)} tokens but {len(live.logprobs)} "
                                        f"log-probs for {out.request_id}")
                if out.finished:
                    self._out.append(self._finish(self._live.pop(out.request_id)))
            self._admit()
        done, self._out = self._out, []
        return done

    def abort(self, request_ids: Iterable | None = None,
              include_queued: bool = True) -> tuple[list[Partial], list[GenRequest]]:
        ids = None if request_ids is None else {tuple(i) for i in request_ids}
        parts: list[Partial] = []
        reqs: list[GenRequest] = []
        if include_queued:
            parts, reqs = self._pending.take(ids)
        gone = [k for k, lv in self._live.items() if ids is None or request_id(lv.request) in ids]
        if gone:
            self.engine.abort_request(gone)
        for k in gone:
            lv = self._live.pop(k)
            toks, lps = lv.prefix_tokens + lv.tokens, lv.prefix_logprobs + lv.logprobs
            parts.append(Partial(lv.request, tuple(toks), tuple(lps), lv.version if toks else self.version))
        return parts, reqs

    def load_weights(self, version: int, state: Mapping | None = None, path: str | None = None) -> None:
        if path is None:
            raise ProtocolError("the vLLM engine loads weights from a safetensors file (path=...)")
        missing = self._names - _tensor_names([path])
        if missing:  # vLLM would load a partial set silently: refuse, as the built-in engine does
            raise ProtocolError(f"load_weights: missing {sorted(missing)[:5]} ({len(missing)} tensors of the "
                                "checkpoint are not in the file)")
        live, _ = self.abort(None, include_queued=False) if self._live else ([], [])
        self.llm.collective_rpc("laminar_load_weights", args=(path,))
        self.llm.reset_prefix_cache()
        self.version = int(version)
        self._pending.partials.extendleft(reversed(live))  # continue under the new weights, first in line

    def status(self) -> dict:
        kv = sum(len(lv.request.prompt.prompt_tokens) + len(lv.prefix_tokens) + len(lv.tokens)
                 for lv in self._live.values())
        return {"version": self.version, "queued": len(self._pending), "active": len(self._live),
                "capacity": self.capacity, "kv_tokens": kv, "admitting": self.admitting}

    def close(self) -> None:
        self.llm = None


def build_engine(args):
    if args.engine == "vllm":
        return VllmEngine(args.model_dir, capacity=args.capacity, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, seed=args.seed,
                          dtype="auto" if args.dtype == "auto" else args.dtype,
                          gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                          enforce_eager=args.vllm_enforce_eager, max_model_len=args.vllm_max_model_len)
    if args.engine == "torch":
        from generation.engines import load_torch_engine
        from generation.setup import setup_torch

        setup_torch(int(os.environ.get("OMP_NUM_THREADS", "1")), args.seed)
        return load_torch_engine(args.model_dir, device=args.device, capacity=args.capacity,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                                 dtype=args.dtype, sync_every=args.sync_every, static_cache=args.static_cache,
                                 cuda_graphs=args.cuda_graphs)
    raise SystemExit(f"unknown engine {args.engine!r}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "torch"), required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sync-every", type=int, default=0)
    ap.add_argument("--static-cache", action="store_true", help="torch engine: static slot cache")
    ap.add_argument("--cuda-graphs", action="store_true", help="torch engine: CUDA-graph decode (CUDA only)")
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--vllm-enforce-eager", action="store_true")
    ap.add_argument("--vllm-max-model-len", type=int, default=0)
    args = ap.parse_args(argv)
    rfile, wfile = protocol_streams()  # before anything can print to stdout
    t0 = time.perf_counter()
    engine = build_engine(args)
    info = {"engine": args.engine, "pid": os.getpid(), "temperature": engine.sampling.temperature,
            "max_new_tokens": engine.sampling.max_new_tokens, "seed": engine.sampling.seed,
            "features": {"deterministic_handover": args.engine == "torch", "entropy": args.engine == "torch"},
            "startup_s": time.perf_counter() - t0}
    serve(engine, rfile, wfile, info)
    engine.close()


if __name__ == "__main__":
    sys.exit(main())
