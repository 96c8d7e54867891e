"""The built-in rollout engine: batched sampling with a KV cache, driving the model directly.

It records the behaviour log-prob of every sampled token (under the temperature-scaled
distribution it sampled from) and the weight version that produced it. Any Hugging Face causal LM
works; the decode loop is a plain ``forward(past_key_values=...)`` loop, which costs far less per
step than ``generate`` for small models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from generation.records import GenRequest, PromptItem, Trajectory, WeightsUpdate
from generation.sampler import row_keys, sample, seed_from
from generation.setup import HostThreads


class TorchEngine:
    def __init__(
        self,
        model,
        tokenizer,
        device: str = "cpu",
        batch_size: int = 256,
        static_cache: bool = True,
        fused_decode: bool = True,
    ):
        self.model = model.to(device).eval()
        self.static_cache = static_cache
        """Decode over a static KV cache with finished rows compacted away (``_generate_batch``); False:
        the reference loop (``_generate_batch_reference``), also taken for models whose attention is
        not SDPA."""
        self.fused_decode = fused_decode
        """Decode steps through ``generation.fused_decode`` where it reproduces the model (Llama-family);
        False: through the model's own forward."""
        self._fused_decoder = None
        self.native_kernels = True
        """On the CPU in float32 (head_dim a multiple of 16), run each decode step and each sampling
        step as one call of the native kernels (``generation.kernels``, built once per machine) where
        a C compiler is there; False (or ``LAMINAR_NATIVE_KERNELS=0``): torch ops only."""
        self._kv_store: list[list] = []
        """Per decode shard, the static decode's host buffers, reused from batch to batch
        (``_StaticDecodeCache``)."""
        self.decode_threads: int | None = None
        """Host decode shards (threads) per batch; None: one per torch thread (``_shards``)."""
        self._threads = HostThreads("laminar-decode")
        self.tokenizer = tokenizer
        self.device = device
        self.batch_size = batch_size
        self.version = 0
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def load_weights(self, update: WeightsUpdate) -> None:
        """Version-atomic: every parameter is replaced (strict names), or a LoRA adapter version merged
        into the kept base (``generation.adapter``), before the version moves."""
        from generation.adapter import load_published

        load_published(self.model, update.state)
        self._fused_decoder = (
            None  # rebuilt from the new weights (a merge through ``.data`` moves no version counter)
        )
        self.version = update.version

    def generate(
        self,
        requests: Sequence[GenRequest],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator | None = None,
        progress=None,
        *,
        seed: int | None = None,
    ) -> list[Trajectory]:
        """Sample one response per request, in batches of ``batch_size``; output order = input order.
        The noise is ``generation.sampler``'s under ``seed`` (else one draw from ``generator``), so a
        request's tokens do not depend on the batch it is in."""
        seed = seed_from(generator, seed)
        out: list[Trajectory] = []
        for start in range(0, len(requests), self.batch_size):
            chunk = list(requests[start : start + self.batch_size])
            out.extend(self._generate_batch(chunk, max_new_tokens, temperature, seed))
            if progress is not None:
                progress.update(len(chunk))
        return out

    @torch.inference_mode()
    def prompt_entropy(self, prompts: Sequence[PromptItem]) -> list[float]:
        """HIVE's prompt entropy V(x): the mean, over prompt positions 2..L, of the full-vocabulary
        entropy of the current policy's next-token distribution (temperature 1). One forward pass,
        no generation."""
        out: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            width = max(len(p.prompt_tokens) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            attn = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # right padding: positions need no shift
                ids[i, : len(p.prompt_tokens)] = torch.tensor(p.prompt_tokens)
                attn[i, : len(p.prompt_tokens)] = 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits[
                :, :-1
            ]
            logp = torch.log_softmax(logits.float(), dim=-1)
            ent = -(logp.exp() * logp).nan_to_num().sum(-1).cpu()  # [B, width-1]: predicting tokens 2..width
            mask = attn[:, 1:].float()
            out.extend((ent * mask).sum(1).div(mask.sum(1).clamp(min=1)).tolist())
        return out

    @torch.inference_mode()
    def _generate_batch(
        self, requests: list[GenRequest], max_new_tokens: int, temperature: float, seed: int
    ) -> list[Trajectory]:
        if not self.static_cache or not _decode_attention_supported(self.model):
            return self._generate_batch_reference(requests, max_new_tokens, temperature, seed)
        from transformers import DynamicCache

        # the prefill runs once per distinct prompt (a group's samples share theirs) and its keys and
        # values are copied to every row that has that prompt
        unique: dict[tuple[int, ...], int] = {}
        of_row = torch.tensor(
            [unique.setdefault(tuple(r.prompt.prompt_tokens), len(unique)) for r in requests]
        )
        input_ids, attn, positions = self._left_padded(list(unique))
        plen = input_ids.shape[1]
        bsz = len(requests)
        of_row_dev = of_row.to(self.device)
        cache = DynamicCache()
        out = _Outputs(bsz, max_new_tokens)
        logits = (
            self.model(
                input_ids=input_ids,
                attention_mask=attn,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            .logits[:, -1, :]
            .index_select(0, of_row_dev)
        )
        # the static cache: every layer's keys/values in one buffer [rows, kv_heads, width, head_dim]; the
        # token fed at step t (t >= 1) writes column plen + t - 1; the last sampled token is never fed
        width = plen + max_new_tokens - 1
        fused = self._fused(width + 1)
        # the native step reads the prompts' keys/values once per group, not a copy per row
        prompt_kv = _PromptKV(cache, attn) if fused is not None and fused.native is not None else None
        shards = self._shards(bsz)
        noise = row_keys(seed, requests)
        pad_rows = attn.index_select(0, of_row_dev) == 0
        step_pos = positions[:, -1:].index_select(0, of_row_dev)

        def decode(shard: int, rows: torch.Tensor) -> None:
            if len(shards) == 1:  # the whole batch: its tensors as they are (no copy of the logits)
                part = (logits, of_row_dev, pad_rows, step_pos)
            else:
                rows_dev = rows.to(self.device)
                part = tuple(x.index_select(0, rows_dev) for x in (logits, of_row_dev, pad_rows, step_pos))
            self._decode_rows(
                rows,
                *part,
                cache,
                plen,
                width,
                max_new_tokens,
                temperature,
                fused,
                noise,
                out,
                shard,
                prompt_kv,
            )

        # the model's own forward decodes through ``_gqa_decode_attention``, switched on once for all
        # shards (the switch is the model config's, shared by the threads)
        with _decode_attention(self.model) if fused is None else contextlib.nullcontext():
            if len(shards) == 1:
                decode(0, shards[0])
            else:
                self._threads.run(lambda i: decode(i, shards[i]), len(shards), inference=True)
        del cache
        mean_ent = (out.ent_sum / out.lengths.clamp(min=1)).tolist()
        return self._trajectories(requests, out.tokens, out.logps, out.lengths, out.done, mean_ent)

    def _shards(self, bsz: int) -> list[torch.Tensor]:
        """The batch's rows split into contiguous shards decoded side by side, one host thread each
        (``decode_threads``; one shard on accelerators and for small batches)."""
        k = 1
        if self.device == "cpu":
            k = self.decode_threads if self.decode_threads is not None else torch.get_num_threads()
            k = max(1, min(k, bsz // MIN_SHARD_ROWS))
        return list(torch.arange(bsz).tensor_split(k))

    def _decode_rows(
        self,
        rows: torch.Tensor,
        logits: torch.Tensor,
        of_row: torch.Tensor,
        pad_rows: torch.Tensor,
        step_pos: torch.Tensor,
        prefill,
        plen: int,
        width: int,
        max_new_tokens: int,
        temperature: float,
        fused,
        noise: torch.Tensor,
        out: _Outputs,
        shard: int,
        prompt_kv: _PromptKV | None = None,
    ) -> None:
        """The decode loop of the batch rows ``rows`` (full-batch indices) from their first-token
        ``logits``: a static KV cache filled from the ``prefill`` cache (row i from its prompt's row
        ``of_row[i]``), finished rows compacted away, samples written to ``out``; ``noise``: the
        batch rows' noise keys [batch] (``generation.sampler``). With ``prompt_kv``
        (the native step) the rows share their prompt's keys/values and keep only their own."""
        while len(self._kv_store) <= shard:
            self._kv_store.append([])
        store = self._kv_store[shard] if self.device == "cpu" else None
        n_all = len(rows)
        if prompt_kv is not None:
            slots, mask = _CompletionKV(prompt_kv, of_row, max_new_tokens - 1, store), None
        else:
            slots = _StaticDecodeCache(
                prefill,
                width,
                of_row,
                keys_transposed=fused is not None and fused.keys_transposed,
                store=store,
            )
            neg = torch.finfo(slots.values[0].dtype).min
            mask = torch.zeros((n_all, 1, 1, width), dtype=slots.values[0].dtype, device=self.device)
            mask[:, 0, 0, :plen].masked_fill_(pad_rows, neg)  # left padding: never attended
        done = out.done
        # the native sampling step (float32 logits on the CPU): one call for what follows the logits
        native = fused.native if fused is not None else None
        if native is not None:
            next_buf = torch.empty(n_all, dtype=torch.long)
            keep_buf = torch.empty(n_all, dtype=torch.bool)
        for t in range(max_new_tokens):
            if t > 0:
                col = plen + t - 1
                n = len(rows)
                if prompt_kv is not None:
                    logits = fused.step_shared(step_ids[:, 0], step_pos[:, 0], prompt_kv, slots, t - 1)
                elif fused is not None:
                    logits = fused.step(
                        step_ids[:, 0],
                        step_pos[:, 0],
                        slots.keys,
                        slots.values,
                        col,
                        mask[:n, :, :, : col + 1],
                    )
                else:
                    slots.col = col  # the caller has switched the attention to ``_gqa_decode_attention``
                    logits = self.model(
                        input_ids=step_ids,
                        attention_mask=mask[:n, :, :, : col + 1],
                        position_ids=step_pos,
                        past_key_values=slots,
                        use_cache=True,
                    ).logits[:, -1, :]
            if native is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
                # the sampler's draw (``generation.sampler.sample``) in one pass
                n = len(rows)
                nxt, keep = next_buf[:n], keep_buf[:n]
                kept = native.sample_step(
                    logits,
                    temperature,
                    noise,
                    rows,
                    t,
                    self.eos_id,
                    out.tokens,
                    out.logps,
                    out.ent_sum,
                    out.lengths,
                    done,
                    nxt,
                    keep,
                )
                if not kept:
                    break
                n_done = n - kept
                step_ids = nxt[:, None]  # read by the next step before the buffer is written again
                step_pos = step_pos + 1
            else:
                nxt, lp, ent = sample(logits.cpu(), temperature, noise[rows], torch.full((len(rows),), t))
                live = ~done[rows]
                idx = rows[live]
                out.ent_sum[idx] += ent[live].float()
                out.tokens[idx, t] = nxt[live]
                out.logps[idx, t] = lp[live]
                newly = idx[nxt[live] == self.eos_id]
                out.lengths[newly] = t + 1
                done[newly] = True
                keep = ~done[rows]
                if not bool(keep.any()):
                    break
                step_ids = nxt[:, None].to(self.device)
                step_pos = step_pos + 1
                n_done = len(rows) - int(keep.sum())
            if n_done and n_done * 8 >= len(rows):  # compact: finished rows leave the batch
                sel = keep.nonzero().squeeze(1)
                sel_dev = sel.to(self.device)
                m = len(sel)
                if mask is None:
                    slots.select(sel_dev, t)
                else:
                    slots.select(sel_dev, plen + t)
                    mask[:m] = mask.index_select(0, sel_dev)
                rows, step_ids, step_pos = rows[sel], step_ids[sel_dev], step_pos[sel_dev]

    def _fused(self, positions: int):
        """The model's ``FusedDecoder`` (built once, its weights refreshed when they changed) with
        rotary tables for ``positions``; None when the model is not one it reproduces or
        ``fused_decode`` is off."""
        from generation.fused_decode import fused_decoder

        if not self.fused_decode:
            return None
        if self._fused_decoder is None or self._fused_decoder[0] is not self.model:
            self._fused_decoder = (self.model, fused_decoder(self.model))
        dec = self._fused_decoder[1]
        if dec is None or (dec.max_width is not None and positions > dec.max_width):
            return None
        dec.refresh()
        dec.rotary_tables(positions)
        # the native kernels: float32, head_dim a multiple of 16 (one AVX-512 vector)
        dec.native = self._native() if dec.embed.dtype == torch.float32 and dec.head_dim % 16 == 0 else None
        if dec.native is not None:
            dec.native_model()  # built here, before decode shards share it
        return dec

    def _native(self):
        """The native kernels where this engine may use them (CPU, ``native_kernels``), else None."""
        if not self.native_kernels or torch.device(self.device).type != "cpu":
            return None
        from generation import kernels

        return kernels.load()

    def _left_padded(self, prompts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, position_ids) on the device, left-padded: every sequence's next
        token is at the end."""
        bsz, plen = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((bsz, plen), self.pad_id, dtype=torch.long)
        attn = torch.zeros((bsz, plen), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, plen - len(p) :] = torch.tensor(p)
            attn[i, plen - len(p) :] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        return input_ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)

    @torch.inference_mode()
    def _generate_batch_reference(
        self, requests: list[GenRequest], max_new_tokens: int, temperature: float, seed: int
    ) -> list[Trajectory]:
        """The decode loop before the static cache (a ``DynamicCache`` grown by concatenation, every row
        decoded until the whole batch is done): kept as the reference ``tests`` compare against."""
        from transformers import DynamicCache

        input_ids, attn, positions = self._left_padded([r.prompt.prompt_tokens for r in requests])
        bsz, plen = input_ids.shape
        cache = DynamicCache()
        tokens = torch.empty((bsz, max_new_tokens), dtype=torch.long)
        logps = torch.zeros((bsz, max_new_tokens))
        ent_sum = torch.zeros(bsz)
        lengths = torch.full((bsz,), max_new_tokens, dtype=torch.long)
        done = torch.zeros(bsz, dtype=torch.bool)
        step_ids, step_pos = input_ids, positions
        keys = row_keys(seed, requests)
        for t in range(max_new_tokens):
            logits = self.model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            nxt, lp, ent = sample(logits.cpu(), temperature, keys, torch.full((bsz,), t))
            ent_sum += torch.where(done, 0.0, ent.float())
            tokens[:, t] = nxt
            logps[:, t] = lp
            newly = (nxt == self.eos_id) & ~done
            lengths[newly] = t + 1
            done |= newly
            if bool(done.all()):
                break
            step_ids = nxt[:, None].to(self.device)
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=self.device)], dim=1)
        mean_ent = (ent_sum / lengths.clamp(min=1)).tolist()
        return self._trajectories(requests, tokens, logps, lengths, done, mean_ent)

    def _trajectories(
        self,
        requests: list[GenRequest],
        tokens: torch.Tensor,
        logps: torch.Tensor,
        lengths: torch.Tensor,
        done: torch.Tensor,
        mean_ent: list[float],
    ) -> list[Trajectory]:
        """One ``Trajectory`` per request from the batch's [B, max_new_tokens] tokens and log-probs (row i
        valid up to ``lengths[i]``; a finished row's last token is its EOS, not part of its text)."""
        ids_all, lps_all = tokens.tolist(), logps.double().tolist()
        ns, fin = lengths.tolist(), done.tolist()
        ids = [row[:n] for row, n in zip(ids_all, ns)]
        texts = self.tokenizer.batch_decode(
            [x[:-1] if f else x for x, f in zip(ids, fin)], skip_special_tokens=True
        )
        return [
            Trajectory(
                kind="trajectory",
                prompt=r.prompt,
                sample_idx=r.sample_idx,
                response_tokens=tuple(x),
                behaviour_logprobs=tuple(lp[:n]),
                version=self.version,
                finished=f,
                text=text,
                mean_entropy=e,
            )
            for r, x, lp, n, f, text, e in zip(requests, ids, lps_all, ns, fin, texts, mean_ent)
        ]


MIN_SHARD_ROWS = 32
"""A host decode shard has at least this many rows: fewer pay more in per-step overhead than a second
thread saves."""


class _Outputs:
    """A batch's samples, written row by row by the decode shards: tokens and log-probs
    [rows, max_new_tokens], entropy sums, lengths and done flags [rows]."""

    def __init__(self, bsz: int, max_new_tokens: int):
        self.tokens = torch.empty((bsz, max_new_tokens), dtype=torch.long)
        self.logps = torch.zeros((bsz, max_new_tokens))
        self.ent_sum = torch.zeros(bsz)
        self.lengths = torch.full((bsz,), max_new_tokens, dtype=torch.long)
        self.done = torch.zeros(bsz, dtype=torch.bool)


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


class _PromptKV:
    """The native decode's prompt part of the KV cache, shared by every row with that prompt (a
    group's samples) and every decode shard: per layer the prefill's keys transposed [U, kv,
    head_dim, P] and values [U, kv, P, head_dim] of the U distinct prompts, and the additive mask [U,
    P] of their left padding. Nothing is copied per row."""

    def __init__(self, prefill_cache, attn: torch.Tensor):
        self.keys = [layer.keys.transpose(-1, -2).contiguous() for layer in prefill_cache.layers]
        self.values = [layer.values.contiguous() for layer in prefill_cache.layers]
        dtype = self.values[0].dtype
        self.mask = torch.zeros(attn.shape, dtype=dtype).masked_fill_(attn.cpu() == 0, torch.finfo(dtype).min)


class _CompletionKV:
    """The native decode's per-row part of the KV cache: the keys and values of the tokens a row has
    sampled, per layer keys [rows, kv, blocks, head_dim, 16] (blocks of 16 columns, each transposed:
    the layout of ``generation/kernels/decode.c``) and values [rows, kv, columns, head_dim], and each
    row's prompt (``prompt_of``, an index into ``_PromptKV``). ``select`` keeps some rows (finished
    ones leave), copying only the columns written so far."""

    def __init__(self, prompt: _PromptKV, prompt_of: torch.Tensor, columns: int, store: list | None):
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


def _decode_attention_supported(model) -> bool:
    """The static decode needs a model whose attention layers call Hugging Face's attention
    interface with SDPA (Llama, Qwen2, Mistral, ... as loaded here): ours replaces it for the
    one-token decode steps only."""
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "_attn_implementation", None) in ("sdpa", _DECODE_ATTN)


def _gqa_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of one new token per row over a (strided) static cache, grouped-query aware without
    repeating the keys/values: query [B, H, 1, D], key/value [B, KV, T, D], ``attention_mask`` the
    additive [B, 1, 1, T] mask. Two batched matmuls and a softmax; the same result as SDPA up to
    float rounding (``tests/generation/test_engine_static.py`` bounds it)."""
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


class _decode_attention:
    """Within the block the model's attention layers use ``_gqa_decode_attention`` (registered once
    with Hugging Face's attention and mask interfaces); the model's own setting comes back after."""

    _registered = False

    def __init__(self, model):
        self.config = model.config

    def __enter__(self):
        if not _decode_attention._registered:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

            AttentionInterface.register(_DECODE_ATTN, _gqa_decode_attention)
            AttentionMaskInterface.register(_DECODE_ATTN, sdpa_mask)
            _decode_attention._registered = True
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = _DECODE_ATTN
        return self

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved
        return False


class _StaticDecodeCache:
    """The cache object handed to the model during decode (duck-typed like a Hugging Face ``Cache``):
    per layer one key and one value buffer [rows, kv_heads, width, head_dim], filled from the prefill's
    ``DynamicCache`` (its row ``rows[i]`` into row i when ``rows`` is given); ``update`` writes the step's
    key/value at column ``col`` of the first ``rows`` rows and returns views of columns ``[0, col]``
    (nothing is concatenated or copied per step). ``keys_transposed``: the key buffers are [rows,
    kv_heads, head_dim, width] instead (``generation.fused_decode``'s layout: its score matmul reads
    them without a transpose); ``update`` is not used then."""

    is_compileable = False

    def __init__(
        self,
        prefill_cache,
        width: int,
        rows: torch.Tensor | None = None,
        keys_transposed: bool = False,
        store: list | None = None,
    ):
        self.keys, self.values = [], []
        self.keys_transposed = keys_transposed
        self.store = store
        self.set = 0
        """Which of the store's two sets of buffers holds the cache (``select`` alternates them)."""
        for i, layer in enumerate(prefill_cache.layers):
            b, h, p, d = layer.keys.shape
            b = b if rows is None else len(rows)
            keys = layer.keys if rows is None else layer.keys.index_select(0, rows)
            v = _store_buffer(self.store, 2 * i + 1, (b, h, width, layer.values.shape[-1]), layer.values)
            v[:, :, :p] = layer.values if rows is None else layer.values.index_select(0, rows)
            if keys_transposed:
                k = _store_buffer(self.store, 2 * i, (b, h, d, width), keys)
                k[..., :p] = keys.transpose(-1, -2)
            else:
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
            cols = (
                (lambda b: b[..., :upto]) if self.keys_transposed and is_key else (lambda b: b[:, :, :upto])
            )
            if self.store is None:
                view = cols(buf)
                view[:m] = view.index_select(0, keep)
                continue
            layer = i if is_key else i - n_keys
            slot = 2 * n_keys * self.set + 2 * layer + (0 if is_key else 1)
            target = _store_buffer(self.store, slot, tuple(buf.shape), buf)
            torch.index_select(cols(buf), 0, keep, out=cols(target)[:m])
            if is_key:
                self.keys[layer] = target
            else:
                self.values[layer] = target
        self.rows = m

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.col

    def __len__(self) -> int:
        return len(self.keys)
