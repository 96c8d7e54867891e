"""The rollout worker process: serves one engine over the rollout protocol's wire format on
stdin/stdout (``generation.protocol``).

    python -m generation.vllm_worker --engine vllm  --model-dir DIR [--capacity 256 ...]
    python -m generation.vllm_worker --engine torch --model-dir DIR [--device cuda ...]

``--engine vllm`` runs in vLLM's own environment (``make vllm-env``; vLLM pins torch, transformers and
fastapi against Prefect's) and imports only vLLM, this module, the protocol module and
``generation.adapter``'s names and ``conf.schema``'s (standard library, numpy, msgpack, the plain
records; torch only inside the adapter functions the worker never calls). ``--engine torch`` hosts the
built-in engine behind the same loop, so the wire path is tested without vLLM.

vLLM is driven through its documented offline interfaces: ``vllm.LLM`` and its ``llm_engine``
(``add_request`` / ``step`` / ``abort_request``), ``SamplingParams(logprobs=0, seed=...)`` with the
engine option ``logprobs_mode="processed_logprobs"`` (the sampled token's log-prob under the
temperature-scaled distribution: the behaviour log-prob the objectives need), and new weights through
``LLM.collective_rpc`` into a worker extension (``WeightLoader``, passed as ``worker_extension_cls``)
whose method reads a safetensors file and hands it to the worker's own in-place weight update
(``reload_weights``, which also redoes the CPU build's weight repacking); the prefix cache is reset
afterwards so no key/value computed by old weights is reused.

LoRA (``--lora-rank R``, for a ``model.lora`` RL run): the ``--model-dir`` is the bare base, vLLM is
started with ``enable_lora=True, max_lora_rank=<R rounded up to a rank vLLM accepts>, max_loras=1``,
and a published version that is an adapter (``generation.adapter``: PEFT's tensor names plus the
scaling) is not merged but written once, as a PEFT folder (``adapter_config.json`` +
``adapter_model.safetensors``), under this worker's folder in shared memory; from then on every
request is submitted with ``lora_request=LoRARequest("laminar-v<version>", <a new id>, <folder>)``, and
the previous version's folder is deleted and its adapter removed from vLLM. The id is new for every
load because vLLM caches adapters by id, not by path: a version is never served from the cache entry
of another, whatever vLLM still holds.

Semantics the runtime relies on, kept by ``VllmEngine``:
- admission is ours: at most ``capacity`` sequences live in vLLM, the rest wait in a queue we can
  abort from and that ``admitting=False`` holds back; injected partials go first;
- a partial is continued by submitting prompt + its tokens as the prompt, with the remaining token
  budget; its earlier tokens and log-probs are prepended to the result;
- ``load_weights`` with sequences live aborts them and re-queues them as partials (they continue under
  the new weights, by re-prefill, like the built-in engine's ``partial`` mode; ``last_version`` says so);
  an adapter version does the same, so every vLLM request is sampled under one adapter from start to end;
- full-vocabulary entropies are not available from vLLM: ``mean_entropy`` is NaN.
Unlike the built-in engine's counter-hash sampler, a vLLM continuation after a hand-over is not the
uninterrupted one (its seeded generator restarts), only a valid sample from the same policy.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable, Mapping, MutableMapping, Sequence

import numpy as np

from conf.schema import VLLM_LORA_RANKS, EngineOptions, RolloutConfig
from generation.adapter import ADAPTER_CONFIG, SCALING_KEY, adapter_pairs
from generation.protocol import (
    EngineBase,
    PendingQueue,
    ProtocolError,
    SamplingSpec,
    protocol_streams,
    request_id,
    serve,
    weights_dir,
)
from generation.records import GenRequest, Partial, Trajectory


class WeightLoader:
    """vLLM worker extension (``worker_extension_cls="generation.vllm_worker.WeightLoader"``): vLLM
    mixes it into its worker class. Called through ``LLM.collective_rpc("laminar_load_weights",
    args=(path,))`` on every worker: the weights go through the worker's own in-place update,
    ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``, which re-runs the kernel-format
    processing after loading (vLLM's CPU build repacks linear weights at start: a plain
    ``model.load_weights`` then fails on the emptied parameters)."""

    def laminar_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)


@dataclass
class _Live:
    request: GenRequest
    prefix_tokens: list[int]
    prefix_logprobs: list[float]
    version: int  # version that sampled the first token
    last_version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def _tensor_shapes(paths: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the tensors in safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for p in paths:
        with safe_open(p, framework="numpy") as f:
            for k in f.keys():
                shapes[k] = tuple(f.get_slice(k).get_shape())
    return shapes


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of rank ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(
        f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]}); "
        "lower model.lora.rank or use rollout.engine=torch"
    )


def write_adapter_folder(state: Mapping[str, np.ndarray], out_dir: str | Path, base_model: str) -> int:
    """Write a published adapter (``generation.adapter``: PEFT's saved names + ``SCALING_KEY``) as a PEFT
    folder that vLLM (and ``peft.PeftModel.from_pretrained``) loads: ``adapter_model.safetensors`` with
    the tensors under their names, ``adapter_config.json`` with ``r`` (from lora_A's rows),
    ``lora_alpha = scaling * r`` (both read alpha / r as the scaling) and the adapted module kinds as
    ``target_modules``. Safetensors only, never pickle. Returns the rank."""
    from safetensors.numpy import save_file

    pairs = adapter_pairs(state)
    if not pairs:
        raise ValueError("published adapter: no lora_A/lora_B tensors")
    ranks = {a.shape[0] for a, _ in pairs.values()}
    if len(ranks) != 1:  # one r in adapter_config.json: a per-module rank would need rank_pattern
        raise ValueError(f"published adapter: its modules have different ranks {sorted(ranks)}")
    rank = ranks.pop()
    scaling = float(np.asarray(state[SCALING_KEY]).reshape(-1)[0])
    if not math.isfinite(scaling):
        raise ValueError(f"published adapter: scaling {scaling} is not finite")
    alpha = scaling * rank
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({name[: -len(".weight")].rsplit(".", 1)[-1] for name in pairs}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    out = Path(out_dir)
    out.mkdir(parents=True)
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items() if k != SCALING_KEY},
        str(out / "adapter_model.safetensors"),
    )
    with open(out / ADAPTER_CONFIG, "w") as f:
        json.dump(config, f, indent=2)
    return rank


def _seed_for(seed: int, rid: tuple, offset: int) -> int:
    """A per-request sampler seed (stable across processes): the same request draws the same tokens
    whatever else is in the batch."""
    h = hashlib.blake2b(repr((seed, rid, offset)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


DEFAULTS = EngineOptions()
"""The engine options' defaults (``conf.schema.EngineOptions``: vLLM's knobs in its ``rollout``)."""


class VllmEngine(EngineBase):
    """``RolloutEngine`` over vLLM's ``LLMEngine`` (see the module docstring)."""

    engine_name = "vllm"

    def __init__(
        self,
        model_dir: str,
        *,
        capacity: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        dtype: str = DEFAULTS.rollout.dtype,
        gpu_memory_utilization: float = DEFAULTS.rollout.vllm_gpu_memory_utilization,
        enforce_eager: bool = DEFAULTS.rollout.vllm_enforce_eager,
        max_model_len: int | None = None,
        lora_rank: int = DEFAULTS.lora_rank,
    ):
        from vllm import LLM

        self.capacity = int(capacity)
        self.sampling = SamplingSpec(float(temperature), int(max_new_tokens), int(seed))
        kwargs = dict(
            model=model_dir,
            tokenizer=model_dir,
            dtype=dtype,
            seed=int(seed),
            max_num_seqs=self.capacity,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            worker_extension_cls=f"{__name__ if __name__ != '__main__' else 'generation.vllm_worker'}"
            ".WeightLoader",
        )
        if max_model_len:
            kwargs["max_model_len"] = int(max_model_len)
        if lora_rank < 0:
            raise ValueError(f"--lora-rank {lora_rank} must be >= 0 (0: no LoRA)")
        self.max_lora_rank = vllm_max_lora_rank(lora_rank) if lora_rank else 0
        if self.max_lora_rank:  # one adapter at a time: a load aborts every request of the one before
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        self.model_dir = str(Path(model_dir).resolve())
        self.lora_request = None  # the LoRARequest new requests are submitted with (None: the base)
        self._lora_root: str | None = None
        self._next_lora_id = 1
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        tok = self.llm.get_tokenizer()
        self.tokenizer = tok
        self.eos_id = -1 if tok.eos_token_id is None else int(tok.eos_token_id)
        self.version = 0
        self.admitting = True
        self._shapes = _tensor_shapes(sorted(str(p) for p in Path(model_dir).glob("*.safetensors")))
        self._names = set(self._shapes)
        self._pending = PendingQueue()
        self._live: dict[str, _Live] = {}
        self._out: list[Trajectory] = []

    # -- vLLM plumbing
    def _rid(self, req: GenRequest) -> str:
        return repr(request_id(req))

    def _params(self, rid: tuple, done: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=self.sampling.temperature,
            top_p=1.0,
            max_tokens=self.sampling.max_new_tokens - done,
            logprobs=0,
            seed=_seed_for(self.sampling.seed, rid, done),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _add(self, req: GenRequest, toks: Sequence[int], lps: Sequence[float], version: int | None) -> None:
        rid = request_id(req)
        prompt = {"prompt_token_ids": list(req.prompt.prompt_tokens) + list(toks)}
        self.engine.add_request(
            self._rid(req), prompt, self._params(rid, len(toks)), lora_request=self.lora_request
        )
        v = self.version if version is None else version
        self._live[self._rid(req)] = _Live(req, list(toks), list(lps), v, self.version)

    def _finish(self, live: _Live) -> Trajectory:
        ids = live.prefix_tokens + live.tokens
        lps = live.prefix_logprobs + live.logprobs
        finished = bool(ids) and ids[-1] == self.eos_id
        body = ids[:-1] if finished else ids
        return Trajectory(
            kind="trajectory",
            prompt=live.request.prompt,
            sample_idx=live.request.sample_idx,
            response_tokens=tuple(ids),
            behaviour_logprobs=tuple(lps),
            version=live.version,
            finished=finished,
            text=self.tokenizer.decode(body, skip_special_tokens=True),
            mean_entropy=math.nan,
            group_uid=live.request.group_uid,
            last_version=live.last_version,
        )

    def _admit(self) -> None:
        while len(self._live) < self.capacity and (
            self._pending.partials or (self.admitting and self._pending.requests)
        ):
            if self._pending.partials:
                p = self._pending.partials.popleft()
                if p.tokens and (
                    len(p.tokens) >= self.sampling.max_new_tokens or p.tokens[-1] == self.eos_id
                ):
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
                    raise ProtocolError(
                        f"vLLM returned {len(live.tokens)} tokens but {len(live.logprobs)} "
                        f"log-probs for {out.request_id}"
                    )
                if out.finished:
                    self._out.append(self._finish(self._live.pop(out.request_id)))
            self._admit()
        done, self._out = self._out, []
        return done

    def abort(
        self, request_ids: Iterable | None = None, include_queued: bool = True
    ) -> tuple[list[Partial], list[GenRequest]]:
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
        shapes = _tensor_shapes([path])
        names = set(shapes)
        if SCALING_KEY in names:
            self._load_adapter(int(version), path)
            return
        missing = self._names - names
        if missing:  # vLLM would load a partial set silently: refuse, as the built-in engine does
            raise ProtocolError(
                f"load_weights: missing {sorted(missing)[:5]} ({len(missing)} tensors of the "
                "checkpoint are not in the file)"
            )
        wrong = sorted(n for n in self._names if tuple(shapes[n]) != tuple(self._shapes[n]))
        if wrong:  # refused here, before vLLM's loader fails inside its worker
            n = wrong[0]
            raise ProtocolError(
                f"load_weights: {n} has shape {tuple(shapes[n])}, the model has {tuple(self._shapes[n])} "
                f"({len(wrong)} tensors of the wrong shape)"
            )
        live, _ = self.abort(None, include_queued=False) if self._live else ([], [])
        self.llm.collective_rpc("laminar_load_weights", args=(path,))
        self.llm.reset_prefix_cache()
        self._drop_adapter()  # new full weights: requests go to them, not to an adapter on the old ones
        self.version = int(version)
        self._pending.partials.extendleft(reversed(live))  # continue under the new weights, first in line

    def _check_adapter(self, version: int, state: Mapping[str, np.ndarray]) -> None:
        """Refuse, before anything changes, an adapter vLLM would refuse or apply to the wrong weights."""
        if not self.max_lora_rank:
            raise ProtocolError(
                f"load_weights: version {version} is a LoRA adapter but this vLLM worker was started "
                "without --lora-rank (make_engine(..., lora_rank=R)); start it with the adapter's rank"
            )
        try:
            pairs = adapter_pairs(state)
        except KeyError as e:
            raise ProtocolError(f"load_weights: version {version}: {e.args[0]}") from None
        for name, (a, b) in pairs.items():
            if name not in self._shapes:
                raise ProtocolError(
                    f"load_weights: version {version} adapts {name!r}, which the base model "
                    f"{self.model_dir} does not have"
                )
            w = self._shapes[name]
            if a.ndim != 2 or b.ndim != 2 or (b.shape[0], a.shape[1]) != w or a.shape[0] != b.shape[1]:
                raise ProtocolError(
                    f"load_weights: version {version}: {name} A {a.shape} x B {b.shape} does not "
                    f"fit the base weight {w}"
                )
            if a.shape[0] > self.max_lora_rank:
                raise ProtocolError(
                    f"load_weights: version {version} has rank {a.shape[0]} > the worker's "
                    f"max_lora_rank {self.max_lora_rank}; start it with --lora-rank {a.shape[0]}"
                )

    def _load_adapter(self, version: int, path: str) -> None:
        """A published adapter: written once as a PEFT folder, named by every request from now on (see
        the module docstring); sequences live are handed over as for new weights."""
        from safetensors.numpy import load_file
        from vllm.lora.request import LoRARequest

        state = load_file(path)
        self._check_adapter(version, state)
        if self._lora_root is None:  # one folder per worker, in shared memory where there is some
            self._lora_root = tempfile.mkdtemp(prefix=f"laminar-lora-{os.getpid()}-", dir=weights_dir())
            atexit.register(shutil.rmtree, self._lora_root, True)
        lora_id = self._next_lora_id
        folder = os.path.join(self._lora_root, f"v{version}-id{lora_id}")
        try:
            write_adapter_folder(state, folder, self.model_dir)
        except ValueError as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise ProtocolError(f"load_weights: version {version}: {e}") from None
        self._next_lora_id += 1
        live, _ = self.abort(None, include_queued=False) if self._live else ([], [])
        self._drop_adapter()
        self.lora_request = LoRARequest(f"laminar-v{version}", lora_id, folder)
        self.llm.reset_prefix_cache()  # vLLM keys cached blocks by adapter id too; this does not rely on it
        self.version = version
        self._pending.partials.extendleft(reversed(live))  # continue under the new adapter, first in line

    def _drop_adapter(self) -> None:
        """Forget the current adapter: out of vLLM's cache and its folder deleted (no request names it
        any more: ``load_weights`` aborted them all)."""
        old, self.lora_request = self.lora_request, None
        if old is None:
            return
        self.engine.remove_lora(old.lora_int_id)
        shutil.rmtree(old.lora_path, ignore_errors=True)

    def status(self) -> dict:
        kv = sum(
            len(lv.request.prompt.prompt_tokens) + len(lv.prefix_tokens) + len(lv.tokens)
            for lv in self._live.values()
        )
        return {
            "version": self.version,
            "queued": len(self._pending),
            "active": len(self._live),
            "capacity": self.capacity,
            "kv_tokens": kv,
            "admitting": self.admitting,
        }

    def close(self) -> None:
        self.llm = None
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)


def cpu_defaults(env: MutableMapping[str, str]) -> None:
    """Settings of vLLM's CPU build, unless the caller set them: a 1 GiB key/value cache
    (``VLLM_CPU_KVCACHE_SPACE``, GiB; unset, it takes a share of the machine's memory) and no thread
    pinning (``VLLM_CPU_OMP_THREADS_BIND=nobind``: by default every vLLM process binds its threads to
    the same first cores, so two rollouts, or a rollout and the trainer, would share one core); the
    worker's threads are ``OMP_NUM_THREADS``. The CUDA build ignores both."""
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def self_check() -> None:
    """``make vllm-env``'s last step: vLLM started once on a random model of ``conf/model/tiny_vllm.yaml``'s
    shape, 8 completions sampled, the same weights loaded back through the weight-update path and 8
    more sampled under version 1; prints vLLM's version and the timings."""
    import yaml
    import vllm

    from conf.schema import ModelConfig
    from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, save_model
    from generation.protocol import write_weights
    from generation.records import PromptItem

    shape = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf/model/tiny_vllm.yaml").read_text())
    shape.pop("kind", None)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="laminar-vllm-check-") as d:
        tok = build_char_tokenizer()
        model = build_tiny_model(ModelConfig(**shape), tok, seed=0)
        save_model(model, tok, Path(d))
        engine = VllmEngine(
            d, capacity=8, max_new_tokens=16, temperature=1.0, seed=0, dtype="float32", enforce_eager=True
        )
        started = time.perf_counter() - t0
        reqs = [
            GenRequest(PromptItem(f"q{i}", f"{i}+1=", "", encode_prompt(tok, f"{i}+1=")), 0) for i in range(8)
        ]
        engine.submit(reqs)
        out = []
        while engine.status()["active"] or engine.status()["queued"]:
            out += engine.step(16)
        path = write_weights({k: v.detach().numpy() for k, v in model.state_dict().items()})
        t1 = time.perf_counter()
        engine.load_weights(1, path=path)
        loaded = time.perf_counter() - t1
        os.unlink(path)
        engine.submit(reqs)
        again = []
        while engine.status()["active"] or engine.status()["queued"]:
            again += engine.step(16)
        engine.close()
    if len(out) != 8 or len(again) != 8 or any(t.version != 1 for t in again):
        raise SystemExit(f"vllm {vllm.__version__}: self-check failed ({len(out)} + {len(again)} of 8 + 8)")
    n = sum(len(t.response_tokens) for t in out + again)
    print(
        f"vllm {vllm.__version__} ready: started in {started:.1f} s, {n} tokens in 16 completions, "
        f"weights loaded in {loaded:.2f} s"
    )


def build_engine(args):
    if args.engine == "vllm":
        return VllmEngine(
            args.model_dir,
            capacity=args.capacity,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            dtype="auto" if args.dtype == "auto" else args.dtype,
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            enforce_eager=args.vllm_enforce_eager,
            max_model_len=args.vllm_max_model_len,
            lora_rank=args.lora_rank,
        )
    if args.engine == "torch":
        from generation.engines import load_torch_engine
        from generation.setup import setup_torch

        setup_torch(int(os.environ.get("OMP_NUM_THREADS", "1")), args.seed)
        rollout = RolloutConfig(
            dtype=args.dtype,
            sync_every=args.sync_every,
            static_cache=args.static_cache,
            cuda_graphs=args.cuda_graphs,
        )
        opts = EngineOptions(
            capacity=args.capacity,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            rollout=rollout,
        )
        return load_torch_engine(args.model_dir, opts, device=args.device)
    raise SystemExit(f"unknown engine {args.engine!r}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "torch"))
    ap.add_argument("--model-dir")
    ap.add_argument(
        "--self-check",
        action="store_true",
        help="start vLLM once on a random tiny_vllm-shaped model, sample, load weights, print the version",
    )
    d = DEFAULTS
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--capacity", type=int, default=d.capacity)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--dtype", default=d.rollout.dtype)
    ap.add_argument("--sync-every", type=int, default=d.rollout.sync_every)
    ap.add_argument("--static-cache", action="store_true", help="torch engine: static slot cache")
    ap.add_argument("--cuda-graphs", action="store_true", help="torch engine: CUDA-graph decode (CUDA only)")
    ap.add_argument(
        "--vllm-gpu-memory-utilization", type=float, default=d.rollout.vllm_gpu_memory_utilization
    )
    ap.add_argument("--vllm-enforce-eager", action="store_true")
    ap.add_argument("--vllm-max-model-len", type=int, default=0)
    ap.add_argument(
        "--lora-rank",
        type=int,
        default=d.lora_rank,
        help="vllm engine: take published LoRA adapters up to this rank (0: full weights only); the "
        "torch engine merges adapters and ignores it",
    )
    args = ap.parse_args(argv)
    cpu_defaults(os.environ)
    if args.self_check:
        self_check()
        return
    if args.engine is None or args.model_dir is None:
        ap.error("the following arguments are required: --engine, --model-dir (or --self-check)")
    rfile, wfile = protocol_streams()  # before anything can print to stdout
    t0 = time.perf_counter()
    engine = build_engine(args)
    info = {
        "engine": args.engine,
        "pid": os.getpid(),
        "temperature": engine.sampling.temperature,
        "max_new_tokens": engine.sampling.max_new_tokens,
        "seed": engine.sampling.seed,
        "features": {
            "deterministic_handover": args.engine == "torch",
            "entropy": args.engine == "torch",
            "lora": args.engine == "torch" or args.lora_rank > 0,
        },
        "startup_s": time.perf_counter() - t0,
    }
    serve(engine, rfile, wfile, info)
    engine.close()


if __name__ == "__main__":
    sys.exit(main())
