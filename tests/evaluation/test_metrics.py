"""pass@k, avg@n, maj@k and summarize against hand-computed numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from evaluation.metrics import avg_at_n, default_ks, maj_at_k, pass_at_k, summarize


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (5, 2, 1, 2 / 5),  # pass@1 is the mean
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (5, 3, 3, 1.0),  # n - c < k: some correct sample is always drawn
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_matches_the_binomial_formula():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # C(10000, 5000) overflows a float; the product form does not.
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4, rel=1e-9)
    assert pass_at_k(10_000, 1, 5_000) == pytest.approx(0.5, rel=1e-9)
    assert 0.0 < pass_at_k(10_000, 3, 100) < 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (3, 4, 1), (3, -1, 1), (3, 1, 0), (0, 0, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_avg_at_n():
    assert avg_at_n([True, False, True, True]) == 0.75
    assert avg_at_n([False]) == 0.0
    with pytest.raises(ValueError):
        avg_at_n([])


def test_maj_at_k_votes_and_ties():
    preds = ["5", "3", "5", "3"]
    correct = [True, False, True, False]
    assert maj_at_k(preds, correct, 4) == 1.0  # 2-2 tie: "5" came first
    assert maj_at_k(preds, correct, 1) == 1.0
    assert maj_at_k(["3", "5", "5"], [False, True, True], 1) == 0.0
    assert maj_at_k(["3", "5", "5"], [False, True, True], 2) == 0.0  # 1-1 tie: "3" first
    assert maj_at_k(["3", "5", "5"], [False, True, True], 3) == 1.0


def test_maj_at_k_normalises_and_skips_missing_predictions():
    assert maj_at_k(["7", "025", "25"], [False, True, True], 3) == 1.0  # "025" and "25" agree
    assert maj_at_k([None, None, "3"], [False, False, True], 2) == 0.0  # no vote in the first 2
    assert maj_at_k([None, "4", None, "9"], [False, True, False, False], 4) == 1.0  # tie: "4" first
    assert maj_at_k([None, None], [False, False], 2) == 0.0


def test_maj_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True, False], 1)
    with pytest.raises(ValueError):
        maj_at_k(["1", "2"], [True, False], 3)


def test_default_ks():
    assert default_ks(1) == (1,)
    assert default_ks(4) == (1, 2, 4)
    assert default_ks(5) == (1, 2, 4, 5)


def _rows():
    # problem a (level 1, Algebra): 2 of 4 correct, majority "2" is correct
    # problem b (level 2, Algebra): 3 of 4 correct, majority "9" is correct
    # problem c (level 2, Geometry): 0 of 4 correct, one sample has no answer
    spec = {
        "a": ("1", "Algebra", [("2", True), ("3", False), ("4", False), ("2", True)]),
        "b": ("2", "Algebra", [("9", True), ("9", True), ("8", False), ("9", True)]),
        "c": ("2", "Geometry", [(None, False), ("1", False), ("1", False), ("0", False)]),
    }
    rows = []
    for pid, (level, subject, samples) in spec.items():
        for idx, (pred, ok) in reversed(list(enumerate(samples))):  # order must not matter
            rows.append(
                {
                    "problem_id": pid,
                    "sample_idx": idx,
                    "correct": ok,
                    "pred": pred,
                    "length": 10 * (idx + 1),
                    "truncated": pred is None,
                    "level": level,
                    "subject": subject,
                }
            )
    return rows


def test_summarize_hand_computed():
    s = summarize(_rows(), n_samples=4, ks=(1, 2, 4, 8))
    # a: avg 0.5 (2 of 4 correct), b: 0.75, c: 0
    assert s["n_problems"] == 3
    assert s["avg@4"] == pytest.approx((0.5 + 0.75 + 0.0) / 3)
    assert s["pass@1"] == pytest.approx(s["avg@4"])
    assert s["pass@2"] == pytest.approx(((1 - 1 / 6) + 1.0 + 0.0) / 3)  # a: 1 - C(2,2)/C(4,2)
    assert s["pass@4"] == pytest.approx(2 / 3)
    assert "pass@8" not in s  # k > n is skipped
    assert s["maj@4"] == pytest.approx(2 / 3)
    assert s["mean_length"] == pytest.approx(25.0)
    assert s["truncation_rate"] == pytest.approx(1 / 12)
    assert s["by_level"] == {
        "1": {"avg@4": pytest.approx(0.5), "count": 1},
        "2": {"avg@4": pytest.approx(0.375), "count": 2},
    }
    assert s["by_subject"] == {
        "Algebra": {"avg@4": pytest.approx(0.625), "count": 2},
        "Geometry": {"avg@4": pytest.approx(0.0), "count": 1},
    }


@dataclass(frozen=True)
class _Row:
    problem_id: str
    sample_idx: int
    correct: bool
    pred: str | None
    length: int
    truncated: bool


def test_summarize_accepts_records_without_breakdown_keys():
    rows = [_Row("p", i, i == 0, str(i), 5, False) for i in range(2)]
    s = summarize(rows, n_samples=2)
    assert s["avg@2"] == 0.5
    assert s["pass@1"] == 0.5 and s["pass@2"] == 1.0
    assert s["maj@2"] == 1.0  # 1-1 tie goes to the first sample's answer
    assert "by_level" not in s and "by_subject" not in s


def test_summarize_rejects_a_ragged_run():
    rows = _rows()[:-1]
    with pytest.raises(ValueError, match="expected n_samples=4"):
        summarize(rows, n_samples=4)
    with pytest.raises(ValueError):
        summarize([], n_samples=4)


def test_shaping_metrics_report_lengths_of_correct_and_wrong_and_the_repeated_ngram_rate():
    from evaluation.metrics import shaping_metrics

    rows = [
        {"correct": True, "length": 10, "response": "a b c a b c"},  # 4 trigrams, 3 distinct
        {"correct": True, "length": 20, "response": "x y z"},
        {"correct": False, "length": 64, "response": "no"},
    ]
    m = shaping_metrics(rows)
    assert m["mean_length_correct"] == 15 and m["mean_length_wrong"] == 64
    assert abs(m["repeated_ngram_rate"] - (0.25 + 0 + 0) / 3) < 1e-12
    assert shaping_metrics([rows[2]])["mean_length_correct"] is None
