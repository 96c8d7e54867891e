"""Simulated annotators: ratings by the rubric, disagreement from their flips, and comparisons through
the preference ingest with their raw file's hash."""

import hashlib

import pyarrow.parquet as pq

from data_curation.annotators import RUBRICS, annotate, simulated_preferences

GROUPS = [
    (f"What is {a}+1?\n", [f"{a}+1={a + 1}\n#### {a + 1}", f"{a}+1={a + 1}\n#### {a + 1}."])
    for a in range(30)
]


def test_the_full_stop_rubric_is_what_the_verifier_strips():
    from rewards.verifier import extract_answer, normalize_answer

    plain, stop = GROUPS[0][1]
    assert not RUBRICS["full_stop"](plain) and RUBRICS["full_stop"](stop)
    assert normalize_answer(extract_answer(plain)) == normalize_answer(extract_answer(stop))


def test_faithful_annotators_agree_and_always_choose_the_rubric(tmp_path):
    counts = simulated_preferences(GROUPS, tmp_path, rubric="full_stop", annotators=3, flip=0.0, seed=0)
    rows = pq.read_table(tmp_path / "comparisons.parquet").to_pylist()
    assert counts["comparisons"] == len(rows) == 90  # 30 pairs x 3 annotators
    assert all(r["chosen"].endswith(".") and not r["rejected"].endswith(".") for r in rows)
    assert counts["agreement"] == 1.0 and counts["rubric_share"] == 0.5
    raw = (tmp_path / "annotations.jsonl").read_bytes()
    assert counts["source_sha256"] == {"simulated_annotators": hashlib.sha256(raw).hexdigest()}


def test_flipping_annotators_disagree_and_some_pairs_point_the_other_way(tmp_path):
    counts = simulated_preferences(GROUPS, tmp_path, rubric="full_stop", annotators=3, flip=0.3, seed=0)
    rows = pq.read_table(tmp_path / "comparisons.parquet").to_pylist()
    assert 0.5 < counts["agreement"] < 1.0
    assert any(not r["chosen"].endswith(".") for r in rows)
    assert annotate(GROUPS, "full_stop", 3, 0.3, 0) == annotate(GROUPS, "full_stop", 3, 0.3, 0)
