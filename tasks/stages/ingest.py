"""``ingest``: the dataset's sources read, normalised, deduplicated and checked (quarantine for what
cannot be used), into the prompt pool."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import DATASET, PROMPTS, produce, insert_parquet

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection


def verifiability(cfg: Config) -> str:
    """``data.verifiability``: ingest's check that the math verifier can read a row's answer back, so
    ``off`` when another component is the run's verdict (it judges answers its own way)."""
    v = cfg.reward.verdict()
    return cfg.data.verifiability if v.is_builtin() and v.name == "math_verify" else "off"


def ingest_key(c: Config) -> dict:
    """``allow_empty`` only when set: an empty pool kept by one run is no cache hit for another."""
    return {
        **c.curation.dedup.model_dump(),
        "max_prompt_chars": c.data.max_prompt_chars,
        "verifiability": verifiability(c),
        "templates": c.curation.templates.model_dump(),
        **({"allow_empty": True} if c.data.allow_empty else {}),
    }


def ingest_body(ctx: StageContext) -> StageResult:
    from data_curation.ingest import SourceSpec, ingest
    from data_curation.sources import read_sources

    specs = []
    for spec in read_sources(Path(ctx.inputs[DATASET].path)):
        spec["extra_fields"] = tuple(spec.get("extra_fields") or ())
        specs.append(SourceSpec(**spec))
    ref, metrics = produce(
        ctx,
        PROMPTS,
        lambda out: ingest(
            specs,
            out,
            near_dup_threshold=ctx.cfg.curation.dedup.near_threshold,
            near_dup_same_answer=ctx.cfg.curation.dedup.same_answer,
            seed=ctx.cfg.seed,
            max_prompt_chars=ctx.cfg.data.max_prompt_chars,
            verifiability=verifiability(ctx.cfg),
            template_share=ctx.cfg.curation.templates.min_share if ctx.cfg.curation.templates.strip else None,
            allow_empty=ctx.cfg.data.allow_empty,
        ),
    )
    return StageResult({PROMPTS: ref}, metrics)


def record_ingest(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[PROMPTS]
    insert_parquet(
        con, "prompts", "prompt_id, source, 'pool', problem, answer, level", ref, "prompts.parquet"
    )
    insert_parquet(con, "quarantine", "source, source_row, raw, reason", ref, "quarantine.parquet")
    insert_parquet(
        con,
        "duplicates",
        "source, source_row, prompt_id, canonical_id, kind, similarity",
        ref,
        "duplicates.parquet",
    )
    if ref.file("templates.parquet").exists():
        insert_parquet(
            con,
            "source_templates",
            "source, template, prefix, suffix, rows, matched",
            ref,
            "templates.parquet",
        )


def ingest_headline(m: dict) -> str:
    return (
        f"rows {m['rows_in']:.0f}  ingested {m['ingested']:.0f}  quarantined {m['quarantined']:.0f}  "
        f"duplicates {m['duplicates_exact']:.0f}+{m['duplicates_near']:.0f} near" + unverifiable_detail(m)
    )


def unverifiable_detail(m: dict) -> str:
    """`` (unverifiable answers 12: proof 3, multi part 9)`` from ingest's counts; "" for none."""
    if not m.get("unverifiable"):
        return ""
    kinds = ", ".join(
        f"{k.removeprefix('unverifiable_').replace('_', ' ')} {v:.0f}"
        for k, v in m.items()
        if k.startswith("unverifiable_")
    )
    return f" (unverifiable answers {m['unverifiable']:.0f}: {kinds})"


def ingest_curation(m: dict) -> dict:
    """Where the pool's rows went: rows in = ingested + quarantined + duplicates (the unverifiable
    among the quarantined, per kind in the stage's metrics)."""
    out = {
        "rows_in": m["rows_in"],
        "ingested": m["ingested"],
        "quarantined": m["quarantined"],
        "duplicates": m["duplicates_exact"] + m["duplicates_near"],
    }
    if m.get("unverifiable"):
        out["unverifiable"] = m["unverifiable"]
    return out


STAGE = Stage(
    name="ingest",
    inputs={DATASET: ("data", DATASET)},
    config=ingest_key,
    body=ingest_body,
    record=record_ingest,
    headline=ingest_headline,
    curation=ingest_curation,
    curates=True,
)
