"""Process set-up shared by the training and evaluation stages."""

from __future__ import annotations

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
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def read_table(path: Path) -> list[dict]:
    import polars as pl

    return pl.read_parquet(path).to_dicts()
