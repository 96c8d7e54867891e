from types import SimpleNamespace

import duckdb
import pyarrow.parquet as pq
import pytest

from data_curation.preferences import PreferenceOptions, ingest_preferences, load_comparisons, normalise

BENCH = (
    "Natalia sold clips to forty eight of her friends in April and then she sold "
    "half as many clips in May how many"
)


def _reasons(rows, shape, **opt):
    _, bad = normalise(rows, shape, "s", PreferenceOptions(**opt))
    return [b["reason"] for b in bad]


def test_a_ranking_of_k_yields_k_choose_2_pairs_best_first():
    good, bad = normalise([{"prompt": "p", "ranking": ["a", "b", "c", "d"]}], "ranking", "s")
    assert not bad and len(good) == 6
    assert {(g["chosen"], g["rejected"]) for g in good} >= {("a", "d"), ("b", "c")}


def test_hh_transcripts_split_at_the_shared_prefix():
    h = "\n\nHuman: what is 2+2?\n\nAssistant:"
    (g,), _ = normalise([{"chosen": h + " 4", "rejected": h + " 5"}], "hh", "s")
    assert (g["prompt"], g["chosen"], g["rejected"]) == (h.strip(), "4", "5")


def test_trl_conversational_rows_take_the_message_contents():
    row = {
        "prompt": [{"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "hello"}],
        "rejected": [{"role": "assistant", "content": "go away"}],
    }
    (g,), _ = normalise([row], "trl", "s")
    assert (g["prompt"], g["chosen"], g["rejected"]) == ("hi", "hello", "go away")


def test_ratings_give_pairs_by_difference_and_ties_follow_the_config():
    row = {
        "prompt": "p",
        "responses": [
            {"text": "x", "ratings": {"a1": 5, "a2": 3}},
            {"text": "y", "ratings": {"a1": 2, "a2": 3}},
        ],
    }
    dropped, _ = normalise([row], "ratings", "s")
    kept, _ = normalise([row], "ratings", "s", PreferenceOptions(ties="keep"))
    assert [(g["chosen"], g["margin"], g["annotator"]) for g in dropped] == [("x", 3.0, "a1")]
    assert len(kept) == 2 and kept[1]["margin"] == 0.0


def test_identical_responses_are_quarantined():
    assert _reasons([{"prompt": "p", "chosen": "a ", "rejected": "a"}], "pairs") == ["identical responses"]


def test_missing_and_empty_fields_are_quarantined():
    rows = [{"prompt": "p", "chosen": "a"}, {"prompt": " ", "chosen": "a", "rejected": "b"}]
    assert _reasons(rows, "pairs") == ["missing field rejected", "empty field prompt"]


def test_a_ranking_with_repeats_is_quarantined():
    assert _reasons([{"prompt": "p", "ranking": ["a", "b", "a"]}], "ranking") == ["ranking with repeats"]


def test_a_rating_out_of_range_is_quarantined():
    row = {
        "prompt": "p",
        "responses": [{"text": "x", "ratings": {"a": 9}}, {"text": "y", "ratings": {"a": 1}}],
    }
    (reason,) = _reasons([row], "ratings")
    assert reason.startswith("rating out of range: 9 by a")


def test_a_10_mb_response_is_quarantined():
    (reason,) = _reasons([{"prompt": "p", "chosen": "x" * 10_000_000, "rejected": "b"}], "pairs")
    assert reason.startswith("chosen of 10000000 characters")


def test_ingest_counts_reconcile_and_agreement_is_recorded(tmp_path):
    rows = [
        {"prompt": "p1", "chosen": "a", "rejected": "b", "annotator": "x"},
        {"prompt": "p1", "chosen": "a", "rejected": "b", "annotator": "y"},
        {"prompt": "p1", "chosen": "b", "rejected": "a", "annotator": "z"},
        {"prompt": "p1", "chosen": "a", "rejected": "b", "annotator": "x"},  # duplicate
        {"prompt": BENCH, "chosen": "72", "rejected": "71"},  # contaminated
        {"prompt": "p2", "chosen": "same", "rejected": "same"},  # quarantined
    ]
    ranking = [{"prompt": "p3", "ranking": ["r1", "r2", "r3"]}]
    item = SimpleNamespace(benchmark="gsm8k", problem_id="0", problem=BENCH, answer="72")
    counts = ingest_preferences([("prefs", "pairs", rows), ("ranks", "ranking", ranking)], tmp_path, [item])
    assert counts["rows_in"] == 7 and counts["candidates"] == 9
    assert (counts["comparisons"], counts["quarantined"], counts["duplicates"], counts["contaminated"]) == (
        6,
        1,
        1,
        1,
    )
    assert counts["candidates"] == sum(
        counts[k] for k in ("comparisons", "quarantined", "duplicates", "contaminated")
    )
    assert counts["agreement"] == pytest.approx(2 / 3) and counts["agreement_pairs"] == 1
    (q,) = pq.read_table(tmp_path / "quarantine.parquet").to_pylist()
    assert q == {"source": "prefs", "row": 5, "reason": "identical responses"}
    con = duckdb.connect()
    assert load_comparisons(con, tmp_path / "comparisons.parquet") == 6
    assert con.execute("SELECT count(*) FROM comparisons WHERE prompt = ?", [BENCH]).fetchone()[0] == 0


def test_the_vendored_hh_rlhf_file_ingests_with_its_counts_reconciled(tmp_path):
    """The real public file (Anthropic HH-RLHF harmless-base test, byte-identical): its sha256 and rows
    as in data_curation/data/README.md, every row accounted for, a planted benchmark question caught."""
    import gzip
    import hashlib
    import json
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "data_curation" / "data"
    path = data / "hh_rlhf_harmless_base_test.jsonl.gz"
    readme = (path.parent / "README.md").read_text()
    assert f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}" in readme
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2312
    planted = f"\n\nHuman: {BENCH}?\n\nAssistant:"
    rows.append({"chosen": planted + " 72", "rejected": planted + " 36"})
    rows.append(dict(rows[0]))
    item = SimpleNamespace(benchmark="gsm8k", problem_id="0", problem=BENCH, answer="72")
    c = ingest_preferences([("hh", "hh", rows)], tmp_path, [item])
    assert c["rows_in"] == c["candidates"] == 2314
    assert c["candidates"] == c["comparisons"] + c["quarantined"] + c["duplicates"] + c["contaminated"]
    assert (c["quarantined"], c["duplicates"], c["contaminated"]) == (4, 1, 1)
    reasons = {r["reason"] for r in pq.read_table(tmp_path / "quarantine.parquet").to_pylist()}
    assert reasons == {"empty field chosen"}
