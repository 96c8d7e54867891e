"""A stand-in for vLLM's offline interfaces, for tests only (put its parent folder on PYTHONPATH).

It mimics what ``generation.vllm_worker`` uses, with vLLM's documented behaviour: ``LLM(**engine
args)`` with ``llm_engine.add_request / step / abort_request`` (one token per live request per step,
at most ``max_num_seqs`` live, ``RequestOutputKind.DELTA`` outputs, the sampled token's log-prob when
``logprobs=0``, EOS included in the tokens), ``collective_rpc`` into the ``worker_extension_cls``
mixed into a worker whose ``reload_weights(weights_iterator=...)`` hands (name, tensor) pairs to the
model's ``load_weights`` (which, as in vLLM's CPU build, fails when called directly: the weights are
repacked at start), ``reset_prefix_cache`` and ``get_tokenizer``. Tokens are a deterministic hash
of (request seed, position, loaded weights), so new weights change the outputs. Like vLLM's weight
loaders, a load refuses a tensor whose name the checkpoint does not have or whose shape differs
from the checkpoint's (the shapes are read from the model folder's safetensors headers at start).

With ``enable_lora=True`` (and vLLM's checks on ``max_lora_rank`` / ``max_loras``) it runs the real
model instead (transformers, float32, CPU): each step samples the next token from the
temperature-scaled distribution of the base, or, for a request with a ``lora_request``, of the base
with that request's adapter applied, and reports that token's processed log-prob. Like vLLM, it reads
a PEFT folder (``adapter_config.json``: ``r``, ``lora_alpha``, ``target_modules``, ``bias`` "none";
``adapter_model.safetensors``) from ``lora_path`` when a request first needs the adapter, scales it by
lora_alpha / r, refuses a rank above ``max_lora_rank``, and caches it by ``lora_int_id`` (a new path
under a known id is not read again) until ``remove_lora``. The adapter is merged, W0 + scaling * B @ A,
into a copy of the base for the requests that name it."""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
from dataclasses import dataclass, field

from vllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.0-fake"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = 1
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list
    logprobs: list | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list
    finished: bool


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig (1 in its newest versions)


class _Model:
    def __init__(self, torch_model=None, shapes=None):
        self.shapes = shapes or {}  # name -> shape of the checkpoint's tensors
        self.digest = 0
        self.loads = 0
        self.torch_model = torch_model  # the real model (LoRA mode), else None
        self.processed = True  # weights in kernel format (the CPU build repacks them at start)

    def load_weights(self, weights):
        if self.processed:  # vLLM's CPU build: the repacked parameters are empty
            raise RuntimeError(
                "Attempted to load weight into parameter (torch.Size([0])): weights are in kernel "
                "format; load them through the worker's reload_weights"
            )
        h = hashlib.blake2b(digest_size=8)
        n = 0
        params = dict(self.torch_model.named_parameters()) if self.torch_model is not None else None
        for name, tensor in weights:
            if self.shapes and name not in self.shapes:
                if name == "lm_head.weight":  # tied embeddings: vLLM's loaders skip the head
                    continue
                raise KeyError(f"fake vLLM load_weights: the model has no parameter {name}")
            if self.shapes and tuple(self.shapes[name]) != tuple(tensor.shape):
                raise AssertionError(
                    f"Attempted to load weight ({tuple(tensor.shape)}) into parameter "
                    f"({tuple(self.shapes[name])}) for {name}"
                )
            h.update(name.encode())
            h.update(tensor.float().numpy().tobytes())
            n += 1
            if params is not None:
                if name not in params or tuple(params[name].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"fake vLLM load_weights: no parameter {name} of shape {tuple(tensor.shape)}"
                    )
                with __import__("torch").no_grad():
                    params[name].copy_(tensor)
        self.digest = int.from_bytes(h.digest(), "little")
        self.loads += 1
        return n


class _Runner:
    def __init__(self):
        self.model = _Model()

    def get_model(self):
        return self.model


class _Worker:
    """vLLM's worker, as far as an extension can tell: ``model_runner`` and the in-place weight update
    ``reload_weights`` (checkpoint-format weights loaded, then processed into kernel format again)."""

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        assert weights_iterator is not None and is_checkpoint_format, "the fake reloads from an iterator"
        model = self.model_runner.get_model()
        model.processed = False
        try:
            model.load_weights(weights_iterator)
        finally:
            model.processed = True


@dataclass
class _Req:
    prompt: list
    params: SamplingParams
    lora_request: object = None
    generated: list = field(default_factory=list)


class _Adapters:
    """vLLM's LoRA manager, as far as the worker can tell: adapters read from their PEFT folder on first
    use, cached by id (at most ``max_cpu_loras``, least recently used out first), applied by merging
    into a copy of the base model (rebuilt when the base's weights change)."""

    def __init__(self, model: _Model, max_lora_rank: int, capacity: int):
        self.model, self.max_lora_rank, self.capacity = model, max_lora_rank, capacity
        self.tensors: dict[int, tuple[float, dict]] = {}  # id -> (scaling, {base weight name: (A, B)})
        self.merged: dict[tuple[int, int], object] = {}
        self.reads: list[tuple[int, str]] = []  # (id, path) of every folder read

    def _read(self, req) -> tuple[float, dict]:
        from safetensors.torch import load_file

        path = req.lora_path
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
        if cfg.get("bias", "none") != "none" or cfg.get("use_dora") or cfg.get("modules_to_save"):
            raise ValueError(f"fake vLLM: adapter {path}: bias/DoRA/modules_to_save are not supported")
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        if r > self.max_lora_rank:
            raise ValueError(f"LoRA rank {r} is greater than max_lora_rank {self.max_lora_rank}")
        scaling = alpha / (r**0.5 if cfg.get("use_rslora") else r)
        pairs: dict[str, list] = {}
        for name, t in load_file(os.path.join(path, "adapter_model.safetensors")).items():
            assert name.startswith("base_model.model.") and name.endswith(
                (".lora_A.weight", ".lora_B.weight")
            ), name
            module = name[len("base_model.model.") : -len(".lora_A.weight")]
            if module.rsplit(".", 1)[-1] not in cfg["target_modules"]:
                raise ValueError(f"fake vLLM: adapter {path}: {module} is not in target_modules")
            pairs.setdefault(module + ".weight", [None, None])[0 if ".lora_A." in name else 1] = t
        self.reads.append((req.lora_int_id, path))
        return scaling, pairs

    def model_for(self, req):
        import torch

        if req is None:
            return self.model.torch_model
        if req.lora_int_id not in self.tensors:
            if len(self.tensors) >= self.capacity:
                self.remove(next(iter(self.tensors)))
            self.tensors[req.lora_int_id] = self._read(req)
        self.tensors[req.lora_int_id] = self.tensors.pop(req.lora_int_id)  # most recently used last
        key = (req.lora_int_id, self.model.loads)
        if key not in self.merged:
            scaling, pairs = self.tensors[req.lora_int_id]
            merged = copy.deepcopy(self.model.torch_model)
            params = dict(merged.named_parameters())
            with torch.no_grad():
                for name, (a, b) in pairs.items():
                    params[name].copy_(params[name] + scaling * (b.float() @ a.float()))
            self.merged[key] = merged
        return self.merged[key]

    def remove(self, lora_id: int) -> bool:
        for key in [k for k in self.merged if k[0] == lora_id]:
            del self.merged[key]
        return self.tensors.pop(lora_id, None) is not None


class _Engine:
    def __init__(self, llm: LLM, max_num_seqs: int):
        self.llm = llm
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, _Req] = {}

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None):
        assert isinstance(request_id, str) and request_id not in self.requests, request_id
        assert (
            params.logprobs == 0 and params.output_kind == RequestOutputKind.DELTA and params.max_tokens >= 1
        )
        if lora_request is not None and self.llm.adapters is None:
            raise ValueError(f"LoRA is not enabled but request {request_id} has a lora_request")
        self.requests[request_id] = _Req(list(prompt["prompt_token_ids"]), params, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        assert lora_id > 0, "lora_id must be greater than 0."
        if self.llm.adapters is None:
            raise ValueError("LoRA is not enabled")
        return self.llm.adapters.remove(lora_id)

    def _model_step(self, r: _Req) -> tuple[int, float]:
        """The next token of ``r`` from the real model (with its adapter) and its processed log-prob."""
        import torch

        assert r.params.temperature > 0, "the fake's model mode samples (temperature > 0)"
        model = self.llm.adapters.model_for(r.lora_request)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([r.prompt + r.generated])).logits[0, -1].float()
            logp = torch.log_softmax(logits / r.params.temperature, -1)
            g = torch.Generator().manual_seed(hash((r.params.seed, len(r.generated))) & 0x7FFFFFFF)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
        return tok, float(logp[tok])

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.requests.pop(rid, None)

    def step(self):
        outs = []
        for rid in list(self.requests)[: self.max_num_seqs]:
            r = self.requests[rid]
            eos = self.llm.tokenizer.eos_token_id
            if self.llm.adapters is not None:
                tok, lp = self._model_step(r)
            else:
                key = repr(
                    (r.params.seed, r.prompt, len(r.generated), self.llm.worker.model_runner.model.digest)
                )
                x = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
                tok = eos if x % 100 < 15 else 3 + x % (len(self.llm.tokenizer) - 3)
                lp = -((x >> 20) % 1000) / 300.0 - 0.01
            r.generated.append(tok)
            done = tok == eos or len(r.generated) >= r.params.max_tokens
            outs.append(
                RequestOutput(
                    rid,
                    [
                        CompletionOutput(
                            0,
                            [tok],
                            [{tok: Logprob(lp)}],
                            "stop" if tok == eos else ("length" if done else None),
                        )
                    ],
                    done,
                )
            )
            if done:
                del self.requests[rid]
        return outs


def _checkpoint_shapes(model_dir) -> dict:
    """``{name: shape}`` of the tensors in the model folder's safetensors files (headers only)."""
    from pathlib import Path

    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


class LLM:
    def __init__(
        self,
        model,
        tokenizer=None,
        seed=0,
        max_num_seqs=256,
        worker_extension_cls=None,
        logprobs_mode="raw_logprobs",
        enable_lora=False,
        max_lora_rank=16,
        max_loras=1,
        max_cpu_loras=None,
        **engine_args,
    ):
        from transformers import AutoTokenizer

        assert logprobs_mode == "processed_logprobs", "behaviour log-probs need the processed distribution"
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        mod, cls = worker_extension_cls.rsplit(".", 1)
        ext = getattr(importlib.import_module(mod), cls)
        self.worker = type("FakeWorker", (ext, _Worker), {})()
        self.worker.model_runner = _Runner()
        self.worker.model_runner.model.shapes = _checkpoint_shapes(model)
        self.adapters = None
        if enable_lora:
            import torch
            from transformers import AutoModelForCausalLM

            if max_lora_rank not in MAX_LORA_RANKS:
                raise ValueError(f"max_lora_rank ({max_lora_rank}) must be one of {MAX_LORA_RANKS}.")
            if max_loras < 1 or (max_cpu_loras is not None and max_cpu_loras < max_loras):
                raise ValueError(
                    f"max_loras ({max_loras}) must be >= 1 and <= max_cpu_loras ({max_cpu_loras})"
                )
            base = AutoModelForCausalLM.from_pretrained(
                model, use_safetensors=True, dtype=torch.float32
            ).eval()
            self.worker.model_runner.model = _Model(base)
            self.adapters = _Adapters(
                self.worker.model_runner.model, max_lora_rank, max_cpu_loras or max_loras
            )
        self.llm_engine = _Engine(self, max_num_seqs)
        self.prefix_resets = 0
        self.engine_args = engine_args

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.prefix_resets += 1
        return True
