"""The evaluation stage as a plain library function: one checkpoint, the configured benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from collections.abc import Mapping

from conf.schema import EvalConfig
from evaluation.benchmarks import BENCHMARKS, FileBenchmark, items_from_records, load_benchmark
from evaluation.code_benchmarks import CODE_BENCHMARKS, load_humaneval
from evaluation.evaluate import EvalRow, evaluate_items, model_context, summarize_rows
from rewards.verifier import Verifier

HELDOUT = "arith_heldout"
"""The synthetic task's held-out set, read from the data artifact rather than the registry."""


NO_FILES: Mapping[str, FileBenchmark] = {}


def load_items(name: str, data_dir: Path | None, files: Mapping[str, FileBenchmark] = NO_FILES):
    """The items of benchmark ``name``: a file benchmark of ``files``, the held-out set, or a
    vendored one."""
    if name in files:
        return list(files[name].items)
    if name == HELDOUT:
        import polars as pl

        if data_dir is None:
            raise ValueError(f"benchmark {HELDOUT} needs the data artifact")
        return items_from_records(
            HELDOUT, pl.read_parquet(Path(data_dir) / "heldout.parquet").to_dicts(), id_key="prompt_id"
        )
    if name in CODE_BENCHMARKS:
        return load_humaneval()
    if name not in BENCHMARKS:
        names = ", ".join([*BENCHMARKS, *CODE_BENCHMARKS])
        raise ValueError(f"unknown benchmark {name!r}; choose from {HELDOUT}, {names}")
    return load_benchmark(name)


def benchmark_hash(name: str, data_dir: Path | None, files: Mapping[str, FileBenchmark] = NO_FILES) -> str:
    """sha256 of the file benchmark ``name`` is read from: the vendored JSON lines, the data
    artifact's ``heldout.parquet`` for the held-out set, or a file benchmark's own file (or folder).
    Decontamination certificates name it."""
    from core.artifacts import hash_file
    from evaluation.benchmarks import benchmark_path

    if name in files:
        return files[name].sha256
    if name == HELDOUT:
        if data_dir is None:
            raise ValueError(f"benchmark {HELDOUT} needs the data artifact")
        return hash_file(Path(data_dir) / "heldout.parquet")
    return hash_file(benchmark_path(name))


def subset(items: list, max_problems: int, seed: int, name: str) -> list:
    """``max_problems`` items of one benchmark drawn without replacement, seeded by ``seed`` and the
    benchmark's name (the same subset for every checkpoint), in file order; all of them when 0 or
    when the benchmark is smaller."""
    if max_problems <= 0 or len(items) <= max_problems:
        return list(items)
    import random

    keep = sorted(random.Random(f"{seed}:{name}").sample(range(len(items)), max_problems))
    return [items[i] for i in keep]


def benchmark_items(
    cfg: EvalConfig, data_dir: Path | None, seed: int, files: Mapping[str, FileBenchmark] = NO_FILES
) -> tuple[list, dict[str, int]]:
    """The items ``cfg`` evaluates (a seeded subset per benchmark with ``max_problems``) and each
    benchmark's full size. ``files`` holds the file benchmarks of ``cfg``, already read."""
    items, totals = [], {}
    for name in cfg.benchmark_names():
        if name == HELDOUT and data_dir is None:
            continue
        full = load_items(name, data_dir, files)
        totals[name] = len(full)
        items += subset(full, cfg.max_problems, seed, name)
    return items, totals


def evaluate_checkpoint(
    model_dir: Path,
    data_dir: Path | None,
    cfg: EvalConfig,
    *,
    templates: dict[str, str | None],
    seed: int,
    device: str,
    out_dir: Path,
    files: Mapping[str, FileBenchmark] = NO_FILES,
    env=None,
    components=(),
    judges: Mapping[str, object] | None = None,
    sandbox=None,
    envs=(),
) -> dict:
    """Writes ``rows.parquet`` (one row per problem and sample) and ``summary.json``; returns the
    summary. ``envs``: ``(name, conf.schema.EnvMixConfig)`` of a mixed run (``with_mixed``). ``files``:
    the file benchmarks of ``cfg``, read (each with its own template);
    ``components``: built reward components that score every benchmark (the learned reward model:
    its mean as ``reward/reward_model`` and best-of-n reranked by it as ``rm_best@n``); ``judges``:
    benchmark -> its verdict (``evaluation.evaluate.evaluate_items``); ``sandbox``: the run's
    ``conf.schema.SandboxConfig``, wherever code runs."""

    from generation.model import load_model

    model, tokenizer = load_model(model_dir, device)
    if HELDOUT in cfg.benchmark_names() and data_dir is None:
        load_items(HELDOUT, None)  # raises: the held-out set needs the data artifact
    items, totals = benchmark_items(cfg, data_dir, seed, files)
    templates = {**templates, **{name: f.template for name, f in files.items()}}
    with (
        Verifier(timeout_s=cfg.verifier_timeout_s) as verifier,
        tqdm(total=len(items) * cfg.n_samples, desc="evaluate", unit="sample", leave=False) as bar,
    ):
        rows = evaluate_items(
            model,
            tokenizer,
            items,
            templates=templates,
            n_samples=cfg.n_samples,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            seed=seed,
            device=device,
            verifier=verifier,
            progress=bar,
            env=env,
            score_with={name: f.score_with for name, f in files.items()},
            components=components,
            judges=judges,
            sandbox=sandbox,
        )
    rows, totals = with_mixed(
        model, tokenizer, rows, totals, envs, data_dir, cfg, templates, seed, device, judges, sandbox
    )
    summary = summarize_rows(rows, cfg.n_samples, model_context(model), totals)
    summary.update(overall_by_env(rows, envs, cfg.n_samples, model_context(model)))
    return written(rows, summary, Path(out_dir))


def written(rows, summary: dict, out_dir: Path) -> dict:
    """``rows.parquet`` and ``summary.json`` written in ``out_dir``; returns ``summary``."""
    write_rows(rows, out_dir / "rows.parquet")
    with open(out_dir / "summary.json", "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
    return summary


ALL_ENVS = "all"
"""The overall entry of a mixed run's per-environment held-out accuracy: ``arith_heldout@all``."""


def env_benchmark(name: str) -> str:
    """The benchmark name of mixed environment ``name``'s held-out items: ``arith_heldout@NAME``."""
    return f"{HELDOUT}@{name}"


def with_mixed(model, tokenizer, rows, totals, envs, data_dir, cfg, templates, seed, device, judges, sandbox):
    """``rows`` and ``totals`` with each mixed environment's held-out rows and sizes added
    (``mixed_heldout``), when there are ``envs``, the data artifact and the held-out benchmark."""
    if not envs or data_dir is None or HELDOUT not in cfg.benchmark_names():
        return rows, totals
    with Verifier(timeout_s=cfg.verifier_timeout_s) as verifier:
        more, sizes = mixed_heldout(
            model, tokenizer, envs, data_dir, cfg, templates[HELDOUT], seed, device, verifier, judges, sandbox
        )
    return rows + more, {**totals, **sizes}


def mixed_heldout(model, tokenizer, envs, data_dir, cfg, template, seed, device, verifier, judges, sandbox):
    """Rows of each mixed environment on its own held-out items, in that environment (episodes under
    its own target, params and limits): the run's held-out set, or, for an item with its own
    ``pool``, a seeded subset of that pool (``eval.max_problems``; the pool's rows are its prompts:
    it has no held-out split). Benchmark ``arith_heldout@NAME``; totals per benchmark."""
    from evaluation.benchmarks import items_from_records
    from generation.setup import read_table

    rows, totals = [], {}
    for name, e in envs:
        bench = env_benchmark(name)
        records = read_table(Path(e.pool)) if e.pool else None
        if records is None:
            import polars as pl

            records = pl.read_parquet(Path(data_dir) / "heldout.parquet").to_dicts()
        full = items_from_records(bench, records, id_key="prompt_id")
        totals[bench] = len(full)
        judge = {bench: judges[HELDOUT]} if judges and HELDOUT in judges else None
        rows += evaluate_items(
            model,
            tokenizer,
            subset(full, cfg.max_problems, seed, bench),
            templates={bench: template},
            n_samples=cfg.n_samples,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            seed=seed,
            device=device,
            verifier=verifier,
            env=e,
            judges=judge,
            sandbox=sandbox,
        )
    return rows, totals


def overall_by_env(rows, envs, n_samples: int, context: int | None) -> dict[str, dict]:
    """``arith_heldout@all`` (none without mixed rows): every mixed environment's held-out rows
    pooled (``accuracy``), with ``weighted_accuracy`` (each environment's accuracy weighted by its
    ``weight``) and ``by_env`` (environment -> accuracy)."""
    import dataclasses

    names = [n for n, _ in envs]
    mine = [r for r in rows if r.benchmark in {env_benchmark(n) for n in names}]
    if not mine:
        return {}
    pooled = [  # one problem per environment and item: the same held-out item in two is two problems
        dataclasses.replace(r, benchmark=env_benchmark(ALL_ENVS), problem_id=f"{r.benchmark}/{r.problem_id}")
        for r in mine
    ]
    out = summarize_rows(pooled, n_samples, context)
    each = summarize_rows(mine, n_samples, context)
    by_env = {n: each[env_benchmark(n)]["accuracy"] for n in names if env_benchmark(n) in each}
    weights = {n: e.weight for n, e in envs if n in by_env}
    entry = out[env_benchmark(ALL_ENVS)]
    entry["by_env"] = by_env
    entry["weighted_accuracy"] = sum(weights[n] * a for n, a in by_env.items()) / sum(weights.values())
    return out


def in_run_evaluator(
    tokenizer,
    data_dir: Path | None,
    cfg: EvalConfig,
    *,
    templates: dict[str, str | None],
    seed: int,
    device: str,
    verifier,
    files: Mapping[str, FileBenchmark] = NO_FILES,
    env=None,
    judges: Mapping[str, object] | None = None,
    sandbox=None,
):
    """A callback for evaluation every N RL steps:
    ``model -> {"eval_<benchmark>": avg@n, "eval_seconds": s}``. Same items, sampling and verifier as
    the eval stages, so the last in-run value of a checkpoint matches its eval stage's accuracy."""
    import time

    items, _ = benchmark_items(cfg, data_dir, seed, files)
    templates = {**templates, **{name: f.template for name, f in files.items()}}

    def evaluate(model) -> dict[str, float]:
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        rows = evaluate_items(
            model,
            tokenizer,
            items,
            templates=templates,
            n_samples=cfg.n_samples,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            seed=seed,
            device=device,
            verifier=verifier,
            env=env,
            score_with={name: f.score_with for name, f in files.items()},
            judges=judges,
            sandbox=sandbox,
        )
        model.train(was_training)
        out = {f"eval_{b}": s["accuracy"] for b, s in summarize_rows(rows, cfg.n_samples).items()}
        return {**out, "eval_seconds": time.perf_counter() - t0}

    return evaluate


__all__ = [
    "EvalRow",
    "benchmark_hash",
    "benchmark_items",
    "evaluate_checkpoint",
    "in_run_evaluator",
    "load_items",
    "subset",
    "HELDOUT",
]


def write_rows(rows, path: Path) -> None:
    """``rows`` (``EvalRow``s) as ``rows.parquet``: one row per problem and sample."""
    import polars as pl

    schema = {
        "benchmark": pl.Utf8,
        "problem_id": pl.Utf8,
        "sample_idx": pl.Int32,
        "response": pl.Utf8,
        "pred": pl.Utf8,
        "correct": pl.Boolean,
        "error": pl.Utf8,
        "length": pl.Int32,
        "truncated": pl.Boolean,
        "level": pl.Utf8,
        "subject": pl.Utf8,
        "prompt_length": pl.Int32,
    }
    pl.DataFrame([r.__dict__ for r in rows], schema=schema).write_parquet(path)
