"""``data``: the synthetic pool and held-out set (``data.source=arith``) and snapshots of the
configured source files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import DATASET, produce, drop_defaults

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

    from core.catalog import Catalog


def data_key(c: Config) -> dict:
    """``data`` as it is; ``demo_full_stop_rate`` and ``template`` only when set (the default keys stay
    as they were); never ``allow_empty`` (it changes no byte of the dataset: ingest reads it)."""
    out = drop_defaults(c.data, "demo_full_stop_rate", "template")
    del out["allow_empty"]
    return out


def source_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    from data_curation.sources import source_hashes

    return source_hashes(cfg.data.sources)


def data_body(ctx: StageContext) -> StageResult:
    from data_curation.sources import ARITH_SOURCE, snapshot_sources, write_sources
    from data_curation.synthetic import write_dataset

    d = ctx.cfg.data

    def build(out: Path) -> dict:
        metrics: dict = {}
        specs = []
        if d.source == "arith":
            metrics = write_dataset(
                out,
                seed=ctx.cfg.seed,
                pool_size=d.pool_size,
                heldout_size=d.heldout_size,
                levels=list(d.levels),
                demo_error_rate=d.demo_error_rate,
                demo_restate_rate=d.demo_restate_rate,
                demo_full_stop_rate=d.demo_full_stop_rate,
            )
            specs.append(dict(ARITH_SOURCE))
        specs += snapshot_sources(d.sources, out)
        write_sources(out, specs)
        return {**metrics, "sources": float(len(specs))}

    ref, metrics = produce(ctx, DATASET, build)
    return StageResult({DATASET: ref}, metrics)


def record_data(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[DATASET]
    for split in ("pool", "heldout"):
        if ref.file(f"{split}.parquet").exists():
            con.execute(
                "INSERT INTO prompts SELECT ?, prompt_id, 'arith', split, problem, answer, level "
                "FROM read_parquet(?) ON CONFLICT DO NOTHING",
                [ref.sha256, str(ref.file(f"{split}.parquet"))],
            )


def data_headline(m: dict) -> str:
    pool = (
        f"pool {int(m['pool_prompts'])}  heldout {int(m['heldout_prompts'])}  " if "pool_prompts" in m else ""
    )
    return pool + f"sources {int(m['sources'])}"


STAGE = Stage(
    name="data",
    inputs={},
    config=data_key,
    body=data_body,
    record=record_data,
    headline=data_headline,
    external=source_files,
    curates=True,
)
