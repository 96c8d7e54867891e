"""Process set-up shared by the training and evaluation stages."""

from __future__ import annotations

import os
from pathlib import Path

import torch


_DEFAULT_THREADS = torch.get_num_threads()
"""torch's own choice for this process (OMP_NUM_THREADS when set, else one per physical core), read
before any stage sets another."""


def resolve_threads(threads: int) -> int:
    """The torch thread count a stage computes with: ``threads`` when positive, else torch's default.
    Float results depend on it (reductions split differently), so it is part of every training and
    sampling stage's cache key: a workspace computed with 2 threads is not reused with 1."""
    return threads if threads > 0 else _DEFAULT_THREADS


def setup_torch(threads: int, seed: int) -> None:
    torch.set_num_threads(resolve_threads(threads))
    torch.manual_seed(seed)
    if not torch.cuda.is_available():
        # transformers imports DeepSpeed when it saves or loads a model; on a machine without CUDA its
        # accelerator probe then warns "Setting accelerator to CPU" into every run's output. Naming
        # the CPU accelerator is what the probe would conclude, without the warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


class HostThreads:
    """A kept pool of host threads that runs ``fn(0) ... fn(k - 1)`` at once, each thread with its share
    of the caller's torch threads (``torch.set_num_threads`` is per thread for OpenMP and MKL; the
    caller's count is restored after). Results in index order; the first error is raised."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._pool = None
        self._size = 0

    def run(self, fn, k: int, *, inference: bool = False) -> list:
        import concurrent.futures

        threads = torch.get_num_threads()
        per = max(1, threads // k)
        if self._pool is None or self._size < k:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool = concurrent.futures.ThreadPoolExecutor(k, thread_name_prefix=self.prefix)
            self._size = k

        def call(i: int):
            torch.set_num_threads(per)
            if inference:  # grad mode is per thread
                with torch.inference_mode():
                    return fn(i)
            return fn(i)

        try:
            return [f.result() for f in [self._pool.submit(call, i) for i in range(k)]]
        finally:
            torch.set_num_threads(threads)


def read_table(path: Path) -> list[dict]:
    import polars as pl

    return pl.read_parquet(path).to_dicts()
