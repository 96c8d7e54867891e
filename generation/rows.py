"""The running rows of the engine's joinable layouts: rows join and leave between decode steps.

- ``DynamicRows``: one ``DynamicCache`` grown by concatenation. Newly admitted rows are prefilled
  together (one left-padded forward) and their cache is merged into the running one by
  left-padding the narrower of the two along the sequence axis (every row's newest token stays in
  the last column) and concatenating along the batch axis; the per-row attention mask marks the
  padding and per-row position ids keep RoPE right, so running rows are never recomputed. Finished
  rows leave by batch index selection, and leading all-padding columns are trimmed.
- ``SlotRows``: a static cache ``[capacity, kv_heads, width, head_dim]`` per layer allocated once: a
  request occupies a slot from admission to retirement; every occupied row writes its next key/value
  at the same column ``c`` (a joining row's prefill goes to columns ``[c - w, c)``), a per-slot
  validity mask becomes the additive 4-D attention mask, and when ``c`` reaches the width the live
  span moves left (or the buffers grow). Fixed shapes: the decode forward can be captured once as a
  CUDA graph (``cuda_graphs``) and replayed. On the CPU the eager step runs over the occupied slot
  prefix and the live column span only, and sparse slots move down (the long tail).

Row state between steps: the cache holds a row's prompt and every response token but the last; the
last sampled token is *pending* (fed at the next decode step, at position ``len(prompt) + n - 1``).
On CUDA finished rows are marked on the device and leave only every ``sync_every`` steps (their later
samples are discarded by masked updates), so the loop does not synchronise with the host each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from generation.records import GenRequest, Partial, Trajectory
from generation.sampler import row_key


def merge_rows(cache, attn: torch.Tensor, new_cache, new_attn: torch.Tensor) -> torch.Tensor:
    """Append ``new_cache``'s rows after ``cache``'s (in place, layer by layer), left-padding the
    narrower of the two along the sequence axis so that every row's newest cached token stays in the
    last column; returns the merged attention mask (``attn`` over ``new_attn``, padding 0)."""
    width = max(attn.shape[1], new_attn.shape[1])

    def lpad(x: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - x.shape[dim]
        if missing == 0:
            return x
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([x.new_zeros(shape), x], dim=dim)

    for old, nl in zip(cache.layers, new_cache.layers):
        old.keys = torch.cat([lpad(old.keys, 2), lpad(nl.keys, 2)], dim=0)
        old.values = torch.cat([lpad(old.values, 2), lpad(nl.values, 2)], dim=0)
    return torch.cat([lpad(attn, 1), lpad(new_attn, 1)], dim=0)


def select_rows(cache, attn: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Keep the rows ``keep`` (batch indices) of ``cache`` (in place) and cut the leading columns no
    kept row attends to; returns the kept rows' attention mask."""
    attn = attn.index_select(0, keep)
    first = int(attn.any(0).int().argmax())  # first column some remaining row attends to
    for layer in cache.layers:  # narrow first (a view), so only kept columns are copied
        layer.keys = layer.keys[:, :, first:].index_select(0, keep)
        layer.values = layer.values[:, :, first:].index_select(0, keep)
    return attn[:, first:]


@dataclass
class Row:
    request: GenRequest
    version: int  # the version that sampled the first response token


def _partial(row: Row, toks, lps, n: int, ent: float) -> Partial:
    return Partial(
        request=row.request,
        tokens=tuple(toks[:n].tolist()),
        logprobs=tuple(lps[:n].tolist()),
        version=row.version,
        entropy_sum=float(ent),
    )


class DynamicRows:
    """The engine's running rows over one ``DynamicCache`` (see the module docstring); ``e``: the
    engine (model, sampler, settings, queues)."""

    joins = True

    def __init__(self, engine):
        self.e = engine
        self.reset()

    def reset(self) -> None:
        dev = self.e.device
        self._rows: list[Row] = []
        self._cache = None  # DynamicCache or None
        self._attn = torch.zeros((0, 0), dtype=torch.long, device=dev)  # [B, T] over cached columns
        self._next = torch.zeros(0, dtype=torch.long, device=dev)  # [B] pending token
        self._pos = torch.zeros(0, dtype=torch.long, device=dev)  # [B] its position id
        self._plen = torch.zeros(0, dtype=torch.long, device=dev)  # [B] prompt length
        self._ngen = torch.zeros(0, dtype=torch.long, device=dev)  # [B] response tokens so far
        self._toks = torch.zeros((0, self.e.max_new_tokens), dtype=torch.long, device=dev)
        self._lps = torch.zeros((0, self.e.max_new_tokens), dtype=torch.float32, device=dev)
        self._ent = torch.zeros(0, dtype=torch.float64, device=dev)  # [B] entropy sums
        self._keys = torch.zeros(0, dtype=torch.long, device=dev)  # [B] noise keys
        self._lastv = torch.zeros(0, dtype=torch.long, device=dev)  # [B] version of the last token

    def _prefill_rows(self, new):
        """Prefill ``new`` rows (request, tokens and log-probs so far, version, entropy sum) and sample
        each one's next token: (seqs, cache, attn, keys, ngen, toks, lps, next, entropy), the token
        and log-prob buffers [b, max_new_tokens] holding the sampled token at column ngen."""
        dev, m = self.e.device, self.e.max_new_tokens
        seqs = [list(r.prompt.prompt_tokens) + list(toks) for r, toks, _, _, _ in new]
        cache, attn, logits = self.e._prefill(seqs)
        b = len(new)
        ngen = torch.tensor([len(toks) for _, toks, _, _, _ in new], dtype=torch.long)
        toks_buf = torch.zeros((b, m), dtype=torch.long)
        lps_buf = torch.zeros((b, m), dtype=torch.float32)
        for i, (_, toks, lps, _, _) in enumerate(new):
            if toks:
                toks_buf[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                lps_buf[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        keys = torch.tensor([row_key(self.e.seed, r) for r, *_ in new], dtype=torch.long, device=dev)
        ngen, toks_buf, lps_buf = ngen.to(dev), toks_buf.to(dev), lps_buf.to(dev)
        nxt, lp, ent = self.e._sample(logits, keys, ngen)
        toks_buf.scatter_(1, ngen[:, None], nxt[:, None])
        lps_buf.scatter_(1, ngen[:, None], lp[:, None])
        return seqs, cache, attn, keys, ngen, toks_buf, lps_buf, nxt, ent

    def join(self, new) -> None:
        """Prefill ``new`` rows, sample their next token and merge them into the running batch."""
        dev = self.e.device
        seqs, cache, attn, keys, ngen, toks_buf, lps_buf, nxt, ent = self._prefill_rows(new)
        b = len(new)
        plen = torch.tensor([len(r.prompt.prompt_tokens) for r, *_ in new], dtype=torch.long, device=dev)
        ent_sum = torch.tensor([e for *_, e in new], dtype=torch.float64, device=dev) + ent
        self._rows.extend(Row(r, self.e.version if v is None else v) for r, _, _, v, _ in new)
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
            lastv=torch.full((b,), self.e.version, dtype=torch.long, device=dev),
        )
        self._merge(cache, new_state)

    def _merge(self, cache, st: dict) -> None:
        """Concatenate new rows (their cache and per-row tensors) after the running ones, left-padding
        the narrower cache so that every row's newest cached token sits in the last column."""
        if self._cache is None:
            self._cache = cache
            self._attn = st["attn"]
        else:
            self._attn = merge_rows(self._cache, self._attn, cache, st["attn"])
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
        return (last == self.e.eos_id) | (self._ngen >= self.e.max_new_tokens)

    def decode(self) -> None:
        """One decode step for every row in the batch: feed the pending tokens, sample the next ones.

        With ``sync_every == 1`` every row is live here (finished rows left after the previous step).
        Otherwise rows that finished since the last synchronisation are still in the batch: their
        samples are discarded by masked updates computed on the device, without a host sync."""
        b = len(self._rows)
        attn = torch.cat([self._attn, torch.ones((b, 1), dtype=torch.long, device=self.e.device)], dim=1)
        logits = self.e.model(
            input_ids=self._next[:, None],
            attention_mask=attn,
            position_ids=self._pos[:, None],
            past_key_values=self._cache,
            use_cache=True,
        ).logits[:, -1, :]
        self._attn = attn
        nxt, lp, ent = self.e._sample(logits, self._keys, self._ngen)
        if self.e.sync_every == 1:
            idx = self._ngen[:, None]
            self._toks.scatter_(1, idx, nxt[:, None])
            self._lps.scatter_(1, idx, lp[:, None])
            self._ngen += 1
            self._ent += ent
            self._lastv.fill_(self.e.version)
        else:
            live = ~self._finished_mask()
            idx = self._ngen.clamp(max=self.e.max_new_tokens - 1)[:, None]
            self._toks.scatter_(1, idx, torch.where(live, nxt, self._toks.gather(1, idx).squeeze(1))[:, None])
            self._lps.scatter_(1, idx, torch.where(live, lp, self._lps.gather(1, idx).squeeze(1))[:, None])
            self._ngen += live.long()
            self._ent += torch.where(live, ent, torch.zeros_like(ent))
            self._lastv = torch.where(live, torch.full_like(self._lastv, self.e.version), self._lastv)
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
                self.e._trajectory(
                    row.request,
                    toks[j, :n].tolist(),
                    lps[j, :n].tolist(),
                    row.version,
                    int(lastv[j]),
                    float(ent[j]),
                )
            )
        return fin_idx

    def retire(self, out: list[Trajectory]) -> None:
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
            self.reset()
            return
        self._select(keep)

    def _select(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (batch index selection) and trim leading all-padding columns."""
        self._attn = select_rows(self._cache, self._attn, keep)
        for name in ("_next", "_pos", "_plen", "_ngen", "_toks", "_lps", "_ent", "_keys", "_lastv"):
            setattr(self, name, getattr(self, name).index_select(0, keep))

    def reprefill(self) -> None:
        """Rebuild the running cache under the current weights: each row's prompt + response tokens,
        less the pending one (pending tokens, positions and every recorded value stay)."""
        with torch.inference_mode():
            toks, ngen = self._toks.cpu(), self._ngen.cpu().tolist()
            seqs = [
                list(row.request.prompt.prompt_tokens) + toks[i, : ngen[i] - 1].tolist()
                for i, row in enumerate(self._rows)
            ]
            cache, attn, _ = self.e._prefill(seqs)
            self._cache, self._attn = cache, attn

    def take(self, chosen) -> list[Partial]:
        """Remove the rows whose request ``chosen(request)`` accepts; returns them as ``Partial``s (an
        active row's tokens include the pending one)."""
        take = [i for i, row in enumerate(self._rows) if chosen(row.request)]
        if not take:
            return []
        toks, lps, ngen, ent = (x.cpu() for x in (self._toks, self._lps, self._ngen, self._ent))
        partials = [_partial(self._rows[i], toks[i], lps[i], int(ngen[i]), ent[i]) for i in take]
        if len(take) == len(self._rows):
            self.reset()
        else:
            gone = set(take)
            keep = torch.tensor(
                [i for i in range(len(self._rows)) if i not in gone], dtype=torch.long, device=self.e.device
            )
            self._rows = [r for i, r in enumerate(self._rows) if i not in gone]
            self._select(keep)
        return partials

    def kv_tokens(self) -> int:
        return int((self._plen + self._ngen).sum()) if self._rows else 0

    def active(self) -> int:
        return len(self._rows)


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


class SlotRows(DynamicRows):
    """The engine's running rows in static slots (see the module docstring). ``static_width``: the
    initial number of cache columns (0: ``max_new_tokens + 128``); it grows when needed."""

    def __init__(self, engine, static_width: int = 0, cuda_graphs: bool = False):
        self._width = int(static_width) if static_width else engine.max_new_tokens + 128
        self._kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._graph = None
        self.cuda_graphs = bool(cuda_graphs) and engine._cuda
        # the narrowed eager step reads slot and column bounds on the host: the CPU only
        self.narrow = torch.device(engine.device).type == "cpu"
        self.graph_captures = 0
        self.slot_moves = 0
        self.layout_moves = 0
        self.compactions = 0
        super().__init__(engine)

    def reset(self) -> None:
        cap, m, dev = self.e.capacity, self.e.max_new_tokens, self.e.device
        self._rows = []
        self._slots: list[Row | None] = [None] * cap
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
        dev, cap = self.e.device, self.e.capacity
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

    def _finished_mask(self) -> torch.Tensor:
        last = self._toks.gather(1, (self._ngen - 1).clamp(min=0)[:, None]).squeeze(1)
        return (last == self.e.eos_id) | (self._ngen >= self.e.max_new_tokens)

    def join(self, new) -> None:
        dev = self.e.device
        seqs, cache, attn, keys, ngen, toks_buf, lps_buf, nxt, ent = self._prefill_rows(new)
        b, w = len(new), attn.shape[1]

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
        self._lastv[idx] = self.e.version
        self._occ[idx] = True
        for slot, (r, _, _, v, _) in zip(free, new):
            self._slots[slot] = Row(r, self.e.version if v is None else v)
        self._sync_rows()

    def _eager_forward(self) -> torch.Tensor:
        return self.e.model(
            input_ids=self._in_ids,
            attention_mask=self._mask4,
            position_ids=self._in_pos,
            past_key_values=self._slot_cache,
            use_cache=True,
        ).logits[:, -1, :]

    def _capture(self) -> None:
        """Capture one decode forward as a CUDA graph. The warm-up runs compute exactly what the
        replay will (same inputs, same cache column), so their cache writes are harmless."""
        stream = torch.cuda.Stream(device=self.e.device)
        stream.wait_stream(torch.cuda.current_stream(self.e.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._eager_forward()
        torch.cuda.current_stream(self.e.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_logits = self._eager_forward()
        self._graph = graph
        self.graph_captures += 1

    def decode(self) -> None:
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
        nxt, lp, ent = self.e._sample(logits, self._keys, self._ngen)
        live = self._occ & ~self._finished_mask()
        idx = self._ngen.clamp(max=self.e.max_new_tokens - 1)[:, None]
        self._toks.scatter_(1, idx, torch.where(live, nxt, self._toks.gather(1, idx).squeeze(1))[:, None])
        self._lps.scatter_(1, idx, torch.where(live, lp, self._lps.gather(1, idx).squeeze(1))[:, None])
        self._ngen += live.long()
        self._ent += torch.where(live, ent, torch.zeros_like(ent))
        self._lastv = torch.where(live, torch.full_like(self._lastv, self.e.version), self._lastv)
        self._pos += 1
        self._next = nxt
        self._c += 1

    def _narrow_forward(self, col: int) -> torch.Tensor:
        """The eager step over the occupied slot prefix and the live columns; logits [capacity, V]
        (rows past the prefix are free: zeros, their samples are discarded)."""
        hi = int(self._occ.nonzero().max()) + 1 if self._rows else 1
        lo = int(self._valid[:hi].any(0).int().argmax())
        cache = _NarrowCache(*self._kv, hi, lo, col)
        logits = self.e.model(
            input_ids=self._in_ids[:hi],
            attention_mask=self._mask4[:hi, :, :, lo : col + 1],
            position_ids=self._in_pos[:hi],
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1, :]
        if hi == self.e.capacity:
            return logits
        full = logits.new_zeros((self.e.capacity, logits.shape[-1]))
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
        waiting = bool(self.e._partials) or (self.e.admitting and bool(self.e._queue))
        if waiting and occupied[-1] + 1 < 2 * n:
            return
        src = [i for i in occupied if i >= n]
        dst = [i for i in range(n) if self._slots[i] is None][: len(src)]
        s_idx = torch.tensor(src, dtype=torch.long, device=self.e.device)
        d_idx = torch.tensor(dst, dtype=torch.long, device=self.e.device)
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
        idx = torch.tensor(slots, dtype=torch.long, device=self.e.device)
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

    def retire(self, out: list[Trajectory]) -> None:
        if not self._rows:
            return
        fin = self._occ & self._finished_mask()
        if not bool(fin.any()):
            return
        self._free(self._emit_finished(fin, self._slots, out))

    def reprefill(self) -> None:
        """Rebuild every occupied slot's cache under the current weights (prompt + response tokens
        less the pending one), laid out afresh ending at column ``w``."""
        with torch.inference_mode():
            occupied = [i for i, s in enumerate(self._slots) if s is not None]
            toks, ngen = self._toks.cpu(), self._ngen.cpu().tolist()
            seqs = [
                list(self._slots[i].request.prompt.prompt_tokens) + toks[i, : ngen[i] - 1].tolist()
                for i in occupied
            ]
            cache, attn, _ = self.e._prefill(seqs)
            w = attn.shape[1]
            self._ensure_kv(cache, w + 1)
            self._valid.zero_()
            idx = torch.tensor(occupied, dtype=torch.long, device=self.e.device)
            for layer, kbuf, vbuf in zip(cache.layers, *self._kv):
                kbuf[idx, :, :w] = layer.keys.to(kbuf.dtype)
                vbuf[idx, :, :w] = layer.values.to(vbuf.dtype)
            self._valid[idx, :w] = attn.bool()
            self._c = w

    def take(self, chosen) -> list[Partial]:
        take = [i for i, s in enumerate(self._slots) if s is not None and chosen(s.request)]
        if not take:
            return []
        toks, lps, ngen, ent = (x.cpu() for x in (self._toks, self._lps, self._ngen, self._ent))
        partials = [_partial(self._slots[i], toks[i], lps[i], int(ngen[i]), ent[i]) for i in take]
        self._free(take)
        return partials

    def kv_tokens(self) -> int:
        return int(((self._plen + self._ngen) * self._occ).sum()) if self._rows else 0
