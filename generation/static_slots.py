"""``StaticSlotEngine``: the continuous-batching engine over a static key/value cache, so that its
decode step has fixed shapes and can be captured once as a CUDA graph and replayed.

``ContinuousEngine`` grows its cache by concatenation and shrinks it by batch selection: shapes change
every step, which is fine for the CPU but leaves a GPU waiting on Python (a decode step of a 0.5B
model costs ~17 ms of launch overhead whatever the batch). Here every layer owns one buffer
``[capacity, kv_heads, width, head_dim]`` allocated once:

- a request occupies a **slot** (a batch row) from admission to retirement; free slots stay in the
  batch, fully masked, and their samples are discarded;
- all occupied rows write their next key/value at the same **column** ``c`` (their newest cached token
  sits at ``c - 1``, as in ``ContinuousEngine``'s left alignment); a joining row's prefill is placed
  in columns ``[c - w, c)`` of its slot; a per-slot validity mask (``[capacity, width]``) becomes the
  additive 4-D attention mask handed to the model as-is (so Hugging Face builds no mask per step);
- when ``c`` reaches the width, the columns no occupied row uses any more are dropped by moving the
  live span left (rare, on the host); when a live span needs more room, the buffers grow (and a
  captured graph is recaptured).

Everything else (queues, admission, Gumbel-max counter-hash sampling, behaviour log-probs, lazy
retirement every ``sync_every`` steps, extract/inject, weight loads with re-prefill) is
``ContinuousEngine``'s. A request's tokens do not depend on which engine samples it, up to float noise
in the logits from a different attention width (``tests/training/test_static_slots.py``).

**Narrowed eager decode on the CPU.** Without a graph nothing needs fixed shapes, so on the CPU a
decode step runs over the occupied slot prefix ``[0, hi)`` and the live column span ``[lo, c]`` only
(views of the buffers: nothing is copied), and when the occupied slots become sparse (the long tail:
a few stragglers in high slots) they move down to the lowest free slots. The step then costs what the
live rows and columns cost, as ``ContinuousEngine``'s does, but without its per-step concatenation and
batch selection of the whole cache. Masked columns add exact zeros to the softmax, so only float
noise (a different reduction length) separates it from the full-width step.

``cuda_graphs=True`` (CUDA only) captures the model forward of one decode step (embedding, every
layer's attention over the static buffers, the LM head) and replays it; the sampling around it runs
eagerly. The static path runs on the CPU too (without graphs), which is how it is tested here.
"""

from __future__ import annotations

import torch

from generation.continuous import ContinuousEngine, _Row
from generation.records import GenRequest, Partial, Trajectory


class _SlotCache:
    """The cache object handed to the model (duck-typed like a Hugging Face ``Cache``): each layer's
    ``update`` writes the step's key/value at column ``col`` (a device index, so a captured graph
    reads it at replay) and returns the layer's whole buffers."""

    is_compileable = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], col: torch.Tensor):
        self.keys, self.values, self.col = keys, values, col

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.col, key_states.to(k.dtype))
        v.index_copy_(2, self.col, value_states.to(v.dtype))
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # position ids are always given; the 4-D mask carries the rest

    def __len__(self) -> int:
        return len(self.keys)


class _NarrowCache(_SlotCache):
    """The eager CPU step's cache: rows ``[0, hi)`` and columns ``[lo, col]`` of the slot buffers
    (views); ``update`` writes the step's key/value at the last of those columns."""

    def __init__(self, keys, values, hi: int, lo: int, col: int):
        super().__init__(
            [k[:hi, :, lo : col + 1] for k in keys], [v[:hi, :, lo : col + 1] for v in values], None
        )

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[:, :, -1:].copy_(key_states)
        v[:, :, -1:].copy_(value_states)
        return k, v


class StaticSlotEngine(ContinuousEngine):
    """``ContinuousEngine`` with a static slot cache (see the module docstring). ``static_width``: the
    initial number of cache columns (0: ``max_new_tokens + 128``); it grows when needed."""

    def __init__(self, model, tokenizer, *, static_width: int = 0, cuda_graphs: bool = False, **kwargs):
        self._width = int(static_width) if static_width else kwargs.get("max_new_tokens", 64) + 128
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._graph = None
        super().__init__(model, tokenizer, **kwargs)
        self.cuda_graphs = bool(cuda_graphs) and self._cuda
        # the narrowed eager step reads slot and column bounds on the host: the CPU only
        self.narrow = torch.device(self.device).type == "cpu"
        self.graph_captures = 0
        self.slot_moves = 0
        self.layout_moves = 0
        self.compactions = 0

    # ----------------------------------------------------------------------------- slot state

    def _reset_batch(self) -> None:
        cap, m, dev = self.capacity, self.max_new_tokens, self.device
        self._rows = []
        self._slots: list[_Row | None] = [None] * cap
        self._occ = torch.zeros(cap, dtype=torch.bool, device=dev)
        self._next = torch.zeros(cap, dtype=torch.long, device=dev)
        self._pos = torch.zeros(cap, dtype=torch.long, device=dev)
        self._plen = torch.zeros(cap, dtype=torch.long, device=dev)
        self._ngen = torch.ones(cap, dtype=torch.long, device=dev)
        self._toks = torch.zeros((cap, m), dtype=torch.long, device=dev)
        self._lps = torch.zeros((cap, m), dtype=torch.float32, device=dev)
        self._ent = torch.zeros(cap, dtype=torch.float64, device=dev)
        self._keys = torch.zeros(cap, dtype=torch.long, device=dev)
        self._lastv = torch.zeros(cap, dtype=torch.long, device=dev)
        self._c = 0
        if self._kv is not None:
            self._valid.zero_()

    def _sync_rows(self) -> None:
        self._rows = [r for r in self._slots if r is not None]

    def _ensure_kv(self, cache, width_needed: int) -> None:
        """Allocate the per-layer buffers (shape and dtype from a prefill's cache), or grow them so
        ``width_needed`` columns fit."""
        if self._kv is not None and self._width >= width_needed:
            return
        if self._kv is None:
            new_w = max(self._width, width_needed)
        else:  # grow geometrically: a capture per doubling at most
            new_w = max(2 * self._width, width_needed)
        new_w = -(-new_w // 8) * 8
        dev, cap = self.device, self.capacity
        keys, values = [], []
        for i, layer in enumerate(cache.layers):
            _, h, _, d = layer.keys.shape
            k = torch.zeros((cap, h, new_w, d), dtype=layer.keys.dtype, device=dev)
            v = torch.zeros((cap, h, new_w, layer.values.shape[-1]), dtype=layer.values.dtype, device=dev)
            if self._kv is not None:
                k[:, :, : self._width] = self._kv[0][i]
                v[:, :, : self._width] = self._kv[1][i]
            keys.append(k)
            values.append(v)
        valid = torch.zeros((cap, new_w), dtype=torch.bool, device=dev)
        if self._kv is not None:
            valid[:, : self._width] = self._valid
        self._kv, self._valid, self._width = (keys, values), valid, new_w
        self._mask4 = torch.zeros((cap, 1, 1, new_w), dtype=keys[0].dtype, device=dev)
        self._neg = torch.finfo(keys[0].dtype).min
        self._col = torch.zeros(1, dtype=torch.long, device=dev)
        self._in_ids = torch.zeros((cap, 1), dtype=torch.long, device=dev)
        self._in_pos = torch.zeros((cap, 1), dtype=torch.long, device=dev)
        self._slot_cache = _SlotCache(keys, values, self._col)
        self._graph = None

    def _move_to(self, new_c: int) -> None:
        """Move the live span (the columns some occupied row uses, ending at ``c``) so it ends at
        ``new_c``; columns outside it become invalid for every row."""
        self.layout_moves += 1
        if not self._rows:
            self._valid.zero_()
            self._c = new_c
            return
        first = int(self._valid.any(0).int().argmax())
        span = self._c - first
        for buf in (*self._kv[0], *self._kv[1]):
            buf[:, :, new_c - span : new_c] = buf[:, :, first : self._c].clone()
        moved = self._valid[:, first : self._c].clone()
        self._valid.zero_()
        self._valid[:, new_c - span : new_c] = moved
        self._c = new_c

    # ------------------------------------------------------------------------ engine hooks

    def _finished_mask(self) -> torch.Tensor:
        last = self._toks.gather(1, (self._ngen - 1).clamp(min=0)[:, None]).squeeze(1)
        return (last == self.eos_id) | (self._ngen >= self.max_new_tokens)

    def _join(self, new) -> None:
        dev, m = self.device, self.max_new_tokens
        seqs = [list(r.prompt.prompt_tokens) + list(toks) for r, toks, _, _, _ in new]
        cache, attn, logits = self._prefill(seqs)
        b, w = len(new), attn.shape[1]
        ngen = torch.tensor([len(toks) for _, toks, _, _, _ in new], dtype=torch.long)
        toks_buf = torch.zeros((b, m), dtype=torch.long)
        lps_buf = torch.zeros((b, m), dtype=torch.float32)
        for i, (_, toks, lps, _, _) in enumerate(new):
            if toks:
                toks_buf[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                lps_buf[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        keys = torch.tensor([self._row_key(r) for r, *_ in new], dtype=torch.long, device=dev)
        ngen, toks_buf, lps_buf = ngen.to(dev), toks_buf.to(dev), lps_buf.to(dev)
        nxt, lp, ent = self._sample(logits, keys, ngen)
        toks_buf.scatter_(1, ngen[:, None], nxt[:, None])
        lps_buf.scatter_(1, ngen[:, None], lp[:, None])

        # room: the new rows' cache ends at column c, so c >= w; one more column for the next step
        self._ensure_kv(cache, max(self._c, w) + 1)
        if self._c < w:
            self._move_to(w)
        c = self._c
        free = [i for i, s in enumerate(self._slots) if s is None][:b]
        idx = torch.tensor(free, dtype=torch.long, device=dev)
        for layer, kbuf, vbuf in zip(cache.layers, *self._kv):
            kbuf[idx, :, c - w : c] = layer.keys.to(kbuf.dtype)
            vbuf[idx, :, c - w : c] = layer.values.to(vbuf.dtype)
        self._valid[idx] = False
        self._valid[idx, c - w : c] = attn.bool()
        plen = torch.tensor([len(r.prompt.prompt_tokens) for r, *_ in new], dtype=torch.long, device=dev)
        ent_sum = torch.tensor([e for *_, e in new], dtype=torch.float64, device=dev) + ent
        self._next[idx] = nxt
        self._pos[idx] = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=dev)
        self._plen[idx] = plen
        self._ngen[idx] = ngen + 1
        self._toks[idx] = toks_buf
        self._lps[idx] = lps_buf
        self._ent[idx] = ent_sum
        self._keys[idx] = keys
        self._lastv[idx] = self.version
        self._occ[idx] = True
        for slot, (r, _, _, v, _) in zip(free, new):
            self._slots[slot] = _Row(r, self.version if v is None else v)
        self._sync_rows()

    def _row_key(self, request: GenRequest) -> int:
        from generation.sampler import row_key

        return row_key(self.seed, request)

    def _eager_forward(self) -> torch.Tensor:
        return self.model(
            input_ids=self._in_ids,
            attention_mask=self._mask4,
            position_ids=self._in_pos,
            past_key_values=self._slot_cache,
            use_cache=True,
        ).logits[:, -1, :]

    def _capture(self) -> None:
        """Capture one decode forward as a CUDA graph. The warm-up runs compute exactly what the
        replay will (same inputs, same cache column), so their cache writes are harmless."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._eager_forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_logits = self._eager_forward()
        self._graph = graph
        self.graph_captures += 1

    def _decode(self) -> None:
        if self._c >= self._width:
            first = int(self._valid.any(0).int().argmax())
            if first == 0:  # every column still in use: grow
                self._ensure_kv(self._slot_cache_as_prefill(), self._width + 1)
            else:
                self.compactions += 1
                self._move_to(self._c - first)
        col = self._c
        self._valid[:, col] = self._occ
        self._mask4.copy_(torch.where(self._valid, 0.0, self._neg)[:, None, None, :])
        self._col.fill_(col)
        self._in_ids.copy_(self._next[:, None])
        self._in_pos.copy_(self._pos[:, None])
        if self.cuda_graphs:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            logits = self._graph_logits
        elif self.narrow:
            logits = self._narrow_forward(col)
        else:
            logits = self._eager_forward()
        nxt, lp, ent = self._sample(logits, self._keys, self._ngen)
        live = self._occ & ~self._finished_mask()
        idx = self._ngen.clamp(max=self.max_new_tokens - 1)[:, None]
        self._toks.scatter_(1, idx, torch.where(live, nxt, self._toks.gather(1, idx).squeeze(1))[:, None])
        self._lps.scatter_(1, idx, torch.where(live, lp, self._lps.gather(1, idx).squeeze(1))[:, None])
        self._ngen += live.long()
        self._ent += torch.where(live, ent, torch.zeros_like(ent))
        self._lastv = torch.where(live, torch.full_like(self._lastv, self.version), self._lastv)
        self._pos += 1
        self._next = nxt
        self._c += 1

    def _narrow_forward(self, col: int) -> torch.Tensor:
        """The eager step over the occupied slot prefix and the live columns; logits [capacity, V]
        (rows past the prefix are free: zeros, their samples are discarded)."""
        hi = int(self._occ.nonzero().max()) + 1 if self._rows else 1
        lo = int(self._valid[:hi].any(0).int().argmax())
        cache = _NarrowCache(*self._kv, hi, lo, col)
        logits = self.model(
            input_ids=self._in_ids[:hi],
            attention_mask=self._mask4[:hi, :, :, lo : col + 1],
            position_ids=self._in_pos[:hi],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1, :]
        if hi == self.capacity:
            return logits
        full = logits.new_zeros((self.capacity, logits.shape[-1]))
        full[:hi] = logits
        return full

    def _compact_slots(self) -> None:
        """Narrowed CPU path: move the occupied slots above the lowest free ones down into them, so
        the step's slot prefix holds no free row. Skipped while queued work waits to be admitted
        (it fills the lowest free slots anyway) unless the prefix is more than half free."""
        occupied = [i for i, s in enumerate(self._slots) if s is not None]
        n = len(occupied)
        if not n or occupied[-1] + 1 == n:
            return
        waiting = bool(self._partials) or (self.admitting and bool(self._queue))
        if waiting and occupied[-1] + 1 < 2 * n:
            return
        src = [i for i in occupied if i >= n]
        dst = [i for i in range(n) if self._slots[i] is None][: len(src)]
        s_idx = torch.tensor(src, dtype=torch.long, device=self.device)
        d_idx = torch.tensor(dst, dtype=torch.long, device=self.device)
        lo = int(self._valid[s_idx].any(0).int().argmax())  # only the moved rows' live columns
        for buf in (*self._kv[0], *self._kv[1]):
            buf[d_idx, :, lo : self._c] = buf[s_idx, :, lo : self._c]
        for name in (
            "_occ",
            "_valid",
            "_next",
            "_pos",
            "_plen",
            "_ngen",
            "_toks",
            "_lps",
            "_ent",
            "_keys",
            "_lastv",
        ):
            t = getattr(self, name)
            t[d_idx] = t[s_idx]
        for a, b in zip(src, dst):
            self._slots[b] = self._slots[a]
        self.slot_moves += len(src)
        self._free(src)  # the vacated slots (the prefix is dense now: no further move)

    def _slot_cache_as_prefill(self):
        """Shapes for ``_ensure_kv`` when growing from the current buffers."""

        class _L:
            def __init__(self, k, v):
                self.keys, self.values = k, v

        return type("_C", (), {"layers": [_L(k, v) for k, v in zip(*self._kv)]})()

    def _free(self, slots: list[int]) -> None:
        if not slots:
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._occ[idx] = False
        self._valid[idx] = False
        self._ngen[idx] = 1
        for s in slots:
            self._slots[s] = None
        self._sync_rows()
        if not self._rows:
            self._c = 0
            self._valid.zero_()
        elif self.narrow:
            self._compact_slots()

    def _retire_finished(self, out: list[Trajectory]) -> None:
        if not self._rows:
            return
        fin = self._occ & self._finished_mask()
        if not bool(fin.any()):
            return
        self._free(self._emit_finished(fin, self._slots, out))

    def extract(self, include_queued: bool = True, only=None) -> tuple[list[Partial], list[GenRequest]]:
        from collections import deque

        from generation.sampler import request_key

        def chosen(r: GenRequest) -> bool:
            return only is None or request_key(r) in only

        partials: list[Partial] = []
        requests: list[GenRequest] = []
        if include_queued:
            partials.extend(p for p in self._partials if chosen(p.request))
            requests.extend(r for r in self._queue if chosen(r))
            self._partials = deque(p for p in self._partials if not chosen(p.request))
            self._queue = deque(r for r in self._queue if not chosen(r))
        take = [i for i, s in enumerate(self._slots) if s is not None and chosen(s.request)]
        if take:
            with torch.inference_mode():  # the slot tensors are inference tensors, updated in place
                self._extract_slots(take, partials)
        return partials, requests

    def _extract_slots(self, take: list[int], partials: list[Partial]) -> None:
        if take:
            toks, lps, ngen, ent = (x.cpu() for x in (self._toks, self._lps, self._ngen, self._ent))
            for i in take:
                row = self._slots[i]
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
            self._free(take)

    def status(self) -> dict:
        kv = int(((self._plen + self._ngen) * self._occ).sum()) if self._rows else 0
        return {
            "version": self.version,
            "queued": len(self._queue) + len(self._partials),
            "active": len(self._rows),
            "capacity": self.capacity,
            "kv_tokens": kv,
            "admitting": self.admitting,
        }

    def _reprefill_active(self) -> None:
        """Rebuild every occupied slot's cache under the current weights (prompt + response tokens
        less the pending one), laid out afresh ending at column ``w``."""
        with torch.inference_mode():
            occupied = [i for i, s in enumerate(self._slots) if s is not None]
            toks, ngen = self._toks.cpu(), self._ngen.cpu().tolist()
            seqs = [
                list(self._slots[i].request.prompt.prompt_tokens) + toks[i, : ngen[i] - 1].tolist()
                for i in occupied
            ]
            cache, attn, _ = self._prefill(seqs)
            w = attn.shape[1]
            self._ensure_kv(cache, w + 1)
            self._valid.zero_()
            idx = torch.tensor(occupied, dtype=torch.long, device=self.device)
            for layer, kbuf, vbuf in zip(cache.layers, *self._kv):
                kbuf[idx, :, :w] = layer.keys.to(kbuf.dtype)
                vbuf[idx, :, :w] = layer.values.to(vbuf.dtype)
            self._valid[idx, :w] = attn.bool()
            self._c = w
