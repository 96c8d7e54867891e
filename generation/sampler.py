"""The one sampler of every decode path: Gumbel-max with counter-based noise.

A token is drawn as ``argmax(log_softmax(logits / T) + G)``, where the Gumbel noise of (seed,
request, response position t, vocabulary index) is a pure function of those: a splitmix64 hash
(vectorised in torch int64 ops here, the same hash in ``generation/kernels/decode.c``). A request
therefore draws the same tokens whatever the batch composition, order, shard split or padding, and
when it is extracted midway and continued elsewhere with the same weights; only float noise in
the logits from a different batch shape could flip a near-tie.
"""

from __future__ import annotations

import hashlib

import torch

from generation.records import GenRequest

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_VOCAB_STRIDE = 0xD1B54A32D192ED03  # odd constant: spreads vocabulary indices over the counter space


def _signed(x: int) -> int:
    """A 64-bit pattern as the torch.int64 value with the same bits."""
    x &= _M64
    return x - (1 << 64) if x >= (1 << 63) else x


def _mix_py(z: int) -> int:
    """splitmix64's finaliser on Python ints (exact 64-bit arithmetic): the reference for ``_mix``."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` on int64 is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; multiplication wraps modulo 2^64 like uint64."""
    z = (z ^ _srl(z, 30)) * _signed(_MIX1)
    z = (z ^ _srl(z, 27)) * _signed(_MIX2)
    return z ^ _srl(z, 31)


def request_key(request: GenRequest) -> tuple[str, int, int]:
    """What identifies a request within a run: (prompt id, group_uid, sample_idx)."""
    return (request.prompt.prompt_id, int(request.group_uid), int(request.sample_idx))


def row_key(seed: int, request: GenRequest) -> int:
    """The noise key of one request: (seed, prompt id, group_uid, sample_idx) hashed to 64 bits. The
    prompt id is hashed with blake2b (stable across processes, unlike ``hash``) so that two prompts
    sharing a ``group_uid`` (e.g. the default 0) still draw independent noise."""
    pid = int.from_bytes(hashlib.blake2b(request.prompt.prompt_id.encode(), digest_size=8).digest(), "little")
    k = _mix_py(seed * _GOLDEN + 1)
    for part in (pid, request.group_uid, request.sample_idx):
        k = _mix_py(k ^ _mix_py(part + _GOLDEN))
    return _signed(k)


def row_keys(seed: int, requests) -> torch.Tensor:
    """``row_key`` of each request, int64 [len(requests)]."""
    return torch.tensor([row_key(seed, r) for r in requests], dtype=torch.long)


def gumbel_uniforms(keys: torch.Tensor, t: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64 [B, V], for rows with noise ``keys`` [B] (int64) at response
    positions ``t`` [B] over vocabulary indices ``vocab`` [V]: a pure function of
    (key, t, vocabulary index), so independent of batch composition and device."""
    h = _mix(keys + (t + 1) * _signed(_GOLDEN))  # [B]
    h = _mix(h[:, None] ^ ((vocab[None, :] + 1) * _signed(_VOCAB_STRIDE)))  # [B, V]
    return (_srl(h, 11).double() + 0.5) * (1.0 / (1 << 53))  # 53 random bits, never 0 or 1


def sample(logits: torch.Tensor, temperature: float, keys: torch.Tensor, t: torch.Tensor):
    """(logits [B, V], noise keys [B], response positions [B]) -> (token [B] int64, behaviour
    log-prob [B] float32, entropy [B] float64): Gumbel-max under the temperature-scaled
    distribution. ``generation/kernels/decode.c``'s ``lm_sample_step`` computes the same draw."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    vocab = torch.arange(logp.shape[-1], dtype=torch.long, device=logp.device)
    u = gumbel_uniforms(keys.to(logp.device), t.to(logp.device), vocab)
    nxt = (logp.double() - torch.log(-torch.log(u))).argmax(-1)
    lp = logp.gather(1, nxt[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).nan_to_num().sum(-1)
    return nxt, lp, ent.double()


def seed_from(generator: torch.Generator | None, seed: int | None) -> int:
    """The sampler seed of a batch call: ``seed`` when given, else one draw from ``generator`` (so
    successive calls with one generator draw fresh noise), else 0."""
    if seed is not None:
        return int(seed)
    if generator is None:
        return 0
    return int(torch.randint(0, 1 << 62, (1,), generator=generator))
