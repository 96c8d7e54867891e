"""A stand-in for vLLM's offline interfaces, for tests only (put its parent folder on PYTHONPATH).

It mimics what ``generation.vllm_worker`` uses, with vLLM's documented behaviour: ``LLM(**engine
args)`` with ``llm_engine.add_request / step / abort_request`` (one token per live request per step,
at most ``max_num_seqs`` live, ``RequestOutputKind.DELTA`` outputs, the sampled token's log-prob when
``logprobs=0``, EOS included in the tokens), ``collective_rpc`` into the ``worker_extension_cls``
mixed into a worker whose ``model_runner.get_model().load_weights(weights=...)`` receives
(name, tensor) pairs, ``reset_prefix_cache`` and ``get_tokenizer``. Tokens are a deterministic hash
of (request seed, position, loaded weights), so new weights change the outputs."""

from __future__ import annotations

import hashlib
import importlib
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


class _Model:
    def __init__(self):
        self.digest = 0
        self.loads = 0

    def load_weights(self, weights):
        h = hashlib.blake2b(digest_size=8)
        n = 0
        for name, tensor in weights:
            h.update(name.encode())
            h.update(tensor.float().numpy().tobytes())
            n += 1
        self.digest = int.from_bytes(h.digest(), "little")
        self.loads += 1
        return n


class _Runner:
    def __init__(self):
        self.model = _Model()

    def get_model(self):
        return self.model


@dataclass
class _Req:
    prompt: list
    params: SamplingParams
    generated: list = field(default_factory=list)


class _Engine:
    def __init__(self, llm: "LLM", max_num_seqs: int):
        self.llm = llm
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, _Req] = {}

    def add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str) and request_id not in self.requests, request_id
        assert params.logprobs == 0 and params.output_kind == RequestOutputKind.DELTA and params.max_tokens >= 1
        self.requests[request_id] = _Req(list(prompt["prompt_token_ids"]), params)

    def abort_request(self, request_ids):
        for rid in request_ids:
            self.requests.pop(rid, None)

    def step(self):
        outs = []
        for rid in list(self.requests)[:self.max_num_seqs]:
            r = self.requests[rid]
            key = repr((r.params.seed, r.prompt, len(r.generated), self.llm.worker.model_runner.model.digest))
            x = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
            eos = self.llm.tokenizer.eos_token_id
            tok = eos if x % 100 < 15 else 3 + x % (len(self.llm.tokenizer) - 3)
            lp = -((x >> 20) % 1000) / 300.0 - 0.01
            r.generated.append(tok)
            done = tok == eos or len(r.generated) >= r.params.max_tokens
            outs.append(RequestOutput(rid, [CompletionOutput(0, [tok], [{tok: Logprob(lp)}],
                                                             "stop" if tok == eos else ("length" if done else None))],
                                      done))
            if done:
                del self.requests[rid]
        return outs


class LLM:
    def __init__(self, model, tokenizer=None, seed=0, max_num_seqs=256, worker_extension_cls=None,
                 logprobs_mode="raw_logprobs", **engine_args):
        from transformers import AutoTokenizer

        assert logprobs_mode == "processed_logprobs", "behaviour log-probs need the processed distribution"
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        mod, cls = worker_extension_cls.rsplit(".", 1)
        ext = getattr(importlib.import_module(mod), cls)
        self.worker = type("FakeWorker", (ext,), {})()
        self.worker.model_runner = _Runner()
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
