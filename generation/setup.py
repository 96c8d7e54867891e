"""Process set-up shared by the training and evaluation stages."""

from __future__ import annotations

from pathlib import Path

import torch


def setup_torch(threads: int, seed: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
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
