"""Remove prompts that overlap an evaluation benchmark (n-gram decontamination).

Texts are NFKC-normalised (``ingest.normalize_text``), lowercased and cut into tokens with the
RE2 regex ``TOKEN_RE`` (Unicode ``\\w+|[^\\w\\s]``: "3+4" is three tokens). Every window of
``ngram`` consecutive tokens becomes one 63-bit hash; a text with fewer than ``ngram`` tokens is
one gram made of its whole token sequence, so a short benchmark problem ("What is 3+4-2?")
matches a prompt that is exactly that problem, never through its sub-sequences. Tokenising,
hashing and the join all run in DuckDB SQL. Benchmark items are only read, never modified.

A prompt is contaminated by a benchmark item when the grams they share cover at least
``min_coverage`` (default 0.7) of the item's tokens. A copy covers all of it; one edited word in
the middle loses one token, one within 12 tokens of either end loses up to 12 (so a single edit
anywhere is caught in items of 40 tokens or more). One shared gram is not enough: with punctuation
as tokens, 13 tokens span a few words of LaTeX or Asymptote boilerplate. On the vendored MATH
train pool (7,462 prompts after ingest) against the five vendored benchmarks, "any shared 13-gram"
flags 1,299 prompts; coverage >= 0.5 flags 95, mostly template siblings ("Convert the point ...
to polar coordinates. Enter your answer in the form ..."); >= 0.7 flags 27 and >= 0.8 flags 18,
all against MATH-500: the same figure or setup with another question, or a shared template.

Outputs in ``out_dir``: ``prompts.parquet`` (the input table, contaminated rows removed, order and
schema kept) and ``contamination.parquet`` (one row per contaminated prompt and benchmark item:
prompt_id, source, benchmark, benchmark_problem_id, matched (the prompt's first shared gram, tokens
joined by spaces), overlap (distinct shared grams), coverage), ordered by prompt, then item.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_curation.ingest import normalize_text

__all__ = ["CONTAMINATION_SCHEMA", "TOKEN_RE", "decontaminate", "gram_table"]

TOKEN_RE = r"[\p{L}\p{M}\p{N}_]+|[^\p{L}\p{M}\p{N}_\s]"

CONTAMINATION_SCHEMA = pa.schema([("prompt_id", pa.string()), ("source", pa.string()), ("benchmark", pa.string()),
                                  ("benchmark_problem_id", pa.string()), ("matched", pa.string()),
                                  ("overlap", pa.int64()), ("coverage", pa.float64())])


def gram_table(con, relation: str, name: str, ngram: int) -> None:
    """Create temp tables ``name_tokens(id, k, x)`` (1-based token positions) and ``name(id, pos, g)``:
    the n-gram hashes (BIGINT) of each text of ``relation(id, text)``, one per start position."""
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {name}_tokens AS
        WITH tok AS (SELECT id, regexp_extract_all(lower(text), '{TOKEN_RE}') AS t FROM {relation})
        SELECT id, unnest(generate_series(1, len(t))) AS k, unnest(t) AS x FROM tok
    """)
    window = ", ".join(["x"] + [f"lead(x, {i}) OVER w" for i in range(1, ngram)])
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {name} AS
        WITH grams AS (  -- the gram starting at k: x and the next ngram - 1 tokens (NULL past the end)
            SELECT id, k, count(*) OVER (PARTITION BY id) AS m, hash({window}) AS h
            FROM {name}_tokens WINDOW w AS (PARTITION BY id ORDER BY k)
        )
        SELECT id, k AS pos, (h >> 1)::BIGINT AS g FROM grams WHERE k <= greatest(m - {ngram - 1}, 1)
    """)


_HITS_SQL = """
    WITH bench AS (SELECT DISTINCT id, g FROM _bgrams),
    shared AS (  -- prompt grams found in some benchmark item
        SELECT p.id AS pid, p.pos, p.g FROM _pgrams p WHERE p.g IN (SELECT g FROM bench)
    ), hits AS (
        SELECT s.pid, b.id AS bid, count(DISTINCT s.g) AS overlap, min(s.pos) AS first_pos
        FROM shared s JOIN bench b ON b.g = s.g GROUP BY s.pid, b.id
    ), starts AS (  -- where the shared grams start in the benchmark item
        SELECT DISTINCT s.pid, b.id AS bid, b.pos FROM (SELECT DISTINCT pid, g FROM shared) s
        JOIN _bgrams b ON b.g = s.g
    ), covered AS (
        SELECT pid, bid, unnest(generate_series(pos, pos + {n} - 1)) AS k FROM starts
    ), coverage AS (
        SELECT c.pid, c.bid, count(DISTINCT c.k)::DOUBLE / any_value(m.m) AS coverage
        FROM covered c JOIN (SELECT id, count(*) AS m FROM _bgrams_tokens GROUP BY id) m ON m.id = c.bid
        WHERE c.k <= m.m GROUP BY c.pid, c.bid
    ), kept AS (
        SELECT h.*, c.coverage FROM hits h JOIN coverage c ON c.pid = h.pid AND c.bid = h.bid
        WHERE c.coverage >= {min_coverage} - 1e-12
    ), matched AS (
        SELECT h.pid, h.bid, string_agg(t.x, ' ' ORDER BY t.k) AS matched
        FROM kept h JOIN _pgrams_tokens t ON t.id = h.pid AND t.k BETWEEN h.first_pos AND h.first_pos + {n} - 1
        GROUP BY h.pid, h.bid
    )
    SELECT pr.prompt_id, pr.source, it.benchmark, it.problem_id AS benchmark_problem_id, m.matched, h.overlap,
           h.coverage, h.pid
    FROM kept h JOIN matched m ON m.pid = h.pid AND m.bid = h.bid
    JOIN _prompts pr ON pr.id = h.pid JOIN _items it ON it.id = h.bid
    ORDER BY h.pid, h.bid
"""


def _items_table(benchmark_items: Iterable) -> pa.Table:
    seen, rows = set(), {"id": [], "benchmark": [], "problem_id": [], "text": []}
    for item in benchmark_items:
        key = (str(item.benchmark), str(item.problem_id))
        if key in seen:
            continue
        seen.add(key)
        rows["id"].append(len(seen) - 1)
        rows["benchmark"].append(key[0])
        rows["problem_id"].append(key[1])
        rows["text"].append(normalize_text(str(item.problem)))
    types = {"id": pa.int64(), "benchmark": pa.string(), "problem_id": pa.string(), "text": pa.string()}
    return pa.table({k: pa.array(v, types[k]) for k, v in rows.items()})


def decontaminate(prompts_path: Path, benchmark_items: Iterable, out_dir: Path, *, ngram: int = 13,
                  min_coverage: float = 0.7) -> dict[str, float]:
    """Drop the prompts of ``prompts_path`` (an ingest ``prompts.parquet``) that cover at least
    ``min_coverage`` of a benchmark item's tokens with shared ``ngram``-grams; ``benchmark_items``
    are objects with ``benchmark``, ``problem_id`` and ``problem``. See the module docstring.
    Returns counts: prompts_in, clean, contaminated and contaminated_<benchmark> (prompts hit by
    that benchmark) for every benchmark among the items."""
    from data_curation.db import memory_db

    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    if not 0 < min_coverage <= 1:
        raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage}")
    prompts = pq.read_table(prompts_path)
    missing = {"prompt_id", "problem"} - set(prompts.column_names)
    if missing:
        raise ValueError(f"{prompts_path} lacks column(s) {sorted(missing)}; expected ingest's prompts.parquet")
    items = _items_table(benchmark_items)
    texts = pa.table({
        "id": pa.array(range(prompts.num_rows), pa.int64()),
        "prompt_id": prompts["prompt_id"],
        "source": prompts["source"] if "source" in prompts.column_names else pa.nulls(prompts.num_rows, pa.string()),
        "text": pa.array([normalize_text(p or "") for p in prompts["problem"].to_pylist()], pa.string()),
    })
    con = memory_db()
    try:
        con.register("_prompts", texts)
        con.register("_items", items)
        gram_table(con, "_items", "_bgrams", ngram)
        gram_table(con, "_prompts", "_pgrams", ngram)
        contamination = con.sql(_HITS_SQL.format(n=ngram, min_coverage=float(min_coverage))).to_arrow_table()
    finally:
        con.close()

    dirty = np.unique(contamination["pid"].to_numpy())
    keep = np.ones(prompts.num_rows, dtype=bool)
    keep[dirty] = False
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts.filter(pa.array(keep)), out_dir / "prompts.parquet", compression="zstd")
    pq.write_table(contamination.drop_columns(["pid"]).cast(CONTAMINATION_SCHEMA), out_dir / "contamination.parquet",
                   compression="zstd")

    counts = {"prompts_in": float(prompts.num_rows), "clean": float(prompts.num_rows - len(dirty)),
              "contaminated": float(len(dirty))}
    pairs = set(zip(contamination["pid"].to_pylist(), contamination["benchmark"].to_pylist()))
    for bench in sorted(set(items["benchmark"].to_pylist())):
        counts[f"contaminated_{bench}"] = float(sum(1 for _, b in pairs if b == bench))
    return counts
