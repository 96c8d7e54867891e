"""``decontaminate``: the pool checked against the benchmarks it is scored on (n-gram overlap and,
optionally, paraphrase); what matches is removed and recorded (``contamination``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import DATASET, PROMPTS, produce, benchmark_hashes, file_benchmarks, insert_parquet

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

    from core.catalog import Catalog


def decontam_benchmarks(cfg: Config) -> list[str]:
    """What ``decontaminate`` checks the pool against: ``eval.benchmarks`` (file benchmarks too) and
    ``curation.decontam.benchmarks``, in that order, once each."""
    return list(dict.fromkeys([*cfg.eval.benchmark_names(), *cfg.curation.decontam.benchmarks]))


def decontaminate_key(c: Config) -> dict:
    return {**c.curation.decontam.model_dump(), "benchmarks": decontam_benchmarks(c)}


def decontam_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    return benchmark_hashes(cfg, decontam_benchmarks(cfg))


def paraphrase_params(cfg: Config):
    """``curation.decontam``'s paraphrase rule settings, or None when it is off."""
    from data_curation.decontaminate import ParaphraseParams

    d = cfg.curation.decontam
    if not d.paraphrase:
        return None
    return ParaphraseParams(
        high=d.paraphrase_high,
        moderate=d.paraphrase_moderate,
        ngram=d.paraphrase_ngram,
        num_perm=d.paraphrase_num_perm,
        bands=d.paraphrase_bands,
        seed=cfg.seed,
    )


def decontam_args(ctx: StageContext) -> tuple[list, dict]:
    """The benchmark items prompts are checked against (``decontam_benchmarks``; the held-out split
    only where the data stage wrote one) and ``data_curation.decontaminate.decontaminate``'s keywords,
    with each benchmark file's sha256 for the pool's certificate (``tasks.certificate``)."""
    from evaluation.stages import HELDOUT, benchmark_hash, load_items

    data = Path(ctx.inputs[DATASET].path)
    has_heldout = (data / "heldout.parquet").exists()
    names = [b for b in decontam_benchmarks(ctx.cfg) if b != HELDOUT or has_heldout]
    files = file_benchmarks(ctx.cfg)
    items = [it for b in names for it in load_items(b, data, files)]
    return items, dict(
        ngram=ctx.cfg.curation.decontam.ngram,
        min_coverage=ctx.cfg.curation.decontam.min_coverage,
        paraphrase=paraphrase_params(ctx.cfg),
        benchmark_hashes={b: benchmark_hash(b, data, files) for b in names},
    )


def decontaminate_body(ctx: StageContext) -> StageResult:
    from data_curation.decontaminate import decontaminate

    items, decontam = decontam_args(ctx)
    ref, metrics = produce(
        ctx,
        PROMPTS,
        lambda out: decontaminate(Path(ctx.inputs[PROMPTS].file("prompts.parquet")), items, out, **decontam),
    )
    return StageResult({PROMPTS: ref}, metrics)


def record_decontaminate(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    insert_parquet(
        con,
        "contamination",
        "prompt_id, source, benchmark, benchmark_problem_id, matched, overlap, rule, score",
        res.artifacts[PROMPTS],
        "contamination.parquet",
    )


def decontaminate_headline(m: dict) -> str:
    detail = (
        f" ({m['contaminated_ngram']:.0f} n-gram, {m['contaminated_paraphrase']:.0f} paraphrase)"
        if "contaminated_paraphrase" in m
        else ""
    )
    return f"clean {m['clean']:.0f}  contaminated {m['contaminated']:.0f}" + detail


STAGE = Stage(
    name="decontaminate",
    inputs={PROMPTS: ("ingest", PROMPTS), DATASET: ("data", DATASET)},
    config=decontaminate_key,
    body=decontaminate_body,
    record=record_decontaminate,
    headline=decontaminate_headline,
    external=decontam_files,
    curation=lambda m: {"contaminated": m["contaminated"]},
    curates=True,
)
