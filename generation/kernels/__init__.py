"""Native host kernels for the fused decode step (``decode.c``), built once per machine and loaded
with ctypes.

The C source is compiled with the system C compiler (``$CC``, else ``cc``) the first time a process
asks for it and cached as a shared library under ``cache_dir()`` (``$LAMINAR_KERNEL_CACHE``, else
``kernels/`` in ``$LAMINAR_CACHE_DIR``, ``$XDG_CACHE_HOME/laminar`` or ``~/.cache/laminar``), named
by the hash of the source, the flags, the compiler and this CPU's model and feature flags, so an
edit, another compiler or another CPU gets its own build. A build takes about a second; it writes
to a temporary name and renames, so concurrent processes (Ray workers) never load half a file.

``load()`` returns None (and the engine keeps its torch ops) when ``LAMINAR_NATIVE_KERNELS=0``, on a
platform without a C compiler or whose torch exports no BLAS ``sgemm_``, or when the build fails
(the reason is logged once). The kernels only take float32 CPU tensors; the wrappers check what the
C code relies on (dtype, device, shapes, unit inner strides) and raise ``ValueError`` otherwise, and
the C code checks token, position and prompt indices before it writes anything, so a wrong input
raises instead of reaching memory it should not.
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

from core.paths import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.c")
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c11",
    "-ffp-contract=fast",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)

_lock = threading.Lock()
_loaded: NativeKernels | None = None
_tried = False
build_seconds: float | None = None
"""Seconds this process spent compiling the library (0.0 when it came from the cache, None before
``load()``)."""


def cache_dir() -> Path:
    """``$LAMINAR_KERNEL_CACHE``, else ``kernels/`` in ``core.paths.user_cache_dir()``."""
    if os.environ.get("LAMINAR_KERNEL_CACHE"):
        return Path(os.environ["LAMINAR_KERNEL_CACHE"])
    return user_cache_dir() / "kernels"


def _cpu_signature() -> str:
    """This CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [
            ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")
        ]
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
        proc = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    build_seconds = time.perf_counter() - t0
    log.info("built %s in %.1f s", path, build_seconds)
    return path


def load() -> NativeKernels | None:
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
                sgemm = _sgemm_address()
                if sgemm is None:
                    log.warning("torch exports no BLAS sgemm_ here: the decode step runs on torch ops")
                    return None
                try:
                    _loaded = NativeKernels(ctypes.CDLL(str(build(cc))), sgemm)
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    log.warning("native decode kernels unavailable, the decode step runs on torch ops: %s", e)
        return _loaded


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _f32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(
                f"native kernels take float32 CPU tensors with a unit inner stride, got "
                f"{t.dtype} on {t.device} with strides {t.stride()}"
            )


def _sgemm_address() -> int | None:
    """The address of the Fortran ``sgemm_`` that torch's own BLAS (MKL) exports, or None."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        if (lib_dir / name).exists():
            try:
                return ctypes.cast(ctypes.CDLL(str(lib_dir / name)).sgemm_, ctypes.c_void_p).value
            except (OSError, AttributeError):
                return None
    return None


def _ptrs(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


class NativeKernels:
    """Typed wrappers of ``decode.c`` (each call releases the GIL while it runs)."""

    def __init__(self, lib: ctypes.CDLL, sgemm: int):
        self.lib, self.sgemm = lib, sgemm
        lib.lm_step_workspace.argtypes = [_P, _I, _I, _I]
        lib.lm_step_workspace.restype = ctypes.c_int64
        lib.lm_decode_step.argtypes = [
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _I,
            _P,
            _P,
            _I,
            _P,
            _P,
            _P,
            _P,
            _P,
            _I,
            _I,
            _I,
            _P,
            _P,
            _P,
            _P,
            _P,
            _I,
            _P,
            _P,
        ]
        lib.lm_decode_step.restype = ctypes.c_int64
        lib.lm_sample_step.argtypes = [
            _P,
            _I,
            _I,
            _I,
            _F,
            _P,
            _P,
            _I,
            _I,
            _I,
            _I,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
        ]
        lib.lm_sample_step.restype = ctypes.c_int64
        lib.lm_sampler_init.argtypes = []
        lib.lm_sampler_init.restype = None
        lib.lm_sampler_init()  # the noise bounds the sampling step prunes with

    def model(
        self,
        layers,
        embed: torch.Tensor,
        norm: torch.Tensor,
        lm_head: torch.Tensor,
        lm_bias: torch.Tensor | None,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
    ) -> NativeModel:
        """The decode step over a ``FusedDecoder``'s weights (``layers``: its ``_Layer``s), checked once."""
        return NativeModel(self, layers, embed, norm, lm_head, lm_bias, heads, kv_heads, head_dim, eps, scale)

    def sample_step(
        self,
        logits: torch.Tensor,
        temperature: float,
        keys: torch.Tensor,
        rows: torch.Tensor,
        t: int,
        eos: int,
        tokens: torch.Tensor,
        logps: torch.Tensor,
        ent_sum: torch.Tensor,
        lengths: torch.Tensor,
        done: torch.Tensor,
        next_ids: torch.Tensor,
        keep: torch.Tensor,
    ) -> int:
        """The decode loop's sampling step of ``logits`` [n, vocab] for batch rows ``rows`` at step
        ``t`` with the rows' noise ``keys`` [batch] (int64, ``generation.sampler.row_key``; see
        ``decode.c``): writes ``next_ids``/``keep`` [n] and the not-yet-done rows' entries
        of the batch outputs; returns how many rows are kept."""
        n, vocab = logits.shape
        _check_sample_step(logits, keys, rows, t, tokens, logps, ent_sum, lengths, done, next_ids, keep)
        m, bsz = tokens.shape[1], tokens.shape[0]
        scratch = torch.empty(2 * vocab)
        kept = self.lib.lm_sample_step(
            logits.data_ptr(),
            logits.stride(0),
            n,
            vocab,
            temperature,
            keys.data_ptr(),
            rows.data_ptr(),
            bsz,
            t,
            eos,
            m,
            tokens.data_ptr(),
            logps.data_ptr(),
            ent_sum.data_ptr(),
            lengths.data_ptr(),
            done.data_ptr(),
            next_ids.data_ptr(),
            keep.data_ptr(),
            scratch.data_ptr(),
        )
        if kept < 0:
            raise ValueError("sample_step: rows out of range")
        return kept


def _check_sample_step(logits, keys, rows, t, tokens, logps, ent_sum, lengths, done, next_ids, keep) -> None:
    """``NativeKernels.sample_step``'s inputs as ``decode.c`` reads them: float32 and int64 tensors of
    the right shapes, contiguous, ``t`` within the output width."""
    n = logits.shape[0]
    _f32(logits, logps, ent_sum)
    m = tokens.shape[1]
    if (
        keys.dtype != torch.int64
        or not keys.is_contiguous()
        or rows.dtype != torch.int64
        or rows.shape != (n,)
        or rows.stride(0) != 1
        or not all(x.is_contiguous() for x in (tokens, logps, ent_sum, lengths, done, next_ids, keep))
        or tokens.dtype != torch.int64
        or lengths.dtype != torch.int64
        or next_ids.dtype != torch.int64
        or done.dtype != torch.bool
        or keep.dtype != torch.bool
        or logps.shape != tokens.shape
        or not 0 <= t < m
        or next_ids.shape != (n,)
        or keep.shape != (n,)
    ):
        raise ValueError("sample_step: shapes")
    bsz = tokens.shape[0]
    if keys.shape != (bsz,) or any(x.shape != (bsz,) for x in (ent_sum, lengths, done)):
        raise ValueError("sample_step: batch shapes")


def _check_step_inputs(ids, pos, cos, sin, prompt_of, ccol: int, width: int, head_dim: int) -> None:
    """``NativeModel.step``'s inputs as ``decode.c`` reads them: ids and positions [n] (int64,
    contiguous) within the caches' rows, completion column ``ccol`` within ``width``, float32 rotary
    tables [positions, head_dim]."""
    n = ids.shape[0]
    if (
        ids.dtype != torch.int64
        or pos.dtype != torch.int64
        or ids.shape != (n,)
        or pos.shape != (n,)
        or ids.stride(0) != 1
        or pos.stride(0) != 1
        or n > prompt_of.shape[0]
        or not 0 <= ccol < width
        or not (cos.is_contiguous() and sin.is_contiguous())
        or cos.shape != sin.shape
        or cos.shape[1] != head_dim
    ):
        raise ValueError("native step: inputs")
    _f32(cos, sin)


class NativeModel:
    """One native call per decode step (``lm_decode_step``): the weights are checked and their
    addresses taken once (the tensors are kept referenced); the caches are checked when they change
    (``cache_pointers``), so a step checks only its own inputs."""

    def __init__(
        self, k: NativeKernels, layers, embed, norm, lm_head, lm_bias, heads, kv_heads, head_dim, eps, scale
    ):
        hidden, vocab = embed.shape[1], lm_head.shape[0]
        inter = layers[0].gate_up.shape[0] // 2
        qkv_rows = (heads + 2 * kv_heads) * head_dim
        if head_dim % 16 or heads % kv_heads:
            raise ValueError(
                "native step: head_dim must be a multiple of 16 and heads a multiple of kv_heads"
            )
        keep = [embed, norm, lm_head, lm_bias]
        for w in layers:
            o, down = w.o.t(), w.down.t()  # the model's [out, in] weights (``_Layer`` holds transposed views)
            qkv = w.qkv[:qkv_rows]
            bias = None if w.qkv_bias is None else w.qkv_bias[:qkv_rows]
            for t, shape in (
                (w.ln1, (hidden,)),
                (qkv, (qkv_rows, hidden)),
                (bias, (qkv_rows,)),
                (o, (hidden, heads * head_dim)),
                (w.ln2, (hidden,)),
                (w.gate_up, (2 * inter, hidden)),
                (down, (hidden, inter)),
            ):
                if t is not None and (tuple(t.shape) != shape or not t.is_contiguous()):
                    raise ValueError(
                        f"native step: a weight of shape {tuple(t.shape)}, expected {shape} contiguous"
                    )
            keep += [w.ln1, qkv, bias, o, w.ln2, w.gate_up, down]
        for t in keep:
            if t is not None:
                _f32(t)
        if (
            tuple(norm.shape) != (hidden,)
            or tuple(lm_head.shape) != (vocab, hidden)
            or not embed.is_contiguous()
            or not lm_head.is_contiguous()
            or (lm_bias is not None and tuple(lm_bias.shape) != (vocab,))
        ):
            raise ValueError("native step: embedding/head shapes")
        self.k, self.keep = k, keep
        self.weights = _ptrs(keep)
        self.dims = (ctypes.c_int64 * 7)(hidden, heads, kv_heads, head_dim, inter, vocab, len(layers))
        self.eps_scale = (ctypes.c_float * 2)(eps, scale)
        self.vocab, self.head_dim, self.kv_heads = vocab, head_dim, kv_heads
        self._local = threading.local()  # a workspace per calling thread (decode shards run side by side)

    def cache_pointers(self, prompt, rows) -> tuple:
        """Checked addresses and strides of ``prompt`` (``_PromptKV``) and ``rows`` (``_CompletionKV``)
        for ``step``; call again after either changes."""
        d, kv = self.head_dim, self.kv_heads
        u, p = prompt.mask.shape
        _f32(prompt.mask, *prompt.keys, *prompt.values, *rows.keys, *rows.values)
        same = lambda ts: all(t.stride() == ts[0].stride() and t.shape == ts[0].shape for t in ts)  # noqa: E731
        pk, pv, ck, cv = prompt.keys, prompt.values, rows.keys, rows.values
        if (
            not all(same(ts) for ts in (pk, pv, ck, cv))
            or tuple(pk[0].shape) != (u, kv, d, p)
            or tuple(pv[0].shape) != (u, kv, p, d)
            or ck[0].dim() != 5
            or tuple(ck[0].shape[1:]) != (kv, ck[0].shape[2], d, 16)
            or ck[0].stride()[2:] != (16 * d, 16, 1)
            or cv[0].shape[1] != kv
            or cv[0].shape[3] != d
            or ck[0].shape[0] != cv[0].shape[0]
            or rows.prompt_of.dtype != torch.int64
            or rows.prompt_of.dim() != 1
            or rows.prompt_of.shape[0] > ck[0].shape[0]
            or not rows.prompt_of.is_contiguous()
            or len(pk) != self.dims[6]
            or len(ck) != self.dims[6]
        ):
            raise ValueError("native step: cache shapes")
        strides = lambda t: (ctypes.c_int64 * t.dim())(*t.stride())  # noqa: E731
        return (
            _ptrs(pk),
            strides(pk[0]),
            _ptrs(pv),
            strides(pv[0]),
            prompt.mask.data_ptr(),
            prompt.mask.stride(0),
            p,
            u,
            _ptrs(ck),
            strides(ck[0]),
            _ptrs(cv),
            strides(cv[0]),
            min(cv[0].shape[2], 16 * ck[0].shape[2]),
            rows.prompt_of,
        )

    def step(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: tuple,
        ccol: int,
    ) -> torch.Tensor:
        """Logits [n, vocab] after ``ids`` [n] at ``pos`` [n] for the first n rows of the caches; the
        step's keys/values go to completion column ``ccol``. ``caches``: ``cache_pointers``' tuple."""
        n = ids.shape[0]
        (pk, pks, pv, pvs, pmask, pms, p, u, ck, cks, cv, cvs, width, prompt_of) = caches
        _check_step_inputs(ids, pos, cos, sin, prompt_of, ccol, width, self.head_dim)
        need = self.k.lib.lm_step_workspace(self.dims, n, p, ccol)
        work = getattr(self._local, "work", None)
        if work is None or work.numel() < need:
            work = self._local.work = torch.empty(need)
        logits = torch.empty((n, self.vocab))
        err = self.k.lib.lm_decode_step(
            self.dims,
            self.eps_scale,
            self.weights,
            self.k.sgemm,
            ids.data_ptr(),
            pos.data_ptr(),
            n,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            pk,
            pks,
            pv,
            pvs,
            pmask,
            pms,
            p,
            u,
            prompt_of.data_ptr(),
            ck,
            cks,
            cv,
            cvs,
            ccol,
            logits.data_ptr(),
            work.data_ptr(),
        )
        if err:
            raise ValueError("native step: a token, position or prompt index out of range")
        return logits
