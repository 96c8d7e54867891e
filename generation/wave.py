"""A wave: rows that start decoding together (no rows running, fresh requests: a batch call's
batch, a synchronous RL step), decoded on the engine's fastest path until they finish.

The prefill runs once per distinct prompt (a group's samples share theirs); the rows then decode
over a static KV cache in host shards (one thread each), finished rows compacted away. The decode
step is one of two strategies, chosen per wave: ``NativeStep`` (the whole step as one C call of
``generation.kernels`` over ``generation.fused_decode``'s fused weights, the prompts' keys/values
shared by their rows, not copied; Llama-family models in float32 on the CPU) and ``ModelStep`` (the
model's own forward with a grouped-query decode attention over the static cache: bf16, accelerators,
other models). Sampling is ``generation.sampler``'s (in C wherever the native kernels are built), so a
row samples what it samples on the engine's joinable layouts.
"""

from __future__ import annotations

import contextlib

import torch

from generation.records import Partial, Trajectory
from generation.sampler import row_keys, sample

MIN_SHARD_ROWS = 32
"""A host decode shard has at least this many rows: fewer pay more in per-step overhead than a second
thread saves."""


def shard_rows(bsz: int, device: str, decode_threads: int | None) -> list[torch.Tensor]:
    """A batch's rows split into contiguous shards decoded side by side, one host thread each
    (``decode_threads``, None: one per torch thread; one shard on accelerators and small batches)."""
    k = 1
    if device == "cpu":
        k = decode_threads if decode_threads is not None else torch.get_num_threads()
        k = max(1, min(k, bsz // MIN_SHARD_ROWS))
    return list(torch.arange(bsz).tensor_split(k))


class Outputs:
    """A wave's samples, written row by row by the decode shards: tokens and log-probs
    [rows, max_new_tokens], entropy sums, lengths and done flags [rows]."""

    def __init__(self, bsz: int, max_new_tokens: int):
        self.tokens = torch.empty((bsz, max_new_tokens), dtype=torch.long)
        self.logps = torch.zeros((bsz, max_new_tokens))
        self.ent_sum = torch.zeros(bsz)
        self.lengths = torch.full((bsz,), max_new_tokens, dtype=torch.long)
        self.done = torch.zeros(bsz, dtype=torch.bool)


class NativeStep:
    """The whole decode step as one native call over the prompts' shared keys/values (``PromptKV``)
    and each row's own completion columns (``CompletionKV``)."""

    def __init__(self, fused, prompt_kv, of_row, columns: int, store):
        self.fused, self.prompt = fused, prompt_kv
        self.slots = CompletionKV(prompt_kv, of_row, columns, store)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, t: int) -> torch.Tensor:
        return self.fused.step_shared(ids, pos, self.prompt, self.slots, t - 1)

    def select(self, sel: torch.Tensor, t: int) -> None:
        self.slots.select(sel, t)


class ModelStep:
    """The model's own forward over a static cache filled from the prefill (row i from its prompt's
    row ``of_row[i]``), left padding masked; its attention is switched to ``_gqa_decode_attention``
    while the wave decodes (``decode_attention``)."""

    def __init__(self, model, prefill, of_row, pad_rows, plen: int, width: int, store, device):
        self.model, self.plen = model, plen
        self.slots = StaticDecodeCache(prefill, width, of_row, store=store)
        dtype = self.slots.values[0].dtype
        self.mask = torch.zeros((len(of_row), 1, 1, width), dtype=dtype, device=device)
        self.mask[:, 0, 0, :plen].masked_fill_(
            pad_rows, torch.finfo(dtype).min
        )  # left padding: never attended

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, t: int) -> torch.Tensor:
        col = self.plen + t - 1
        self.slots.col = col
        return self.model(
            input_ids=ids[:, None],
            attention_mask=self.mask[: len(ids), :, :, : col + 1],
            position_ids=pos[:, None],
            past_key_values=self.slots,
            use_cache=True,
        ).logits[:, -1, :]

    def select(self, sel: torch.Tensor, t: int) -> None:
        self.slots.select(sel, self.plen + t)
        self.mask[: len(sel)] = self.mask.index_select(0, sel)


class _Shard:
    """One decode shard of a wave: its live rows (wave indices) and how many tokens each has."""

    def __init__(self, rows: torch.Tensor):
        self.rows, self.t, self.over = rows, 0, False
        self.loop = None


class Wave:
    """Rows that start together (see the module docstring); ``e``: the engine. ``advance`` decodes,
    ``retire`` hands finished rows out, ``take`` dissolves the wave into ``Partial``s."""

    joins = False

    def __init__(self, engine, rows: list):
        e = self.e = engine
        self._rows = rows
        requests = [r.request for r in rows]
        unique: dict[tuple[int, ...], int] = {}
        of_row = torch.tensor(
            [unique.setdefault(tuple(r.prompt.prompt_tokens), len(unique)) for r in requests]
        )
        cache, attn, logits = e._prefill(list(unique))
        plen, bsz, m = attn.shape[1], len(requests), e.max_new_tokens
        of_row_dev = of_row.to(e.device)
        logits = logits.index_select(0, of_row_dev)
        # the static cache: the token fed at step t (t >= 1) writes column plen + t - 1; the last
        # sampled token is never fed
        width = plen + m - 1
        fused = e._fused(width + 1)  # None unless the native step runs this wave
        self.model_step = fused is None
        native = fused.native if fused is not None else None
        sampler = e._native()  # the native sampling step, whatever the decode step (CPU)
        prompt_kv = PromptKV(cache, attn) if native is not None else None
        self.plen = torch.tensor([len(r.prompt.prompt_tokens) for r in requests])
        self.out = Outputs(bsz, m)
        self.keys = row_keys(e.seed, requests)
        self.emitted = torch.zeros(bsz, dtype=torch.bool)
        pad_rows = attn.index_select(0, of_row_dev) == 0
        step_pos = (attn.sum(-1) - 1).index_select(0, of_row_dev)  # each prompt's last position
        self.shards = []
        for i, rows in enumerate(shard_rows(bsz, e.device, e.decode_threads)):
            rows_dev = rows.to(e.device)
            part = [x.index_select(0, rows_dev) for x in (logits, of_row_dev, pad_rows, step_pos)]
            while len(e._kv_store) <= i:
                e._kv_store.append([])
            store = e._kv_store[i] if e.device == "cpu" else None
            if native is not None:
                step = NativeStep(fused, prompt_kv, part[1], m - 1, store)
            else:
                step = ModelStep(e.model, cache, part[1], part[2], plen, width, store, e.device)
            shard = _Shard(rows)
            shard.loop = self._decode(shard, part[0], part[3], step, sampler)
            self.shards.append(shard)

    def _decode(self, shard: _Shard, logits, step_pos, step, native):
        """The decode loop of one shard from its rows' first-token ``logits``: yields after each
        sampled token (``shard.t`` tokens per live row), finished rows compacted away. ``native``: the
        kernels to sample with (logits of another dtype are cast to float32 first), or None."""
        e, out = self.e, self.out
        done, rows = out.done, shard.rows
        n_all = len(rows)
        step_ids = None  # the tokens fed at step t >= 1: those sampled at t - 1
        if native is not None:
            next_buf = torch.empty(n_all, dtype=torch.long)
            keep_buf = torch.empty(n_all, dtype=torch.bool)
        for t in range(e.max_new_tokens):
            if t > 0:
                logits = step(step_ids, step_pos, t)
            n = len(rows)
            if native is not None:
                if logits.dtype != torch.float32 or logits.stride(-1) != 1:
                    logits = logits.float().contiguous()
                nxt, keep = next_buf[:n], keep_buf[:n]
                kept = native.sample_step(
                    logits, e.temperature, self.keys, rows, t, e.eos_id,
                    out.tokens, out.logps, out.ent_sum, out.lengths, done, nxt, keep,
                )  # fmt: skip
                n_done = n - kept
                step_ids = nxt  # read by the next step before the buffer is written again
            else:
                nxt, lp, ent = sample(logits.cpu(), e.temperature, self.keys[rows], torch.full((n,), t))
                live = ~done[rows]
                idx = rows[live]
                out.ent_sum[idx] += ent[live].float()
                out.tokens[idx, t] = nxt[live]
                out.logps[idx, t] = lp[live]
                newly = idx[nxt[live] == e.eos_id]
                out.lengths[newly] = t + 1
                done[newly] = True
                keep = ~done[rows]
                n_done = n - int(keep.sum())
                step_ids = nxt.to(e.device)
            step_pos = step_pos + 1
            shard.t = t + 1
            if n_done == n:
                shard.rows = rows[:0]
                return
            if n_done and n_done * 8 >= n:  # compact: finished rows leave the batch
                sel = keep.nonzero().squeeze(1)
                sel_dev = sel.to(e.device)
                step.select(sel_dev, t)
                rows, step_ids, step_pos = rows[sel], step_ids[sel_dev], step_pos[sel_dev]
                shard.rows = rows
            yield

    def advance(self, k: int) -> int:
        """Up to ``k`` decode steps of every shard (side by side in host threads); returns the steps
        taken (fewer when every row finished)."""
        before = max(s.t for s in self.shards)

        def run(i: int) -> None:
            shard = self.shards[i]
            for _ in range(k):
                if shard.over:
                    return
                try:
                    next(shard.loop)
                except StopIteration:
                    shard.over = True

        # the model's own forward decodes through ``_gqa_decode_attention``, switched on once for all
        # shards (the switch is the model config's, shared by the threads)
        with decode_attention(self.e.model) if self.model_step else contextlib.nullcontext():
            if len(self.shards) == 1:
                run(0)
            else:
                self.e._threads.run(run, len(self.shards), inference=True)
        return max(s.t for s in self.shards) - before

    def _finished(self) -> torch.Tensor:
        """[rows] bool: sampled EOS or reached the cap, not yet handed out."""
        fin = self.out.done.clone()
        for s in self.shards:
            if s.over or s.t >= self.e.max_new_tokens:
                fin[s.rows] = True
        return fin & ~self.emitted

    def retire(self, out: list[Trajectory]) -> None:
        fin = self._finished()
        idx = fin.nonzero().squeeze(1).tolist()
        if not idx:
            return
        o = self.out
        toks, lps, ent, lengths = o.tokens[fin], o.logps[fin], o.ent_sum[fin], o.lengths[fin]
        for j, i in enumerate(idx):
            row, n = self._rows[i], int(lengths[j])
            out.append(
                self.e._trajectory(
                    row.request,
                    toks[j, :n].tolist(),
                    lps[j, :n].tolist(),
                    row.version,
                    row.version,
                    float(ent[j]),
                )
            )
        self.emitted[fin] = True
        self._rows = [r if not self.emitted[i] else None for i, r in enumerate(self._rows)]
        if all(r is None for r in self._rows):
            self._rows = []

    def active(self) -> int:
        return int((~self.emitted).sum()) if self._rows else 0

    def take(self, chosen=None) -> list[Partial]:
        """The live rows whose request ``chosen(request)`` accepts (None: all), as ``Partial``s (their
        tokens so far); they leave the wave (a shard still steps them until it compacts, unread)."""
        o, partials = self.out, []
        for s in self.shards:
            for i in s.rows.tolist():
                row = self._rows[i] if self._rows else None
                if row is None or self.emitted[i] or bool(o.done[i]) or s.t >= self.e.max_new_tokens:
                    continue
                if chosen is not None and not chosen(row.request):
                    continue
                partials.append(
                    Partial(
                        request=row.request,
                        tokens=tuple(o.tokens[i, : s.t].tolist()),
                        logprobs=tuple(o.logps[i, : s.t].tolist()),
                        version=row.version,
                        entropy_sum=float(o.ent_sum[i]),
                    )
                )
                self.emitted[i] = True
                self._rows[i] = None
        if self._rows and bool(self.emitted.all()):
            self._rows = []
        return partials

    def kv_tokens(self) -> int:
        if not self._rows:
            return 0
        live = ~self.emitted
        ngen = torch.zeros(len(live), dtype=torch.long)
        for s in self.shards:
            ngen[s.rows] = s.t
        return int(((self.plen + ngen) * live).sum())


_DECODE_ATTN = "laminar_decode"


def _store_buffer(store: list | None, slot: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [shape] tensor: a view of the ``store``'s buffer ``slot`` when that is large
    enough (a host engine keeps its buffers from batch to batch: fresh pages cost more than the
    copies into them), else a new one (kept in the store)."""
    if store is None:
        return like.new_empty(shape)
    while len(store) <= slot:
        store.append(None)
    buf = store[slot]
    if (
        buf is None
        or buf.dim() != len(shape)
        or buf.dtype != like.dtype
        or buf.device != like.device
        or any(have < need for have, need in zip(buf.shape, shape))
    ):
        grown = shape if buf is None or buf.dim() != len(shape) else tuple(map(max, buf.shape, shape))
        buf = store[slot] = like.new_empty(grown)
    return buf[tuple(slice(0, n) for n in shape)]


class PromptKV:
    """The native decode's prompt part of the KV cache, shared by every row with that prompt (a
    group's samples) and every decode shard: per layer the prefill's keys transposed [U, kv,
    head_dim, P] and values [U, kv, P, head_dim] of the U distinct prompts, and the additive mask [U,
    P] of their left padding. Nothing is copied per row."""

    def __init__(self, prefill_cache, attn: torch.Tensor):
        self.keys = [layer.keys.transpose(-1, -2).contiguous() for layer in prefill_cache.layers]
        self.values = [layer.values.contiguous() for layer in prefill_cache.layers]
        dtype = self.values[0].dtype
        self.mask = torch.zeros(attn.shape, dtype=dtype).masked_fill_(attn.cpu() == 0, torch.finfo(dtype).min)


class CompletionKV:
    """The native decode's per-row part of the KV cache: the keys and values of the tokens a row has
    sampled, per layer keys [rows, kv, blocks, head_dim, 16] (blocks of 16 columns, each transposed:
    the layout of ``generation/kernels/decode.c``) and values [rows, kv, columns, head_dim], and each
    row's prompt (``prompt_of``, an index into ``PromptKV``). ``select`` keeps some rows (finished
    ones leave), copying only the columns written so far."""

    def __init__(self, prompt: PromptKV, prompt_of: torch.Tensor, columns: int, store: list | None):
        self.store, self.set = store, 0
        self.caches = None
        """The native step's checked view of these buffers (``NativeModel.cache_pointers``)."""
        self.prompt_of = prompt_of.contiguous()
        rows = len(prompt_of)
        blocks = max(1, -(-columns // 16))
        self.keys, self.values = [], []
        for i, (pk, pv) in enumerate(zip(prompt.keys, prompt.values)):
            _, kv, d, _ = pk.shape
            self.keys.append(_store_buffer(store, 2 * i, (rows, kv, blocks, d, 16), pk))
            self.values.append(_store_buffer(store, 2 * i + 1, (rows, kv, blocks * 16, d), pv))

    def select(self, keep: torch.Tensor, upto: int) -> None:
        """Rows ``keep`` (indices into the current rows) move to the front, completion columns
        ``[0, upto)``, gathered into the store's other set of buffers (one copy)."""
        m, n_layers = len(keep), len(self.keys)
        blocks = -(-upto // 16)
        self.set = 1 - self.set
        base = 2 * n_layers * self.set
        for i in range(n_layers):
            for j, (bufs, cols) in enumerate(
                ((self.keys, lambda b: b[:, :, :blocks]), (self.values, lambda b: b[:, :, :upto]))
            ):
                buf = bufs[i]
                target = _store_buffer(self.store, base + 2 * i + j, tuple(buf.shape), buf)
                torch.index_select(cols(buf), 0, keep, out=cols(target)[:m])
                bufs[i] = target
        self.prompt_of = self.prompt_of.index_select(0, keep)
        self.caches = None


def decode_attention_supported(model) -> bool:
    """The static decode needs a model whose attention layers call Hugging Face's attention
    interface with SDPA (Llama, Qwen2, Mistral, ... as loaded here): ours replaces it for the
    one-token decode steps only."""
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "_attn_implementation", None) in ("sdpa", _DECODE_ATTN)


def _gqa_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of one new token per row over a (strided) static cache, grouped-query aware without
    repeating the keys/values: query [B, H, 1, D], key/value [B, KV, T, D], ``attention_mask`` the
    additive [B, 1, 1, T] mask. Two batched matmuls and a softmax; the same result as SDPA up to
    float rounding (``tests/generation/test_wave.py`` bounds it)."""
    b, h, q_len, d = query.shape
    if q_len != 1:  # not a decode step: SDPA as usual
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    kv = key.shape[1]
    scores = torch.matmul(query.reshape(b, kv, h // kv, d), key.transpose(-1, -2))  # [B, KV, G, T]
    scores = scores.mul_(d**-0.5 if scaling is None else scaling).add_(attention_mask)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # [B, KV, G, D]
    return out.reshape(b, 1, h, d), None


class decode_attention:
    """Within the block the model's attention layers use ``_gqa_decode_attention`` (registered once
    with Hugging Face's attention and mask interfaces); the model's own setting comes back after."""

    _registered = False

    def __init__(self, model):
        self.config = model.config

    def __enter__(self):
        if not decode_attention._registered:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(_DECODE_ATTN, _gqa_decode_attention)
            AttentionMaskInterface.register(_DECODE_ATTN, sdpa_mask)
            decode_attention._registered = True
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = _DECODE_ATTN
        return self

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved
        return False


class StaticDecodeCache:
    """The cache object handed to the model during decode (duck-typed like a Hugging Face ``Cache``):
    per layer one key and one value buffer [rows, kv_heads, width, head_dim], filled from the prefill's
    ``DynamicCache`` (its row ``rows[i]`` into row i when ``rows`` is given); ``update`` writes the step's
    key/value at column ``col`` of the first ``rows`` rows and returns views of columns ``[0, col]``
    (nothing is concatenated or copied per step)."""

    is_compileable = False

    def __init__(
        self,
        prefill_cache,
        width: int,
        rows: torch.Tensor | None = None,
        store: list | None = None,
    ):
        self.keys, self.values = [], []
        self.store = store
        self.set = 0
        """Which of the store's two sets of buffers holds the cache (``select`` alternates them)."""
        for i, layer in enumerate(prefill_cache.layers):
            b, h, p, d = layer.keys.shape
            b = b if rows is None else len(rows)
            keys = layer.keys if rows is None else layer.keys.index_select(0, rows)
            v = _store_buffer(self.store, 2 * i + 1, (b, h, width, layer.values.shape[-1]), layer.values)
            v[:, :, :p] = layer.values if rows is None else layer.values.index_select(0, rows)
            k = _store_buffer(self.store, 2 * i, (b, h, width, d), keys)
            k[:, :, :p] = keys
            self.keys.append(k)
            self.values.append(v)
        self.rows = self.values[0].shape[0]
        self.col = p

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        n, c = key_states.shape[0], self.col
        k, v = self.keys[layer_idx][:n], self.values[layer_idx][:n]
        k[:, :, c : c + 1] = key_states
        v[:, :, c : c + 1] = value_states
        return k[:, :, : c + 1], v[:, :, : c + 1]

    def select(self, keep: torch.Tensor, upto: int) -> None:
        """Rows ``keep`` (indices into the current rows) move to the front, columns ``[0, upto)``. With a
        ``store`` the rows are gathered straight into the store's other set of buffers (one copy),
        which then become the cache."""
        m = len(keep)
        n_keys = len(self.keys)
        if self.store is not None:
            self.set = 1 - self.set
        for i, buf in enumerate((*self.keys, *self.values)):
            is_key = i < n_keys
            if self.store is None:
                view = buf[:, :, :upto]
                view[:m] = view.index_select(0, keep)
                continue
            layer = i if is_key else i - n_keys
            slot = 2 * n_keys * self.set + 2 * layer + (0 if is_key else 1)
            target = _store_buffer(self.store, slot, tuple(buf.shape), buf)
            torch.index_select(buf[:, :, :upto], 0, keep, out=target[:m, :, :upto])
            if is_key:
                self.keys[layer] = target
            else:
                self.values[layer] = target
        self.rows = m

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.col

    def __len__(self) -> int:
        return len(self.keys)
