"""Exact and near-duplicate detection over a DuckDB relation with columns ``rid`` (BIGINT, the row's
rank: lower = earlier = kept) and ``text`` (VARCHAR, already NFKC-normalised).

Exact duplicates share ``text_hash``: the sha256 of the text lowercased with every whitespace
character removed, so copies that differ only in case, spacing or line breaks collapse.

Near duplicates, all vectorised (no Python loop over rows or pairs):

1. **Shingles** (SQL). The lowercased text is cut into tokens: LaTeX commands (``\\frac``), letter
   runs, digit runs and single other characters. *Words* (letter runs of two or more letters) enter
   as a bag, one shingle per distinct word wherever it stands; every other token (numbers,
   one-letter variables, operators, LaTeX, punctuation) forms the ordered *skeleton*, shingled as
   token ``ngram``-grams (a skeleton shorter than ``ngram`` is one shingle). Rewording changes words,
   and a bag tolerates a few substitutions, while the mathematics must match in order. Measured on
   MATH train problems of 35-45 words with random word substitutions, the share of copies that keep
   Jaccard >= 0.85: two words changed 99.7 % (character 5-grams: 31 %), three words 85 % (2 %).
   Short problems stay apart: "What is 3+4-2?" vs "What is 3+4-5?" has Jaccard 1/3, "3+4" vs "4+3" 1/2.
2. **MinHash** (numpy): ``num_perm`` multiply-shift hashes of the 64-bit shingle hashes, seeded,
   minimum per row with ``np.minimum.reduceat``.
3. **LSH** (SQL): ``bands`` bands of ``num_perm // bands`` rows; rows sharing a band hash are
   candidates, joined in DuckDB. A bucket larger than ``max_bucket`` (many loosely similar texts,
   e.g. a templated pool) is refined with the next band's hash, so candidates never grow
   quadratically in the pool size; pairs whose sizes already rule out the threshold are skipped.
4. **Verification** (SQL): the exact Jaccard of the two shingle sets, kept when >= ``threshold``.
5. **Components** (numpy union-find by label propagation): each connected component keeps its
   earliest row (lowest ``rid``); the others are its duplicates, reported with their exact Jaccard
   to that kept row (which can be below the threshold when they joined through a chain).

DuckDB's ``hash`` is deterministic for one DuckDB version; a different version can bucket
differently, which can change only which borderline candidates LSH finds, never a verified score.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

__all__ = [
    "DEDUP_KEY_SQL",
    "NearDupParams",
    "connected_components",
    "exact_duplicates",
    "jaccard",
    "lsh_band_keys",
    "lsh_band_table",
    "minhash_signatures",
    "near_duplicates",
    "shingle_signatures",
    "shingle_table",
]

DEDUP_KEY_SQL = r"sha256(lower(regexp_replace({col}, '[\s\p{{Z}}]+', '', 'g')))"
"""SQL for ``text_hash``: sha256 of the text lowercased, whitespace removed (``{col}``: the column)."""

TOKEN_RE = r"\\[a-z]+|[\p{L}\p{M}]+|\p{Nd}+|\S"
WORD_RE = r"[\p{L}\p{M}]{2,}"

_GOLDEN = 0x9E3779B97F4A7C15
_PERM_CHUNK = 8
_BLOCK_SHINGLES = 1 << 20


@dataclass(frozen=True)
class NearDupParams:
    """Near-duplicate settings. ``num_perm`` must be a multiple of ``bands``."""

    threshold: float = 0.85
    ngram: int = 5
    num_perm: int = 128
    bands: int = 32
    seed: int = 0
    max_bucket: int = 100

    def validate(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"near-duplicate threshold must be in (0, 1], got {self.threshold}")
        if self.ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {self.ngram}")
        if self.bands < 1 or self.num_perm % self.bands:
            raise ValueError(
                f"num_perm ({self.num_perm}) must be a positive multiple of bands ({self.bands})"
            )
        if self.max_bucket < 2:
            raise ValueError(f"max_bucket must be >= 2, got {self.max_bucket}")


# --------------------------------------------------------------------------- exact


def exact_duplicates(con, relation: str) -> pa.Table:
    """For every row of ``relation``: ``rid``, ``text_hash`` and ``canonical_rid`` (the earliest row
    with the same hash; equal to ``rid`` for the row that is kept). Ordered by ``rid``."""
    key = DEDUP_KEY_SQL.format(col="text")
    return con.sql(f"""
        WITH h AS (SELECT rid, {key} AS text_hash FROM {relation})
        SELECT rid, text_hash, min(rid) OVER (PARTITION BY text_hash) AS canonical_rid
        FROM h ORDER BY rid
    """).to_arrow_table()


# --------------------------------------------------------------------------- shingles


def shingle_table(con, relation: str, ngram: int, name: str = "_shingles") -> None:
    """Create temp table ``name(rid BIGINT, h UBIGINT)``: the distinct shingle hashes of each row
    (see the module docstring), and ``name_size(rid, n)``: how many each row has."""
    window = ", ".join(["x"] + [f"lead(x, {i}) OVER w" for i in range(1, ngram)])
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {name} AS
        WITH tok AS (
            SELECT rid, regexp_extract_all(lower(text), '{TOKEN_RE}') AS t FROM {relation}
        ), tokens AS (
            SELECT rid, unnest(t) AS x, unnest(generate_series(1, len(t))) AS k FROM tok
        ), kinds AS (
            SELECT rid, x, k, regexp_full_match(x, '{WORD_RE}') AS is_word FROM tokens
        ), skeleton AS (
            SELECT rid, x, row_number() OVER (PARTITION BY rid ORDER BY k) AS j,
                   count(*) OVER (PARTITION BY rid) AS m
            FROM kinds WHERE NOT is_word
        ), grams AS (  -- the gram starting at j: x and the next ngram - 1 skeleton tokens
            SELECT rid, j, m, hash('s', {window}) AS h FROM skeleton WINDOW w AS (PARTITION BY rid ORDER BY j)
        )
        SELECT DISTINCT rid, h FROM (
            SELECT rid, hash('w', x) AS h FROM kinds WHERE is_word
            UNION ALL
            SELECT rid, h FROM grams WHERE j <= greatest(m - {ngram - 1}, 1)
        )
    """)
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE {name}_size AS SELECT rid, count(*) AS n FROM {name} GROUP BY rid"
    )


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def minhash_signatures(
    rid: np.ndarray, h: np.ndarray, num_perm: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """MinHash signatures from shingle hashes sorted by row: ``rid`` (int64, non-decreasing) and
    ``h`` (uint64). Returns (row ids, signatures of shape (rows, num_perm), uint32).

    Permutation k is the multiply-shift hash ``(a_k * h + b_k) >> 32`` (a_k odd), seeded."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    if len(rid) == 0:
        return np.zeros(0, np.int64), np.zeros((0, num_perm), np.uint32)
    starts = np.flatnonzero(np.r_[True, rid[1:] != rid[:-1]])
    rows = rid[starts]
    sig = np.empty((len(rows), num_perm), np.uint32)
    bounds = np.r_[starts, len(h)]
    r0 = 0
    while r0 < len(rows):  # blocks of whole rows, about _BLOCK_SHINGLES shingles each
        r1 = max(r0 + 1, int(np.searchsorted(bounds, bounds[r0] + _BLOCK_SHINGLES, side="right")) - 1)
        r1 = min(r1, len(rows))
        block = h[bounds[r0] : bounds[r1]]
        offsets = bounds[r0:r1] - bounds[r0]
        for p0 in range(0, num_perm, _PERM_CHUNK):
            x = np.multiply.outer(a[p0 : p0 + _PERM_CHUNK], block)
            x += b[p0 : p0 + _PERM_CHUNK, None]
            x >>= np.uint64(32)
            sig[r0:r1, p0 : p0 + _PERM_CHUNK] = np.minimum.reduceat(x, offsets, axis=1).T
        r0 = r1
    return rows, sig


def lsh_band_keys(sig: np.ndarray, bands: int, max_bucket: int) -> np.ndarray:
    """One uint64 key per row and band, shape (rows, bands). A bucket (band, key) with more than
    ``max_bucket`` rows has its rows' keys refined with the next band's key (then the one after),
    which raises the similarity needed to stay together there, until no bucket is too large."""
    n, num_perm = sig.shape
    r = num_perm // bands
    v = sig.reshape(n, bands, r).astype(np.uint64)
    base = np.zeros((n, bands), np.uint64)
    for j in range(r):
        base = _mix64(base ^ (v[:, :, j] + np.uint64(_GOLDEN * (j + 1) % 2**64)))
    keys = base.copy()
    for level in range(1, bands):
        crowded = False
        for band in range(bands):
            _, inverse, counts = np.unique(keys[:, band], return_inverse=True, return_counts=True)
            over = counts[inverse] > max_bucket
            if over.any():
                crowded = True
                keys[over, band] = _mix64(keys[over, band] ^ base[over, (band + level) % bands])
        if not crowded:
            break
    return keys


# --------------------------------------------------------------------------- verification


def jaccard(con, pairs: str, shingles: str = "_shingles") -> pa.Table:
    """Exact Jaccard of the shingle sets of each pair in relation ``pairs(a, b)``:
    columns a, b, similarity (Float64), ordered by (a, b)."""
    return con.sql(f"""
        WITH inter AS (
            SELECT p.a, p.b, count(*) AS n
            FROM {pairs} p JOIN {shingles} x ON x.rid = p.a JOIN {shingles} y ON y.rid = p.b AND y.h = x.h
            GROUP BY p.a, p.b
        )
        SELECT p.a, p.b, coalesce(i.n, 0)::DOUBLE / (sa.n + sb.n - coalesce(i.n, 0)) AS similarity
        FROM {pairs} p
        JOIN {shingles}_size sa ON sa.rid = p.a JOIN {shingles}_size sb ON sb.rid = p.b
        LEFT JOIN inter i ON i.a = p.a AND i.b = p.b
        ORDER BY p.a, p.b
    """).to_arrow_table()


def connected_components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Label of each of ``n`` nodes = the smallest node index in its component (edges a[i]-b[i]).
    Vectorised union-find: min-label propagation along edges with pointer jumping."""
    label = np.arange(n, dtype=np.int64)
    a = np.asarray(a, np.int64)
    b = np.asarray(b, np.int64)
    while True:
        m = np.minimum(label[a], label[b])
        before = label.copy()
        np.minimum.at(label, a, m)
        np.minimum.at(label, b, m)
        while True:  # pointer jumping: follow labels to their roots
            jumped = label[label]
            if np.array_equal(jumped, label):
                break
            label = jumped
        if np.array_equal(label, before):
            return label


def shingle_signatures(con, shingles: str, num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`minhash_signatures` of the rows of the shingle table ``shingles`` (``rid``, ``h``)."""
    sh = con.execute(f"SELECT rid, h FROM {shingles} ORDER BY rid").fetchnumpy()
    return minhash_signatures(np.asarray(sh["rid"], np.int64), np.asarray(sh["h"], np.uint64), num_perm, seed)


def lsh_band_table(rows: np.ndarray, keys: np.ndarray) -> pa.Table:
    """One row per row id of ``rows`` and band: ``rid``, ``band`` (int16) and ``bh``, the band's key
    from :func:`lsh_band_keys` (``keys`` of shape (rows, bands))."""
    bands = keys.shape[1]
    return pa.table(
        {
            "rid": np.repeat(rows, bands),
            "band": np.tile(np.arange(bands, dtype=np.int16), len(rows)),
            "bh": keys.reshape(-1),
        }
    )


def _no_near_duplicates() -> pa.Table:
    return pa.table(
        {
            "rid": pa.array([], pa.int64()),
            "canonical_rid": pa.array([], pa.int64()),
            "similarity": pa.array([], pa.float64()),
        }
    )


def _create_candidates(con, threshold: float, match: str | None) -> None:
    """Create temp table ``_candidates(a, b)``: the row pairs of ``_bands`` sharing a band whose
    shingle counts allow ``threshold``, with equal ``match_key`` when ``match`` is given."""
    same = (
        (
            "JOIN _nd_rows ma ON ma.rid = x.rid JOIN _nd_rows mb ON mb.rid = y.rid "
            "AND ma.match_key IS NOT DISTINCT FROM mb.match_key"
        )
        if match
        else ""
    )
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE _candidates AS
        SELECT DISTINCT x.rid AS a, y.rid AS b
        FROM _bands x JOIN _bands y ON x.band = y.band AND x.bh = y.bh AND x.rid < y.rid
        JOIN _shingles_size sa ON sa.rid = x.rid JOIN _shingles_size sb ON sb.rid = y.rid
        {same}
        WHERE least(sa.n, sb.n) >= {threshold!r} * greatest(sa.n, sb.n) - 1e-9
    """)


def _verified_pairs(con, threshold: float) -> dict[str, np.ndarray]:
    """The ``_candidates`` pairs (a, b) whose exact Jaccard reaches ``threshold``, ordered by (a, b)."""
    edges = jaccard(con, "_candidates")
    con.register("_scored", edges)
    kept = con.execute(
        f"SELECT a, b FROM _scored WHERE similarity >= {threshold!r} - 1e-12 ORDER BY a, b"
    ).fetchnumpy()
    con.unregister("_scored")
    return kept


def _all_but_earliest(con, rows: np.ndarray, kept: dict[str, np.ndarray]) -> pa.Table:
    """Every row of a connected component of the ``kept`` pairs but its earliest, with its Jaccard to
    that row (``near_duplicates``' table)."""
    # Components over positions in `rows` (sorted rids), so the smallest label is the earliest row.
    pos_a = np.searchsorted(rows, np.asarray(kept["a"], np.int64))
    pos_b = np.searchsorted(rows, np.asarray(kept["b"], np.int64))
    label = connected_components(len(rows), pos_a, pos_b)
    dropped = np.flatnonzero(label != np.arange(len(rows)))
    pairs = pa.table({"a": rows[label[dropped]], "b": rows[dropped]})
    con.register("_dup_pairs", pairs)
    sims = jaccard(con, "_dup_pairs")
    con.unregister("_dup_pairs")
    out = pa.table({"rid": sims["b"], "canonical_rid": sims["a"], "similarity": sims["similarity"]})
    return out.sort_by("rid")


def near_duplicates(
    con, relation: str, params: NearDupParams = NearDupParams(), *, match: str | None = None
) -> pa.Table:
    """Near duplicates among the rows of ``relation(rid, text)``: one row per dropped row, columns
    rid, canonical_rid (the earliest row of its component) and similarity (exact Jaccard between
    the two), ordered by rid. Rows not listed are kept. With ``match`` (a column of ``relation``),
    only rows with equal values there can be near duplicates."""
    params.validate()
    key = f', "{match}" AS match_key' if match else ""
    con.execute(f"CREATE OR REPLACE TEMP TABLE _nd_rows AS SELECT rid, text{key} FROM {relation}")
    shingle_table(con, "_nd_rows", params.ngram)
    rows, sig = shingle_signatures(con, "_shingles", params.num_perm, params.seed)
    if len(rows) < 2:
        return _no_near_duplicates()
    bands = lsh_band_table(rows, lsh_band_keys(sig, params.bands, params.max_bucket))
    con.register("_bands_arrow", bands)
    con.execute("CREATE OR REPLACE TEMP TABLE _bands AS SELECT * FROM _bands_arrow")
    con.unregister("_bands_arrow")
    _create_candidates(con, params.threshold, match)
    kept = _verified_pairs(con, params.threshold)
    if len(kept["a"]) == 0:
        return _no_near_duplicates()
    return _all_but_earliest(con, rows, kept)
