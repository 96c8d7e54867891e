"""The evaluation stage as a plain library function: one checkpoint, the configured benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from conf.schema import EvalConfig
from evaluation.benchmarks import BENCHMARKS, items_from_records, load_benchmark
from evaluation.evaluate import EvalRow, evaluate_items, summarize_rows
from evaluation.verifier import Verifier

HELDOUT = "arith_heldout"
"""The synthetic task's held-out set, read from the data artifact rather than the registry."""


def load_items(name: str, data_dir: Path | None):
    if name == HELDOUT:
        import polars as pl

        if data_dir is None:
            raise ValueError(f"benchmark {HELDOUT} needs the data artifact")
        return items_from_records(HELDOUT, pl.read_parquet(Path(data_dir) / "heldout.parquet").to_dicts(), id_key="prompt_id")
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {HELDOUT}, {', '.join(BENCHMARKS)}")
    return load_benchmark(name)


def benchmark_hash(name: str, data_dir: Path | None) -> str:
    """sha256 of the file benchmark ``name`` is read from: the vendored JSON lines, or the data
    artifact's ``heldout.parquet`` for the held-out set. Decontamination certificates name it."""
    from core.artifacts import hash_file
    from evaluation.benchmarks import benchmark_path

    if name == HELDOUT:
        if data_dir is None:
            raise ValueError(f"benchmark {HELDOUT} needs the data artifact")
        return hash_file(Path(data_dir) / "heldout.parquet")
    return hash_file(benchmark_path(name))


def evaluate_checkpoint(model_dir: Path, data_dir: Path | None, cfg: EvalConfig, *, templates: dict[str, str | None],
                        seed: int, device: str, out_dir: Path) -> dict:
    """Writes ``rows.parquet`` (one row per problem and sample) and ``summary.json``; returns the summary."""
    import polars as pl

    from generation.model import load_model

    model, tokenizer = load_model(model_dir, device)
    items = [it for name in cfg.benchmarks for it in load_items(name, data_dir)]
    with Verifier(timeout_s=cfg.verifier_timeout_s) as verifier, \
            tqdm(total=len(items) * cfg.n_samples, desc="evaluate", unit="sample", leave=False) as bar:
        rows = evaluate_items(model, tokenizer, items, templates=templates, n_samples=cfg.n_samples,
                              temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              batch_size=cfg.batch_size, seed=seed, device=device, verifier=verifier, progress=bar)
    summary = summarize_rows(rows, cfg.n_samples)
    pl.DataFrame([r.__dict__ for r in rows], schema={
        "benchmark": pl.Utf8, "problem_id": pl.Utf8, "sample_idx": pl.Int32, "response": pl.Utf8, "pred": pl.Utf8,
        "correct": pl.Boolean, "error": pl.Utf8, "length": pl.Int32, "truncated": pl.Boolean, "level": pl.Utf8,
        "subject": pl.Utf8,
    }).write_parquet(Path(out_dir) / "rows.parquet")
    with open(Path(out_dir) / "summary.json", "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return summary


def in_run_evaluator(tokenizer, data_dir: Path | None, cfg: EvalConfig, *, templates: dict[str, str | None],
                     seed: int, device: str, verifier):
    """A callback for evaluation every N RL steps: ``model -> {"eval_<benchmark>": avg@n, "eval_seconds": s}``.
    Same items, sampling and verifier as the eval stages, so the last in-run value of a checkpoint
    matches its eval stage's accuracy."""
    import time

    items = [it for name in cfg.benchmarks if name != HELDOUT or data_dir is not None
             for it in load_items(name, data_dir)]

    def evaluate(model) -> dict[str, float]:
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        rows = evaluate_items(model, tokenizer, items, templates=templates, n_samples=cfg.n_samples,
                              temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              batch_size=cfg.batch_size, seed=seed, device=device, verifier=verifier)
        model.train(was_training)
        out = {f"eval_{b}": s["accuracy"] for b, s in summarize_rows(rows, cfg.n_samples).items()}
        return {**out, "eval_seconds": time.perf_counter() - t0}

    return evaluate


__all__ = ["EvalRow", "benchmark_hash", "evaluate_checkpoint", "in_run_evaluator", "load_items", "HELDOUT"]
