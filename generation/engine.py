"""The built-in generation engine: continuous batching over any Hugging Face causal LM, driving the
model directly (a decode step costs far less than ``generate``'s), for every caller: curation,
evaluation and the RL drivers.

``submit`` queues requests, ``step`` admits them into free rows and decodes, finished rows leave at
once and queued ones take their place; ``extract`` / ``inject`` hand in-flight responses between
engines; ``load_weights`` swaps weights (version-atomic); ``generate`` is the batch call on top of the
same scheduling. Every token is drawn by ``generation.sampler`` (a request's tokens do not depend on
its batch) and carries its behaviour log-prob and the weight version that sampled it.

The running rows live in one of three layouts: a **wave** (``generation.wave``: rows that start
together, the fastest path: prompt-shared KV, the native C step) whenever the engine is idle and
fresh requests arrive; else ``DynamicRows`` (a growing ``DynamicCache``) or, with ``static_cache``,
``SlotRows`` (static slots; ``cuda_graphs`` on CUDA), both in ``generation.rows``. A wave dissolves
into partials (continued by re-prefill) when queued work waits and half its rows have finished, on
a weight load mid-wave, and on ``extract``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from conf.schema import EngineOptions
from generation import model_calls
from generation.protocol import EngineBase, ProtocolError, SamplingSpec, load_safetensors
from generation.records import GenRequest, Partial, PromptItem, Trajectory, WeightsUpdate
from generation.rows import DynamicRows, Row, SlotRows
from generation.sampler import request_key, sample, seed_from
from generation.setup import HostThreads
from generation.wave import Wave, decode_attention_supported


def _resolve_dtype(dtype: str, cuda: bool):
    """The dtype to cast the model to, or None to leave it as loaded. ``auto``: bfloat16 on a CUDA
    device that supports it, unchanged elsewhere (the CPU path keeps the checkpoint's float32)."""
    if dtype == "auto":
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else None
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return table[dtype]


def _checked(o: EngineOptions) -> EngineOptions:
    """``o``, or one clear error for a value the engine cannot run with."""
    if o.capacity < 1 or o.max_new_tokens < 1:
        raise ValueError("capacity and max_new_tokens must be >= 1")
    if not o.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {o.temperature}")
    if o.rollout.sync_every < 0:
        raise ValueError(f"sync_every must be >= 0 (0: automatic), got {o.rollout.sync_every}")
    return o


class Engine(EngineBase):
    """The generation engine (see the module docstring); it speaks ``generation.protocol``'s
    ``RolloutEngine`` in process. ``admitting=False`` stops ``step`` from admitting queued requests
    (the runtime drains a rollout before pulling new weights); injected partials are admitted
    regardless. Not thread-safe: one caller drives it.

    ``options`` (``conf.schema.EngineOptions``; None: its defaults): ``capacity``, rows decoded at once;
    the sampling (``max_new_tokens``, ``temperature``, ``seed``); its ``rollout`` section's ``dtype``,
    ``sync_every``, ``static_cache`` (static KV slots, fixed shapes) and ``cuda_graphs`` (the decode
    step captured once and replayed on CUDA). The keywords are the implementation's switches, not
    config: ``static_width`` (the static slots' width; 0: ``max_new_tokens`` + 128);
    ``waves``: take the wave path when rows start together; ``fused_decode``: the wave's native C
    step over the fused weights where it reproduces the model (False: the model's own forward);
    ``native_kernels``: the native kernels at all (the C step and the C sampling step)."""

    engine_name = "torch"

    def __init__(
        self,
        model,
        tokenizer,
        options: EngineOptions | None = None,
        *,
        device: str = "cpu",
        static_width: int = 0,
        waves: bool = True,
        fused_decode: bool = True,
        native_kernels: bool = True,
    ):
        o = _checked(options if options is not None else EngineOptions())
        r = o.rollout
        cuda = torch.device(device).type == "cuda"
        self._cuda = cuda
        model_dtype = _resolve_dtype(r.dtype, cuda)
        self.model = (
            model.to(device) if model_dtype is None else model.to(device=device, dtype=model_dtype)
        ).eval()
        self.sync_every = int(r.sync_every) if r.sync_every else (8 if cuda else 1)
        """Decode steps between host synchronisations (finished rows leave, queued ones join)."""
        self.tokenizer = tokenizer
        self.device = device
        self.capacity = o.capacity
        self.max_new_tokens = o.max_new_tokens
        self.temperature = float(o.temperature)
        self.seed = int(o.seed)
        self.sampling = SamplingSpec(self.temperature, self.max_new_tokens, self.seed)
        self.version = 0
        self.admitting = True
        eos = tokenizer.eos_token_id
        self.eos_id = -1 if eos is None else int(eos)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.pad_id = 0 if pad is None else int(pad)
        self.static_cache, self.static_width, self.cuda_graphs = (
            r.static_cache or r.cuda_graphs,
            static_width,
            r.cuda_graphs,
        )
        self.waves = waves
        self.wave_refill = 0.5
        """A wave dissolves (its rows continue in the joinable layout, by re-prefill) once queued work
        waits and at most this fraction of ``capacity`` is still live; 0: waves run to the end."""
        self.fused_decode = fused_decode
        self.native_kernels = native_kernels
        """On the CPU, each wave sampling step and (float32, head_dim a multiple of 16) each wave decode
        step is one call of the native kernels (``generation.kernels``, built once per machine) where a
        C compiler is there; False (or ``LAMINAR_NATIVE_KERNELS=0``): torch ops only."""
        self.decode_threads: int | None = None
        """Host decode shards (threads) of a wave; None: one per torch thread."""
        self._fused_decoder = None
        self._kv_store: list[list] = []
        """Per decode shard, a wave's host buffers, reused from wave to wave."""
        self._threads = HostThreads("laminar-decode")
        self._queue: deque[GenRequest] = deque()
        self._partials: deque[Partial] = deque()
        self._batch = self._joinable()

    # ----------------------------------------------------------------------------------- public API

    def submit(self, requests: Sequence[GenRequest], sampling: SamplingSpec | None = None) -> None:
        self.check_sampling(sampling)
        for r in requests:
            if not r.prompt.prompt_tokens:
                raise ProtocolError(f"request {r.prompt.prompt_id!r}: empty prompt_tokens")
        self._queue.extend(requests)

    def inject(self, partials: Sequence[Partial]) -> None:
        """Continue handed-over responses: first in line, admitted even when ``admitting`` is False,
        re-prefilled (prompt + tokens so far) on admission."""
        self._partials.extend(partials)

    def step(self, max_steps: int) -> list[Trajectory]:
        """Admit into free rows, then up to ``max_steps`` decode steps, refilling freed rows; returns
        the trajectories that finished (in finishing order). Returns early when nothing is active."""
        out: list[Trajectory] = []
        with torch.inference_mode():
            self._admit(out)
            i = 0
            while i < max_steps and self._batch.active():
                if self._batch.joins:
                    self._batch.decode()
                    i += 1
                    if i % self.sync_every and i < max_steps:
                        continue
                else:
                    i += max(1, self._batch.advance(max_steps - i))
                self._batch.retire(out)
                self._admit(out)
        return out

    def extract(self, include_queued: bool = True, only=None) -> tuple[list[Partial], list[GenRequest]]:
        """Remove every active sequence (as a ``Partial`` with its tokens so far) and, when
        ``include_queued``, every queued partial and request. Returns (partials, requests), the queued
        partials (first in line) ahead of the active rows; an active row's tokens include the pending
        one, so the receiver re-prefills them all and samples the next token.

        ``only``: a set of ``request_key``s; then just those requests leave (the others keep running)."""
        partials: list[Partial] = []
        requests: list[GenRequest] = []

        def chosen(r: GenRequest) -> bool:
            return only is None or request_key(r) in only

        if include_queued:
            partials.extend(p for p in self._partials if chosen(p.request))
            requests.extend(r for r in self._queue if chosen(r))
            self._partials = deque(p for p in self._partials if not chosen(p.request))
            self._queue = deque(r for r in self._queue if not chosen(r))
        with torch.inference_mode():  # the row tensors are inference tensors, updated in place
            partials.extend(self._batch.take(chosen))
        return partials, requests

    def abort(
        self, request_ids: Iterable | None = None, include_queued: bool = True
    ) -> tuple[list[Partial], list[GenRequest]]:
        only = None if request_ids is None else {tuple(i) for i in request_ids}
        return self.extract(include_queued=include_queued, only=only)

    def load_weights(
        self,
        version: int | WeightsUpdate,
        state: Mapping[str, np.ndarray] | None = None,
        path: str | None = None,
    ) -> None:
        """New weights: a ``WeightsUpdate``, or ``version`` with exactly one of named arrays
        (``state``) and a safetensors file (``path``). See ``load_state``."""
        if isinstance(version, WeightsUpdate):
            version, state = version.version, version.state
        if (state is None) == (path is None):
            raise ValueError("load_weights takes exactly one of state= and path=")
        self.load_state(dict(state) if state is not None else load_safetensors(path), version)

    def load_state(self, state: Mapping[str, np.ndarray], version: int) -> None:
        """Replace every parameter (strict: the same names and shapes as the model's state dict,
        checked before anything is written), then move ``version``; a LoRA adapter version
        (``generation.adapter``) is merged into the engine's copy of the base instead.

        With sequences active (the runtime's ``partial`` mode), their cached keys/values were computed
        by the old weights: every active row is re-prefilled (prompt + tokens so far, less the pending
        token) under the new weights, so later tokens are sampled exactly as a fresh engine with the new
        weights would continue them. Tokens already sampled keep their old behaviour log-probs and the
        trajectory's ``last_version`` records the newest version that sampled a token."""
        state = dict(state)
        if not self._batch.joins:  # a wave's rows continue by re-prefill under the new weights
            with torch.inference_mode():
                self._dissolve_wave()
        model_calls.replace_weights(self.model, state)
        self._fused_decoder = None  # rebuilt from the new weights (a merge moves no version counter)
        self.version = int(version)
        if self._batch.active():
            self._batch.reprefill()

    def status(self) -> dict:
        return {
            "version": self.version,
            "queued": len(self._queue) + len(self._partials),
            "active": self._batch.active(),
            "capacity": self.capacity,
            "kv_tokens": self._batch.kv_tokens(),
            "admitting": self.admitting,
        }

    def generate(
        self,
        requests: Sequence[GenRequest],
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        generator: torch.Generator | None = None,
        progress=None,
        *,
        seed: int | None = None,
    ) -> list[Trajectory]:
        """Sample one response per request through ``submit``/``step`` (waves of ``capacity`` rows);
        output order = input order. ``max_new_tokens`` / ``temperature`` (default: the engine's) hold
        for this call; the noise seed is ``seed``, else one draw from ``generator``, else the
        engine's. The engine must be idle."""
        if self._queue or self._partials or self._batch.active():
            raise RuntimeError("generate() needs an idle engine: drain it (step) or extract() first")
        m = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        temp = self.temperature if temperature is None else float(temperature)
        if m < 1 or not temp > 0:
            raise ValueError(f"generate: max_new_tokens must be >= 1 and temperature > 0, got {m}, {temp}")
        seed = seed_from(generator, seed) if (seed is not None or generator is not None) else self.seed
        slots: dict[tuple, deque[int]] = {}  # by prompt object: ids may repeat across benchmarks
        for i, r in enumerate(requests):
            slots.setdefault((id(r.prompt), r.group_uid, r.sample_idx), deque()).append(i)
        results: list[Trajectory | None] = [None] * len(requests)
        with _one_call(self, m, temp, seed):
            self.submit(requests)
            while self._queue or self._partials or self._batch.active():
                done = self.step(m)
                for t in done:
                    results[slots[(id(t.prompt), t.group_uid, t.sample_idx)].popleft()] = t
                if progress is not None and done:
                    progress.update(len(done))
        return results

    def prompt_entropy(self, prompts: Sequence[PromptItem]) -> list[float]:
        """HIVE's prompt entropy V(x) of each prompt under the current policy
        (``model_calls.prompt_entropy``, ``capacity`` prompts a forward)."""
        return model_calls.prompt_entropy(self.model, prompts, self.pad_id, self.device, self.capacity)

    # ------------------------------------------------------------------------------ scheduling

    def _joinable(self):
        """A fresh joinable layout: static slots or a growing cache."""
        if self.static_cache:
            return SlotRows(self, static_width=self.static_width, cuda_graphs=self.cuda_graphs)
        return DynamicRows(self)

    def _waiting(self) -> bool:
        return bool(self._partials) or (self.admitting and bool(self._queue))

    def _dissolve_wave(self) -> None:
        """The wave's live rows become partials first in line (continued by re-prefill)."""
        self._partials.extendleft(reversed(self._batch.take(None)))
        self._batch = self._joinable()

    def _admit(self, out: list[Trajectory]) -> None:
        """Fill free rows: a new wave when nothing runs and fresh requests wait; else injected partials
        first, then (if ``admitting``) the queue. Rows that finish on their first sample leave at once
        and their rows are refilled in the same call."""
        if not self._batch.joins:
            live = self._batch.active()
            if live and not (self._waiting() and live <= self.wave_refill * self.capacity):
                return
            if live:
                self._dissolve_wave()
            else:
                self._batch = self._joinable()
        if (
            not self._batch.active()
            and self._wave_path()
            and self.admitting
            and self._queue
            and not self._partials
        ):
            take = [self._queue.popleft() for _ in range(min(self.capacity, len(self._queue)))]
            self._batch = Wave(self, [Row(r, self.version) for r in take])
            self._batch.advance(1)  # the first token, sampled on admission as in the joinable rows
            self._batch.retire(out)
            return
        while self._batch.active() < self.capacity and self._waiting():
            new: list[tuple[GenRequest, tuple[int, ...], tuple[float, ...], int | None, float]] = []
            while self._batch.active() + len(new) < self.capacity and self._waiting():
                if self._partials:
                    p = self._partials.popleft()
                    if len(p.tokens) != len(p.logprobs):
                        raise ValueError("Partial has len(tokens) != len(logprobs)")
                    if p.tokens and (len(p.tokens) >= self.max_new_tokens or p.tokens[-1] == self.eos_id):
                        # already complete (a sender with a larger cap): nothing to sample; the Partial
                        # does not say which version sampled its last token, so its version stands in
                        out.append(
                            self._trajectory(
                                p.request,
                                list(p.tokens),
                                list(p.logprobs),
                                p.version,
                                p.version,
                                p.entropy_sum,
                            )
                        )
                        continue
                    new.append(
                        (p.request, p.tokens, p.logprobs, p.version if p.tokens else None, p.entropy_sum)
                    )
                else:
                    new.append((self._queue.popleft(), (), (), None, 0.0))
            if new:
                self._batch.join(new)
                self._batch.retire(out)

    def _wave_path(self) -> bool:
        return self.waves and not self.static_cache and decode_attention_supported(self.model)

    # ------------------------------------------------------------------------------ model and sampling

    def _sample(self, logits: torch.Tensor, keys: torch.Tensor, t: torch.Tensor):
        """(logits [B, V], noise keys [B], response positions [B]) -> (token, behaviour log-prob,
        entropy), each [B]: ``generation.sampler.sample``."""
        return sample(logits, self.temperature, keys, t)

    def _prefill(self, seqs: list[list[int]]):
        """``model_calls.prefill`` of ``seqs`` (only the last position's logits)."""
        return model_calls.prefill(self.model, seqs, self.pad_id, self.device)

    def _left_padded(self, seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return model_calls.left_padded(seqs, self.pad_id, self.device)

    def _fused(self, positions: int):
        """The model's ``FusedDecoder`` (built once, its weights refreshed when they changed) with
        rotary tables for ``positions`` and the native kernels (``fused_decode.prepared``); None when
        the native step does not apply (the model is not one it reproduces, ``fused_decode`` is off,
        no kernels, not float32)."""
        from generation.fused_decode import fused_decoder, prepared

        if not self.fused_decode:
            return None
        if self._fused_decoder is None or self._fused_decoder[0] is not self.model:
            self._fused_decoder = (self.model, fused_decoder(self.model))
        return prepared(self._fused_decoder[1], positions, self._native)

    def _native(self):
        """The native kernels where this engine may use them (CPU, ``native_kernels``), else None."""
        if not self.native_kernels or torch.device(self.device).type != "cpu":
            return None
        from generation import kernels

        return kernels.load()

    def _trajectory(self, req: GenRequest, ids, logps, version: int, last_version: int, ent_sum: float):
        return model_calls.trajectory(
            self.tokenizer, self.eos_id, req, ids, logps, version, last_version, ent_sum
        )


@contextmanager
def _one_call(engine: Engine, max_new_tokens: int, temperature: float, seed: int):
    """``engine`` set for one ``generate`` call (its sampling settings, admitting, waves that run to
    the end, a fresh joinable layout); settings restored and queues emptied after it."""
    names = ("max_new_tokens", "temperature", "seed", "sampling", "admitting", "wave_refill")
    saved = [getattr(engine, n) for n in names]
    engine.max_new_tokens, engine.temperature, engine.seed = max_new_tokens, temperature, seed
    engine.sampling = SamplingSpec(temperature, max_new_tokens, seed)
    engine.admitting, engine.wave_refill = True, 0.0
    try:
        engine._batch = engine._joinable()
        yield
    finally:
        engine._queue.clear()
        engine._partials.clear()
        for name, value in zip(names, saved):
            setattr(engine, name, value)
        engine._batch = engine._joinable()
