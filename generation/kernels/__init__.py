"""Native host kernels for the fused decode step (``decode.c``), built once per machine and loaded
with ctypes.

The C source is compiled with the system C compiler (``$CC``, else ``cc``) the first time a process
asks for it and cached as a shared library under ``cache_dir()`` (``$LAMINAR_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/laminar/kernels``, else ``~/.cache/laminar/kernels``), named by the hash of the
source, the flags, the compiler and this CPU's model and feature flags, so an edit, another
compiler or another CPU gets its own build. A build takes about a second; it writes to a temporary
name and renames, so concurrent processes (Ray workers) never load half a file.

``load()`` returns None (and the engine keeps its torch ops) when ``LAMINAR_NATIVE_KERNELS=0``, on a
platform without a C compiler, or when the build fails (the reason is logged once). The kernels
only take float32 CPU tensors; the wrappers check what the C code relies on (dtype, device, unit
inner strides) and raise ``ValueError`` otherwise, so a wrong tensor never reaches the C code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = ("-O3", "-march=native", "-std=c11", "-ffp-contract=fast", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC")

_lock = threading.Lock()
_loaded: "NativeKernels | None" = None
_tried = False
build_seconds: float | None = None
"""Seconds this process spent compiling the library (0.0 when it came from the cache, None before
``load()``)."""


def cache_dir() -> Path:
    if os.environ.get("LAMINAR_KERNEL_CACHE"):
        return Path(os.environ["LAMINAR_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "laminar" / "kernels"


def _cpu_signature() -> str:
    """This CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
        return "\n".join(dict.fromkeys(keep))
    except OSError:
        return platform.machine() + platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(), _cpu_signature().encode()):
        h.update(hashlib.sha256(part).digest())
    return cache_dir() / f"laminar_decode_{h.hexdigest()[:16]}.so"


def build(cc: str) -> Path:
    """The cached library for this source, compiler and CPU, compiled first when missing."""
    global build_seconds
    path = library_path(cc)
    if path.exists():
        build_seconds = 0.0
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    build_seconds = time.perf_counter() - t0
    log.info("built %s in %.1f s", path, build_seconds)
    return path


def load() -> "NativeKernels | None":
    """The process's kernels (built or loaded once), or None where they are off or unavailable."""
    global _loaded, _tried
    if os.environ.get("LAMINAR_NATIVE_KERNELS", "1") == "0":
        return None
    with _lock:
        if not _tried:
            _tried = True
            cc = _compiler()
            if cc is None:
                log.warning("no C compiler (set CC): the decode step runs on torch ops")
            else:
                try:
                    _loaded = NativeKernels(ctypes.CDLL(str(build(cc))))
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    log.warning("native decode kernels unavailable, the decode step runs on torch ops: %s", e)
        return _loaded


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _f32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"native kernels take float32 CPU tensors with a unit inner stride, got "
                             f"{t.dtype} on {t.device} with strides {t.stride()}")


def _strides(t: torch.Tensor):
    return (ctypes.c_int64 * t.dim())(*t.stride())


class NativeKernels:
    """Typed wrappers of ``decode.c`` (each call releases the GIL while it runs)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.lm_rms_norm.argtypes = [_P, _I, _P, _P, _I, _I, _I, _F]
        lib.lm_rms_norm.restype = None
        lib.lm_silu_mul.argtypes = [_P, _I, _P, _I, _I, _I]
        lib.lm_silu_mul.restype = None
        lib.lm_decode_attention.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P,
                                            _P, _P, _P, _P, _I, _F, _P, _I, _I, _P]
        lib.attention_scratch_floats.argtypes = [_I, _I, _I, _I, _I]
        lib.attention_scratch_floats.restype = ctypes.c_int64
        lib.lm_decode_attention.restype = ctypes.c_int64
        lib.lm_sample_step.argtypes = [_P, _I, _I, _I, _F, _P, _I, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P,
                                       _P]
        lib.lm_sample_step.restype = ctypes.c_int64

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
        """``F.rms_norm(x, w.shape, w, eps)`` of the rows of 2-D ``x`` into ``out``."""
        _f32(x, w, out)
        n, h = x.shape
        if out.shape != x.shape or w.shape != (h,) or not w.is_contiguous():
            raise ValueError("rms_norm: shapes")
        self.lib.lm_rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), out.stride(0), n, h, eps)
        return out

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``F.silu(gu[:, :m]) * gu[:, m:]`` into ``out`` [n, m]."""
        _f32(gu, out)
        n, m = out.shape
        if gu.shape != (n, 2 * m):
            raise ValueError("silu_mul: shapes")
        self.lib.lm_silu_mul(gu.data_ptr(), gu.stride(0), out.data_ptr(), out.stride(0), n, m)
        return out

    def decode_attention(self, qkv: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, cos: torch.Tensor,
                         sin: torch.Tensor, pos: torch.Tensor, prompt_keys: torch.Tensor, prompt_values: torch.Tensor,
                         prompt_mask: torch.Tensor, prompt_of: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         ccol: int, scale: float, out: torch.Tensor) -> torch.Tensor:
        """One layer's decode attention of rows [0, n) into ``out`` [n, heads * head_dim] (see
        ``decode.c``): ``qkv`` [n, (heads + 2 kv) head_dim] the q, k, v projections; rotary from the
        ``cos``/``sin`` tables at ``pos`` [n]; each row attends over
        its prompt's columns (``prompt_of`` [n] into ``prompt_keys`` [U, kv, head_dim, P],
        ``prompt_values`` [U, kv, P, head_dim], additive ``prompt_mask`` [U, P]) and its own completion
        columns [0, ccol] (``keys`` [rows, kv, blocks, head_dim, 16], ``values`` [rows, kv, width,
        head_dim]), after writing the step's key and value at completion column ``ccol``."""
        n = qkv.shape[0]
        _f32(qkv, cos, sin, prompt_keys, prompt_values, prompt_mask, keys, values, out)
        d = head_dim
        u, p = prompt_mask.shape
        if (qkv.shape[1] != (n_heads + 2 * n_kv) * d or out.shape != (n, n_heads * d) or n_heads % n_kv
                or d % 16 or pos.dtype != torch.int64 or pos.shape != (n,) or pos.stride(0) != 1
                or prompt_of.dtype != torch.int64 or prompt_of.shape != (n,) or prompt_of.stride(0) != 1
                or not (cos.is_contiguous() and sin.is_contiguous()) or cos.shape[1] != d or sin.shape != cos.shape
                or prompt_keys.shape != (u, n_kv, d, p) or prompt_values.shape != (u, n_kv, p, d)
                or keys.dim() != 5 or keys.shape[0] < n or keys.shape[1:] != (n_kv, keys.shape[2], d, 16)
                or keys.stride()[2:] != (16 * d, 16, 1) or values.shape[0] < n or values.shape[1] != n_kv
                or values.shape[3] != d or not 0 <= ccol < min(values.shape[2], 16 * keys.shape[2])):
            raise ValueError("decode_attention: shapes")
        scratch = torch.empty(self.lib.attention_scratch_floats(n_heads, n_kv, d, p, ccol))
        err = self.lib.lm_decode_attention(
            qkv.data_ptr(), qkv.stride(0), n_heads, n_kv, d, cos.data_ptr(), sin.data_ptr(), cos.shape[0],
            pos.data_ptr(), prompt_keys.data_ptr(), _strides(prompt_keys), prompt_values.data_ptr(),
            _strides(prompt_values), prompt_mask.data_ptr(), prompt_mask.stride(0), p, u, prompt_of.data_ptr(),
            keys.data_ptr(), _strides(keys), values.data_ptr(), _strides(values), ccol, scale, out.data_ptr(),
            out.stride(0), n, scratch.data_ptr())
        if err:
            raise ValueError("decode_attention: a position beyond the rotary tables or a prompt index out of range")
        return out

    def sample_step(self, logits: torch.Tensor, temperature: float, noise: torch.Tensor, rows: torch.Tensor, t: int,
                    eos: int, tokens: torch.Tensor, logps: torch.Tensor, ent_sum: torch.Tensor,
                    lengths: torch.Tensor, done: torch.Tensor, next_ids: torch.Tensor, keep: torch.Tensor) -> int:
        """The decode loop's sampling step of ``logits`` [n, vocab] for batch rows ``rows`` at step
        ``t`` (see ``decode.c``): writes ``next_ids``/``keep`` [n] and the not-yet-done rows' entries
        of the batch outputs; returns how many rows are kept."""
        n, vocab = logits.shape
        _f32(logits, noise, logps, ent_sum)
        m = tokens.shape[1]
        if (noise.shape[1] != vocab or rows.dtype != torch.int64 or rows.shape != (n,) or rows.stride(0) != 1
                or not all(x.is_contiguous() for x in (tokens, logps, ent_sum, lengths, done, next_ids, keep))
                or tokens.dtype != torch.int64 or lengths.dtype != torch.int64 or next_ids.dtype != torch.int64
                or done.dtype != torch.bool or keep.dtype != torch.bool or logps.shape != tokens.shape
                or not 0 <= t < m or next_ids.shape != (n,) or keep.shape != (n,)):
            raise ValueError("sample_step: shapes")
        bsz = tokens.shape[0]
        if noise.shape[0] != bsz or any(x.shape != (bsz,) for x in (ent_sum, lengths, done)):
            raise ValueError("sample_step: batch shapes")
        scratch = torch.empty(vocab)
        kept = self.lib.lm_sample_step(logits.data_ptr(), logits.stride(0), n, vocab, temperature, noise.data_ptr(),
                                       noise.stride(0), rows.data_ptr(), bsz, t, eos, m, tokens.data_ptr(),
                                       logps.data_ptr(), ent_sum.data_ptr(), lengths.data_ptr(), done.data_ptr(),
                                       next_ids.data_ptr(), keep.data_ptr(), scratch.data_ptr())
        if kept < 0:
            raise ValueError("sample_step: rows out of range")
        return kept
