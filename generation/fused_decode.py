"""The fused weights of the native decode step (``generation.kernels``) for Llama-family models
(Llama, Qwen2, Mistral).

Hugging Face's forward is general: per layer it builds masks, looks up the attention interface,
goes through module hooks, the cache object and separate q/k/v and gate/up projections. For the
default model a decode step of 128 rows is a few milliseconds of arithmetic under ~20 ms of that
overhead (issue 30). ``FusedDecoder`` holds the weights the native step computes the same function
with: the q/k/v and the gate/up weights concatenated (one matmul each; rotate_half folded into extra
q/k rows), the attention scale folded into q when exact, rotary tables precomputed per generation.
Results equal the model's own forward up to float rounding (``tests/generation/test_fused_decode.py``
and ``tests/generation/test_native_kernels.py`` check the samples).

``fused_decoder(model)`` returns None for anything it does not reproduce exactly (other
architectures, biased MLPs, rotary scalings that depend on the sequence length, sliding windows,
LoRA-wrapped or otherwise non-plain linear layers), and the engine decodes through the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    """Transposed (a view): the residual add is one ``addmm``."""
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    """Transposed, as ``o``."""


def fused_decoder(model) -> FusedDecoder | None:
    """A ``FusedDecoder`` for ``model`` if it computes what the model computes, else None. A model
    with a sliding attention window is decoded fused only up to that window (``max_width``)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return None
    if getattr(cfg, "pretraining_tp", 1) != 1 or getattr(cfg, "o_bias", False):
        return None
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in _STATIC_ROPE:
        return None
    try:
        inner = model.model
        layers = list(inner.layers)
        _ = inner.rotary_emb  # a model without rotary embeddings raises here: not one it reproduces
        lm_head = model.lm_head
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj, lm_head)
            if any(type(lin) is not torch.nn.Linear for lin in linears) or a.o_proj.bias is not None:
                return None
    except AttributeError:
        return None
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return None
    return FusedDecoder(model)


def prepared(dec: FusedDecoder | None, positions: int, native) -> FusedDecoder | None:
    """``dec`` ready for the native step up to ``positions``: weights refreshed, rotary tables built,
    the native kernels (``native()``: the loaded kernels or None) attached. None where that step does
    not apply: no decoder, ``positions`` beyond its window, no kernels, another dtype than float32 or
    a head_dim that is not a multiple of 16 (one AVX-512 vector)."""
    if dec is None or (dec.max_width is not None and positions > dec.max_width):
        return None
    if dec.model.model.embed_tokens.weight.dtype != torch.float32 or dec.head_dim % 16:
        return None
    kernels = native()
    if kernels is None:
        return None
    dec.refresh()
    dec.rotary_tables(positions)
    dec.native = kernels
    dec.native_model()  # built here, before decode shards share it
    return dec


class FusedDecoder:
    """The fused weights and rotary tables of ``model`` for ``step_shared`` (the native step =
    ``model(input_ids=ids[:, None], position_ids=pos[:, None], past_key_values=<cache>)`` for one new
    token per row). The fused weights are rebuilt when any parameter changed (its storage or its
    in-place version counter), so weight loads between generations are picked up."""

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = float(cfg.rms_norm_eps)
        self.intermediate = model.model.layers[0].mlp.gate_proj.out_features
        self.scale = model.model.layers[0].self_attn.scaling
        self._sig = None
        self.scale_folded = False
        self.native = None
        """``generation.kernels.NativeKernels`` to run whole steps with (``step_shared``; float32 on
        the CPU; set by ``prepared``)."""
        self._native_model = None
        self._cos = self._sin = None
        window = getattr(cfg, "sliding_window", None)
        self.max_width = (
            window
            if window is not None and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral")
            else None
        )
        """Sequences longer than this would leave the model's sliding window: not decoded here."""

    # ------------------------------------------------------------------ weights
    def _signature(self):
        return tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def refresh(self) -> None:
        """Rebuild the fused weights if the model's parameters changed since the last build."""
        sig = self._signature()
        if sig == self._sig:
            return
        inner = self.model.model
        d, half = self.head_dim, self.head_dim // 2
        # q scaled by the attention scale when that is a power of two: exact, so the scores equal
        # the model's (q.k) * scale bit for bit
        fold = math.frexp(self.scale)[0] == 0.5
        self.scale_folded = fold

        def rotated(w: torch.Tensor) -> torch.Tensor:
            """Rows of ``w`` so that ``x @ rotated(w).T`` = rotate_half(``x @ w.T``) per head (exact)."""
            w = w.reshape(-1, d, *w.shape[1:])
            return torch.cat((-w[:, half:], w[:, :half]), dim=1).reshape(-1, *w.shape[2:])

        with torch.no_grad():
            self.layers = []
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                ws = [
                    a.q_proj.weight * self.scale if fold else a.q_proj.weight,
                    a.k_proj.weight,
                    a.v_proj.weight,
                ]
                biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
                bias = None
                if any(b is not None for b in biases):
                    bs = [
                        b.detach()
                        if b is not None
                        else torch.zeros(p.out_features, dtype=p.weight.dtype, device=p.weight.device)
                        for b, p in zip(biases, (a.q_proj, a.k_proj, a.v_proj))
                    ]
                    if fold:
                        bs[0] = bs[0] * self.scale
                    bias = torch.cat([*bs, rotated(bs[0]), rotated(bs[1])])
                self.layers.append(
                    _Layer(
                        ln1=layer.input_layernorm.weight.detach(),
                        # [q, k, v, rotate_half(q), rotate_half(k)]: rotary needs no slicing or concatenation
                        qkv=torch.cat([*ws, rotated(ws[0]), rotated(ws[1])]).detach(),
                        qkv_bias=bias,
                        o=a.o_proj.weight.detach().t(),
                        ln2=layer.post_attention_layernorm.weight.detach(),
                        gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
                        down=m.down_proj.weight.detach().t(),
                    )
                )
            self.embed = inner.embed_tokens.weight.detach()
            self.norm = inner.norm.weight.detach()
            self.lm_head = self.model.lm_head.weight.detach()
            self.lm_bias = self.model.lm_head.bias
        self._sig = sig

    def rotary_tables(self, positions: int) -> None:
        """cos/sin of positions [0, positions), as the model's rotary embedding computes them."""
        rotary = self.model.model.rotary_emb
        inv = rotary.inv_freq.float()
        pos = torch.arange(positions, device=inv.device, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed.dtype
        self._cos = (emb.cos() * rotary.attention_scaling).to(dtype)
        self._sin = (emb.sin() * rotary.attention_scaling).to(dtype)

    def native_model(self):
        """The ``generation.kernels.NativeModel`` over the current fused weights (``native`` set), built
        once per ``refresh``."""
        if self._native_model is None or self._native_model[0] != self._sig:
            m = self.native.model(
                self.layers,
                self.embed,
                self.norm,
                self.lm_head,
                self.lm_bias,
                heads=self.n_heads,
                kv_heads=self.n_kv,
                head_dim=self.head_dim,
                eps=self.eps,
                scale=1.0 if self.scale_folded else self.scale,
            )
            self._native_model = (self._sig, m)
        return self._native_model[1]

    def step_shared(self, ids: torch.Tensor, pos: torch.Tensor, prompt, rows, ccol: int) -> torch.Tensor:
        """The decode step as one native call (``native`` set; float32 on the CPU): logits [n, vocab] of the
        next token after ``ids`` [n] at positions ``pos`` [n], where row i's cache is its prompt's
        keys/values (``prompt``: ``generation.wave.PromptKV``, shared by the rows of that prompt)
        and its own completion columns [0, ccol] (``rows``: ``_CompletionKV``; the step's key and value
        are written at ``ccol``)."""
        m = self.native_model()
        if rows.caches is None:
            rows.caches = m.cache_pointers(prompt, rows)
        return m.step(ids, pos, self._cos, self._sin, rows.caches, ccol)
