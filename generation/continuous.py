"""A rollout engine with continuous batching, for the asynchronous RL runtime.

``TorchEngine`` (``engine.py``) samples a static batch: every sequence waits for the longest one. Here
a running batch of at most ``capacity`` sequences decodes one token per step; a sequence that finishes
(EOS, or ``max_new_tokens`` response tokens) leaves the batch at once and a queued request takes its
slot before the next decode step. Conventions follow ``TorchEngine``: left padding, a ``DynamicCache``
decode loop, per-row position ids, the behaviour log-prob of each sampled token under the
temperature-scaled distribution, full-vocabulary entropies, the same ``Trajectory`` text decoding.

**Joining without re-prefilling the running batch.** Newly admitted sequences are prefilled together
(one left-padded forward); their KV cache is merged into the running cache by left-padding the narrower
of the two along the sequence axis (so every row's newest token stays in the last column) and
concatenating along the batch axis. The per-row attention mask marks the padding and per-row position
ids keep RoPE right, so the running rows' keys are never recomputed. Finished rows leave by batch index
selection, and leading columns that are padding for every remaining row are trimmed (left alignment is
what makes the dead columns leading, hence trimmable).

Row state between steps: the cache holds a row's prompt and every response token but the last; the
last sampled token is *pending* (fed at the next decode step, at position ``len(prompt) + n - 1``).

**Batch-independent sampling.** Tokens are drawn with the Gumbel-max trick,
``argmax(log_softmax(logits / T) + G)``, where the Gumbel noise of (seed, prompt, group_uid,
sample_idx, response position t, vocabulary index) comes from a counter-based hash (splitmix64,
vectorised in torch int64 ops) instead of a generator's stream. A request therefore draws the same
tokens whether it runs alone, in a full batch, or is extracted midway and continued on another engine
with the same weights; only float noise in the logits from a different batch shape could flip a
near-tie (see ``tests/training/test_continuous.py``).

**GPU path.** On CUDA the model runs in bfloat16 (``dtype="auto"``; sampling stays in float32/float64)
and the decode loop does not synchronise with the host every step: a row that samples EOS or reaches
the cap is marked finished on the device (its later samples are discarded by masked updates, so its
tokens, log-probs, entropy and version stay exactly what they were when it finished), and finished rows
leave the batch, and queued requests take their slots, only every ``sync_every`` decode steps (8 on
CUDA) and at the end of every ``step`` call. On the CPU ``sync_every`` is 1: rows leave after every
step, bit-for-bit the behaviour without lazy retirement. Trajectories do not depend on ``sync_every``
(``tests/training/test_continuous.py`` checks it on the CPU).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np
import torch

from generation.records import GenRequest, Partial, Trajectory
from generation.sampler import request_key, row_key, sample


def _resolve_dtype(dtype: str, cuda: bool):
    """The dtype to cast the model to, or None to leave it as loaded. ``auto``: bfloat16 on a CUDA
    device that supports it, unchanged elsewhere (the CPU path keeps the checkpoint's float32)."""
    if dtype == "auto":
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else None
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return table[dtype]


@dataclass
class _Row:
    request: GenRequest
    version: int  # the version that sampled the first response token


class ContinuousEngine:
    """Continuous-batching sampler over any Hugging Face causal LM (see the module docstring).

    ``submit`` queues requests (FIFO); ``inject`` queues handed-over ``Partial`` responses ahead of
    them; ``step`` admits into free slots and decodes; ``extract`` hands everything back;
    ``load_state`` swaps weights (version-atomic). ``admitting=False`` stops ``step`` from admitting
    queued requests (the runtime drains a rollout before pulling new weights); injected partials are
    admitted regardless. Not thread-safe: one caller drives it.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        device: str = "cpu",
        capacity: int = 64,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        seed: int = 0,
        dtype: str = "auto",
        sync_every: int = 0,
    ):
        if capacity < 1 or max_new_tokens < 1:
            raise ValueError("capacity and max_new_tokens must be >= 1")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if sync_every < 0:
            raise ValueError(f"sync_every must be >= 0 (0: automatic), got {sync_every}")
        cuda = torch.device(device).type == "cuda"
        self._cuda = cuda
        model_dtype = _resolve_dtype(dtype, cuda)
        self.model = (
            model.to(device) if model_dtype is None else model.to(device=device, dtype=model_dtype)
        ).eval()
        self.sync_every = int(sync_every) if sync_every else (8 if cuda else 1)
        """Decode steps between host synchronisations (finished rows leave, queued ones join)."""
        self.tokenizer = tokenizer
        self.device = device
        self.capacity = capacity
        self.max_new_tokens = max_new_tokens
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.version = 0
        self.admitting = True
        eos = tokenizer.eos_token_id
        self.eos_id = -1 if eos is None else int(eos)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.pad_id = 0 if pad is None else int(pad)
        self._queue: deque[GenRequest] = deque()
        self._partials: deque[Partial] = deque()
        self._reset_batch()

    # ----------------------------------------------------------------------------------- public API

    def load_state(self, state: dict[str, np.ndarray], version: int) -> None:
        """Replace every parameter (strict: the same names and shapes as the model's state dict,
        checked before anything is written), then move ``version``.

        With sequences active (the runtime's ``partial`` mode), their cached keys/values were computed
        by the old weights: every active row is re-prefilled (prompt + tokens so far, less the pending
        token) under the new weights, so later tokens are sampled exactly as a fresh engine with the new
        weights would continue them. Tokens already sampled keep their old behaviour log-probs and the
        trajectory's ``last_version`` records the newest version that sampled a token. A LoRA adapter
        version (``generation.adapter``) is merged into the engine's copy of the base instead."""
        from generation.adapter import is_adapter_state, merge_adapter

        if is_adapter_state(state):
            merge_adapter(self.model, state)
            self.version = int(version)
            if self._rows:
                self._reprefill_active()
            return
        current = self.model.state_dict()
        missing, unexpected = set(current) - set(state), set(state) - set(current)
        if missing or unexpected:
            raise KeyError(f"load_state: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        for k, v in state.items():
            if tuple(v.shape) != tuple(current[k].shape):
                raise ValueError(
                    f"load_state: {k} has shape {tuple(v.shape)}, model has {tuple(current[k].shape)}"
                )
        tensors = {k: torch.from_numpy(v if v.flags.writeable else np.array(v)) for k, v in state.items()}
        with torch.no_grad():
            self.model.load_state_dict(tensors, strict=True)
        self.version = int(version)
        if self._rows:
            self._reprefill_active()

    def submit(self, requests: Sequence[GenRequest]) -> None:
        self._queue.extend(requests)

    def inject(self, partials: Sequence[Partial]) -> None:
        """Continue handed-over responses: first in line, admitted even when ``admitting`` is False,
        re-prefilled (prompt + tokens so far) on admission."""
        self._partials.extend(partials)

    def step(self, max_steps: int) -> list[Trajectory]:
        """Admit into free slots, then up to ``max_steps`` decode steps, refilling freed slots after
        each; returns the trajectories that finished (in finishing order). Returns early when nothing
        is active."""
        out: list[Trajectory] = []
        with torch.inference_mode():
            self._admit(out)
            for i in range(max_steps):
                if not self._rows:
                    break
                self._decode()
                if (i + 1) % self.sync_every == 0 or i == max_steps - 1:
                    self._retire_finished(out)
                    self._admit(out)
        return out

    def extract(self, include_queued: bool = True, only=None) -> tuple[list[Partial], list[GenRequest]]:
        """Remove every active sequence (as a ``Partial`` with its tokens so far) and, when
        ``include_queued``, every queued partial and request. Returns (partials, requests), the queued
        partials (first in line) ahead of the active rows; an active row's tokens include the pending
        one, so the receiver re-prefills them all and samples the next token.

        ``only``: a set of ``request_key``s; then just those requests leave (the others keep running,
        their cache untouched)."""
        partials: list[Partial] = []
        requests: list[GenRequest] = []

        def chosen(r: GenRequest) -> bool:
            return only is None or request_key(r) in only

        if include_queued:
            partials.extend(p for p in self._partials if chosen(p.request))
            requests.extend(r for r in self._queue if chosen(r))
            if only is None:
                self._partials.clear()
                self._queue.clear()
            else:
                self._partials = deque(p for p in self._partials if not chosen(p.request))
                self._queue = deque(r for r in self._queue if not chosen(r))
        if self._rows:
            take = [i for i, row in enumerate(self._rows) if chosen(row.request)]
            if take:
                toks, lps, ngen, ent = (x.cpu() for x in (self._toks, self._lps, self._ngen, self._ent))
                for i in take:
                    row = self._rows[i]
                    n = int(ngen[i])
                    partials.append(
                        Partial(
                            request=row.request,
                            tokens=tuple(toks[i, :n].tolist()),
                            logprobs=tuple(lps[i, :n].tolist()),
                            version=row.version,
                            entropy_sum=float(ent[i]),
                        )
                    )
            if len(take) == len(self._rows):
                self._reset_batch()
            elif take:
                gone = set(take)
                keep = torch.tensor(
                    [i for i in range(len(self._rows)) if i not in gone], dtype=torch.long, device=self.device
                )
                self._rows = [r for i, r in enumerate(self._rows) if i not in gone]
                self._select(keep)
        elif only is None:
            self._reset_batch()
        return partials, requests

    def status(self) -> dict:
        kv = int((self._plen + self._ngen).sum()) if self._rows else 0
        return {
            "version": self.version,
            "queued": len(self._queue) + len(self._partials),
            "active": len(self._rows),
            "capacity": self.capacity,
            "kv_tokens": kv,
            "admitting": self.admitting,
        }

    # ------------------------------------------------------------------------------ batch state

    def _reset_batch(self) -> None:
        dev = self.device
        self._rows: list[_Row] = []
        self._cache = None  # DynamicCache or None
        self._attn = torch.zeros((0, 0), dtype=torch.long, device=dev)  # [B, T] over cached columns
        self._next = torch.zeros(0, dtype=torch.long, device=dev)  # [B] pending token
        self._pos = torch.zeros(0, dtype=torch.long, device=dev)  # [B] its position id
        self._plen = torch.zeros(0, dtype=torch.long, device=dev)  # [B] prompt length
        self._ngen = torch.zeros(0, dtype=torch.long, device=dev)  # [B] response tokens so far
        self._toks = torch.zeros((0, self.max_new_tokens), dtype=torch.long, device=dev)
        self._lps = torch.zeros((0, self.max_new_tokens), dtype=torch.float32, device=dev)
        self._ent = torch.zeros(0, dtype=torch.float64, device=dev)  # [B] entropy sums
        self._keys = torch.zeros(0, dtype=torch.long, device=dev)  # [B] noise keys
        self._lastv = torch.zeros(0, dtype=torch.long, device=dev)  # [B] version of the last token

    def _sample(self, logits: torch.Tensor, keys: torch.Tensor, t: torch.Tensor):
        """(logits [B, V], noise keys [B], response positions [B]) -> (token, behaviour log-prob,
        entropy), each [B]: ``generation.sampler.sample``."""
        return sample(logits, self.temperature, keys, t)

    def _prefill(self, seqs: list[list[int]]):
        """One left-padded forward over ``seqs``: (fresh DynamicCache, attention mask [B, W], logits at
        each row's last position [B, V]). Padded columns' keys/values are zeroed."""
        from transformers import DynamicCache

        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            attn[i, width - len(s) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        # on CUDA only the last position's logits are computed (a 150k vocabulary makes the full
        # [B, T, V] tensor gigabytes); the CPU path keeps the full forward, bit for bit as before
        extra = {"logits_to_keep": 1} if self._cuda else {}
        logits = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            **extra,
        ).logits[:, -1, :]
        if not bool(attn.all()):
            pad = (attn == 0)[:, None, :, None]
            for layer in cache.layers:
                layer.keys = layer.keys.masked_fill(pad, 0.0)
                layer.values = layer.values.masked_fill(pad, 0.0)
        return cache, attn, logits

    def _admit(self, out: list[Trajectory]) -> None:
        """Fill free slots: injected partials first, then (if ``admitting``) the queue. Rows that finish
        on their first sample leave at once and their slots are refilled in the same call."""
        while len(self._rows) < self.capacity and (self._partials or (self.admitting and self._queue)):
            new: list[tuple[GenRequest, tuple[int, ...], tuple[float, ...], int | None, float]] = []
            while len(self._rows) + len(new) < self.capacity and (
                self._partials or (self.admitting and self._queue)
            ):
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
                    r = self._queue.popleft()
                    new.append((r, (), (), None, 0.0))
            if new:
                self._join(new)
                self._retire_finished(out)

    def _join(self, new) -> None:
        """Prefill ``new`` rows, sample their next token and merge them into the running batch."""
        dev, m = self.device, self.max_new_tokens
        seqs = [list(r.prompt.prompt_tokens) + list(toks) for r, toks, _, _, _ in new]
        cache, attn, logits = self._prefill(seqs)
        b = len(new)
        ngen = torch.tensor([len(toks) for _, toks, _, _, _ in new], dtype=torch.long)
        toks_buf = torch.zeros((b, m), dtype=torch.long)
        lps_buf = torch.zeros((b, m), dtype=torch.float32)
        for i, (_, toks, lps, _, _) in enumerate(new):
            if toks:
                toks_buf[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                lps_buf[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        keys = torch.tensor([row_key(self.seed, r) for r, *_ in new], dtype=torch.long, device=dev)
        ngen, toks_buf, lps_buf = ngen.to(dev), toks_buf.to(dev), lps_buf.to(dev)
        nxt, lp, ent = self._sample(logits, keys, ngen)
        toks_buf.scatter_(1, ngen[:, None], nxt[:, None])
        lps_buf.scatter_(1, ngen[:, None], lp[:, None])
        plen = torch.tensor([len(r.prompt.prompt_tokens) for r, *_ in new], dtype=torch.long, device=dev)
        ent_sum = torch.tensor([e for *_, e in new], dtype=torch.float64, device=dev) + ent
        self._rows.extend(_Row(r, self.version if v is None else v) for r, _, _, v, _ in new)
        new_state = dict(
            attn=attn,
            next=nxt,
            pos=torch.tensor([len(s) for s in seqs], device=dev),
            plen=plen,
            ngen=ngen + 1,
            toks=toks_buf,
            lps=lps_buf,
            ent=ent_sum,
            keys=keys,
            lastv=torch.full((b,), self.version, dtype=torch.long, device=dev),
        )
        self._merge(cache, new_state)

    def _merge(self, cache, st: dict) -> None:
        """Concatenate new rows (their cache and per-row tensors) after the running ones, left-padding
        the narrower cache so that every row's newest cached token sits in the last column."""
        if self._cache is None:
            self._cache = cache
            self._attn = st["attn"]
        else:
            t_old, t_new = self._attn.shape[1], st["attn"].shape[1]
            width = max(t_old, t_new)

            def lpad(x: torch.Tensor, dim: int) -> torch.Tensor:
                missing = width - x.shape[dim]
                if missing == 0:
                    return x
                shape = list(x.shape)
                shape[dim] = missing
                return torch.cat([x.new_zeros(shape), x], dim=dim)

            for old, nl in zip(self._cache.layers, cache.layers):
                old.keys = torch.cat([lpad(old.keys, 2), lpad(nl.keys, 2)], dim=0)
                old.values = torch.cat([lpad(old.values, 2), lpad(nl.values, 2)], dim=0)
            self._attn = torch.cat([lpad(self._attn, 1), lpad(st["attn"], 1)], dim=0)
        self._next = torch.cat([self._next, st["next"]])
        self._pos = torch.cat([self._pos, st["pos"]])
        self._plen = torch.cat([self._plen, st["plen"]])
        self._ngen = torch.cat([self._ngen, st["ngen"]])
        self._toks = torch.cat([self._toks, st["toks"]])
        self._lps = torch.cat([self._lps, st["lps"]])
        self._ent = torch.cat([self._ent, st["ent"]])
        self._keys = torch.cat([self._keys, st["keys"]])
        self._lastv = torch.cat([self._lastv, st["lastv"]])

    def _finished_mask(self) -> torch.Tensor:
        """[B] bool, on the device: the row's last sample was EOS or it reached ``max_new_tokens``."""
        last = self._toks.gather(1, (self._ngen - 1)[:, None]).squeeze(1)
        return (last == self.eos_id) | (self._ngen >= self.max_new_tokens)

    def _decode(self) -> None:
        """One decode step for every row in the batch: feed the pending tokens, sample the next ones.

        With ``sync_every == 1`` every row is live here (finished rows left after the previous step).
        Otherwise rows that finished since the last synchronisation are still in the batch: their
        samples are discarded by masked updates computed on the device, without a host sync."""
        b = len(self._rows)
        attn = torch.cat([self._attn, torch.ones((b, 1), dtype=torch.long, device=self.device)], dim=1)
        logits = self.model(
            input_ids=self._next[:, None],
            attention_mask=attn,
            position_ids=self._pos[:, None],
            past_key_values=self._cache,
            use_cache=True,
        ).logits[:, -1, :]
        self._attn = attn
        nxt, lp, ent = self._sample(logits, self._keys, self._ngen)
        if self.sync_every == 1:
            idx = self._ngen[:, None]
            self._toks.scatter_(1, idx, nxt[:, None])
            self._lps.scatter_(1, idx, lp[:, None])
            self._ngen += 1
            self._ent += ent
            self._lastv.fill_(self.version)
        else:
            live = ~self._finished_mask()
            idx = self._ngen.clamp(max=self.max_new_tokens - 1)[:, None]
            self._toks.scatter_(1, idx, torch.where(live, nxt, self._toks.gather(1, idx).squeeze(1))[:, None])
            self._lps.scatter_(1, idx, torch.where(live, lp, self._lps.gather(1, idx).squeeze(1))[:, None])
            self._ngen += live.long()
            self._ent += torch.where(live, ent, torch.zeros_like(ent))
            self._lastv = torch.where(live, torch.full_like(self._lastv, self.version), self._lastv)
        self._pos += 1
        self._next = nxt

    def _emit_finished(self, fin: torch.Tensor, rows: Sequence, out: list[Trajectory]) -> list[int]:
        """Append the trajectories of the rows flagged in ``fin`` (one host copy of their tokens,
        log-probs, lengths, entropies and last versions) to ``out``; returns their indices."""
        fin_idx = fin.nonzero().squeeze(1).cpu().tolist()
        toks, lps, ngen, ent, lastv = (
            x[fin].cpu() for x in (self._toks, self._lps, self._ngen, self._ent, self._lastv)
        )
        for j, i in enumerate(fin_idx):
            n = int(ngen[j])
            row = rows[i]
            out.append(
                self._trajectory(
                    row.request,
                    toks[j, :n].tolist(),
                    lps[j, :n].tolist(),
                    row.version,
                    int(lastv[j]),
                    float(ent[j]),
                )
            )
        return fin_idx

    def _retire_finished(self, out: list[Trajectory]) -> None:
        """Rows whose last sample was EOS or reached ``max_new_tokens`` leave the batch now."""
        if not self._rows:
            return
        fin = self._finished_mask()
        if not bool(fin.any()):
            return
        fin_idx = self._emit_finished(fin, self._rows, out)
        keep = (~fin).nonzero().squeeze(1)
        gone = set(fin_idx)
        self._rows = [r for i, r in enumerate(self._rows) if i not in gone]
        if not self._rows:
            self._reset_batch()
            return
        self._select(keep)

    def _select(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (batch index selection) and trim leading all-padding columns."""
        attn = self._attn.index_select(0, keep)
        first = int(attn.any(0).int().argmax())  # first column some remaining row attends to
        for layer in self._cache.layers:  # narrow first (a view), so only kept columns are copied
            layer.keys = layer.keys[:, :, first:].index_select(0, keep)
            layer.values = layer.values[:, :, first:].index_select(0, keep)
        self._attn = attn[:, first:]
        for name in ("_next", "_pos", "_plen", "_ngen", "_toks", "_lps", "_ent", "_keys", "_lastv"):
            setattr(self, name, getattr(self, name).index_select(0, keep))

    def _reprefill_active(self) -> None:
        """Rebuild the running cache under the current weights: each row's prompt + response tokens,
        less the pending one (pending tokens, positions and every recorded value stay)."""
        with torch.inference_mode():
            toks, ngen = self._toks.cpu(), self._ngen.cpu().tolist()
            seqs = [
                list(row.request.prompt.prompt_tokens) + toks[i, : ngen[i] - 1].tolist()
                for i, row in enumerate(self._rows)
            ]
            cache, attn, _ = self._prefill(seqs)
            self._cache, self._attn = cache, attn

    def _trajectory(
        self,
        req: GenRequest,
        ids: list[int],
        logps: list[float],
        version: int,
        last_version: int,
        ent_sum: float,
    ) -> Trajectory:
        finished = bool(ids) and ids[-1] == self.eos_id
        body = ids[:-1] if finished else ids
        return Trajectory(
            kind="trajectory",
            prompt=req.prompt,
            sample_idx=req.sample_idx,
            response_tokens=tuple(int(i) for i in ids),
            behaviour_logprobs=tuple(np.asarray(logps, dtype=np.float64).tolist()),
            version=version,
            finished=finished,
            text=self.tokenizer.decode(body, skip_special_tokens=True),
            mean_entropy=ent_sum / max(1, len(ids)),
            group_uid=req.group_uid,
            last_version=last_version,
        )
