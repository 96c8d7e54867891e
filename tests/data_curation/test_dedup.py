"""Dedup: shingles against a Python reference, short texts, rewording, components, LSH buckets."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from data_curation.dedup import (
    NearDupParams,
    connected_components,
    exact_duplicates,
    jaccard,
    lsh_band_keys,
    minhash_signatures,
    near_duplicates,
    shingle_table,
)
from data_curation.ingest import normalize_text

ROOT = Path(__file__).resolve().parents[2]
MATH = json.loads((ROOT / "data_curation" / "data" / "math_train.json").read_text(encoding="utf-8"))

_TOKEN = re.compile(r"\\[a-z]+|[^\W\d_]+|\d+|\S")
_WORD = re.compile(r"[^\W\d_]{2,}")


def reference_shingles(text: str, n: int = 5) -> set:
    """The shingle set of dedup.py's docstring, in plain Python."""
    tokens = _TOKEN.findall(text.lower())
    words = {("w", t) for t in tokens if _WORD.fullmatch(t)}
    skeleton = [t for t in tokens if not _WORD.fullmatch(t)]
    grams = {("s", *skeleton[i : i + n]) for i in range(max(len(skeleton) - n + 1, 1))} if skeleton else set()
    return words | grams


def reference_jaccard(a: str, b: str) -> float:
    sa, sb = reference_shingles(a), reference_shingles(b)
    return len(sa & sb) / len(sa | sb)


def _con(texts: list[str], **extra) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.register("t", pa.table({"rid": pa.array(range(len(texts)), pa.int64()), "text": texts, **extra}))
    return con


def test_sql_shingles_match_the_python_reference():
    texts = [normalize_text(r["problem"]) for r in MATH[:400]] + ["What is 3+4-2?", "What is 4+3-2?", "Hi"]
    con = _con(texts)
    shingle_table(con, "t", 5)
    sizes = dict(con.execute("SELECT rid, n FROM _shingles_size").fetchall())
    assert all(sizes[i] == len(reference_shingles(t)) for i, t in enumerate(texts))
    rng = random.Random(0)
    pairs = [tuple(sorted(rng.sample(range(len(texts)), 2))) for _ in range(200)] + [(400, 401)]
    con.register("p", pa.table({"a": [a for a, _ in pairs], "b": [b for _, b in pairs]}))
    for row in jaccard(con, "p").to_pylist():
        assert row["similarity"] == pytest.approx(
            reference_jaccard(texts[row["a"]], texts[row["b"]]), abs=1e-12
        )


def test_short_arithmetic_problems_are_not_near_duplicates():
    from data_curation.synthetic import generate

    pool, held = generate(0, 3000, 300, [1, 2, 3, 4, 5])
    texts = [p.problem for p in pool + held]
    texts += [t for t in ("What is 3+4-2?", "What is 3+4-5?", "What is 4+3-2?") if t not in texts]
    assert reference_jaccard("What is 3+4-2?", "What is 3+4-5?") < 0.5
    assert reference_jaccard("What is 3+4-2?", "What is 4+3-2?") < 0.85  # order matters in the skeleton
    assert near_duplicates(_con(texts), "t").num_rows == 0


def _reword(text: str, n: int, seed: int) -> str:
    """``text`` with ``n`` distinct words (of 4+ letters, outside $...$) swapped for other words."""
    rng = random.Random(seed)
    words = text.split(" ")
    spots = [i for i, w in enumerate(words) if re.fullmatch(r"[A-Za-z]{4,}", w)]
    for i in rng.sample(spots, n):
        words[i] = rng.choice(["number", "value", "amount", "figure", "quantity", "result"]) + "s"
    return " ".join(words)


def test_reworded_forty_word_problems_are_near_duplicates():
    originals = [
        normalize_text(r["problem"])
        for r in MATH
        if 38 <= len(r["problem"].split()) <= 42 and "[asy]" not in r["problem"]
    ][:30]
    copies = [_reword(t, 2 + i % 2, i) for i, t in enumerate(originals)]  # two or three words changed
    assert all(c != o for c, o in zip(copies, originals))
    found = near_duplicates(_con(originals + copies), "t").to_pylist()
    pairs = {(r["rid"], r["canonical_rid"]) for r in found}
    caught = sum((len(originals) + i, i) in pairs for i in range(len(originals)))
    assert caught >= 27, caught  # measured: 2 words changed -> 99.7 % >= 0.85, 3 words -> 85 %
    assert all(r["similarity"] >= 0.85 for r in found)
    assert all(r["canonical_rid"] < len(originals) <= r["rid"] for r in found)  # the original is kept


def test_match_column_keeps_siblings_with_different_answers():
    a = "If $(x+2)(x-3)=14$, find the product of the possible values of $x$."
    b = "If $(x+2)(x-3)=14$, find the sum of the possible values of $x$."
    assert near_duplicates(_con([a, b], answer=["-20", "1"]), "t").num_rows == 1
    assert near_duplicates(_con([a, b], answer=["-20", "1"]), "t", match="answer").num_rows == 0
    assert near_duplicates(_con([a, b], answer=["1", "1"]), "t", match="answer").num_rows == 1


def test_components_keep_the_earliest_row_of_a_chain():
    label = connected_components(7, np.array([5, 3, 1, 6]), np.array([3, 1, 4, 2]))
    assert label.tolist() == [0, 1, 2, 1, 1, 1, 2]
    # near_duplicates reports every dropped row against the earliest one, with its own similarity
    base = normalize_text(MATH[9]["problem"])
    chain = [base, _reword(base, 2, 1), _reword(_reword(base, 2, 1), 2, 2)]
    found = near_duplicates(_con(chain), "t").to_pylist()
    assert [(r["rid"], r["canonical_rid"]) for r in found] == [(1, 0), (2, 0)]
    assert found[0]["similarity"] == pytest.approx(reference_jaccard(chain[0], chain[1]))


def test_exact_duplicates_ignore_case_and_whitespace():
    texts = ["Find the sum.", "What is 2+2?", "find  THE\nsum.", "Find the sum!"]
    got = exact_duplicates(_con(texts), "t").to_pylist()
    assert [r["canonical_rid"] for r in got] == [0, 1, 0, 3]
    assert got[0]["text_hash"] == got[2]["text_hash"] != got[3]["text_hash"]


def test_crowded_lsh_buckets_are_refined_but_duplicates_still_found():
    sig = minhash_signatures(np.repeat(np.arange(3), 2), np.array([1, 2, 1, 2, 1, 3], np.uint64), 8, 0)[1]
    assert (sig[0] == sig[1]).all() and not (sig[0] == sig[2]).all()
    rng = np.random.default_rng(0)
    crowded = rng.integers(0, 2**32, size=(2000, 128), dtype=np.uint64).astype(np.uint32)
    crowded[:, :4] = 7  # band 0 puts all 2000 rows in one bucket
    keys = lsh_band_keys(crowded, 32, max_bucket=100)
    assert np.unique(keys[:, 0]).size > 1900
    # with tiny buckets allowed, a templated pool still yields its one real near duplicate
    from data_curation.synthetic import generate

    texts = [p.problem for p in generate(1, 2000, 10, [1, 2, 3, 4, 5])[0]]
    texts.append(normalize_text(MATH[9]["problem"]))
    texts.append(_reword(texts[-1], 2, 0))
    found = near_duplicates(_con(texts), "t", NearDupParams(max_bucket=20)).to_pylist()
    assert [(r["rid"], r["canonical_rid"]) for r in found] == [(len(texts) - 1, len(texts) - 2)]


def test_params_are_validated():
    with pytest.raises(ValueError, match="multiple of bands"):
        NearDupParams(num_perm=100, bands=32).validate()
    with pytest.raises(ValueError, match="threshold"):
        NearDupParams(threshold=0).validate()
