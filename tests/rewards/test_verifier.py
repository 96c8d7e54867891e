"""The verifier: extraction, normalisation, fast path, math-verify pool, timeouts and crashes."""

from __future__ import annotations

import json
import operator
import os
import time

import pytest

from evaluation.benchmarks import benchmark_path, load_benchmark
from rewards.verifier import (
    Verdict,
    Verifier,
    extract_answer,
    math_verify_equal,
    normalize_answer,
    verify_one,
)

EXPECTED_COUNTS = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "amc23": 40}


@pytest.fixture(scope="module")
def verifier():
    with Verifier(timeout_s=10.0, workers=2) as v:
        yield v


def _die_on_boom(gold: str, pred: str) -> bool:
    """A compare function whose worker process dies on the prediction "boom"."""
    if pred == "boom":
        os._exit(3)
    return math_verify_equal(gold, pred)


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}} and finally \\boxed{3}", "3"),
        ("nested \\boxed{\\frac{a}{\\sqrt{b}}} end", "\\frac{a}{\\sqrt{b}}"),
        ("\\fbox{42}", "42"),
        ("The answer is $\\boxed 7$.", "7"),
        ("work\n#### 1,000\ntrailing line", "1,000"),
        ("#### 5\n#### 6", "6"),
        ("\\boxed{12", None),  # truncated: never closed
        ("\\boxed{}", None),
        ("I think it is 5", None),
        ("The answer is 12.", "12"),  # an instruct model's closing sentence (recipe=smollm2_arith)
        ("the answer is 3. No wait, the final answer is: $1,200.", "1,200"),
        ("#### 7\nThe answer is 8.", "7"),  # an explicit marker wins
        ("The answer is N.", None),  # the instruction echoed: no number
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# --------------------------------------------------------------------------- normalisation


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (27, "27"),
        (27.0, "27"),
        (2.50, "2.5"),
        (-1.0, "-1"),
        ("025", "25"),
        ("-007", "-7"),
        ("-0", "0"),
        ("+5", "5"),
        (" 1,000 ", "1000"),
        ("1{,}000", "1000"),
        ("$1,450,000$", "1450000"),
        ("\\$32,\\!348", "32348"),
        ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
        ("10,\\!080", "10080"),
        ("\\$18.90", "18.9"),
        (".0000672", "0.0000672"),
        ("42.", "42"),
        ("\\text{Monday}", "Monday"),
        ("\\textbf{\\text{ B }}", "B"),
        ("\\text{(C)}", "C"),
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("(1,2)", "(1,2)"),
        ("1,-2", "1,-2"),
        ("3, 5, 7", "3, 5, 7"),
        ("\\text{a} + \\text{b}", "\\text{a} + \\text{b}"),
        ("x  ^  2\n+ 1", "x ^ 2 + 1"),
        (None, ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_normalize_answer_handles_numbers_longer_than_int_limits():
    digits = "0" + "9" * 10_000
    assert normalize_answer(digits) == "9" * 10_000


# --------------------------------------------------------------------------- every gold answer


def _gold_cases() -> tuple[list[str], list[str], dict[str, int]]:
    """Responses boxing each gold answer of the five benchmarks, then GSM8K's raw solutions."""
    responses, golds, counts = [], [], {}
    for name in EXPECTED_COUNTS:
        items = load_benchmark(name)
        counts[name] = len(items)
        for item in items:
            responses.append(f"Let me think. ... The final answer is \\boxed{{{item.answer}}}.")
            golds.append(item.answer)
    with benchmark_path("gsm8k").open(encoding="utf-8") as f:
        solutions = [json.loads(line)["answer"] for line in f]
    for item, solution in zip(load_benchmark("gsm8k"), solutions, strict=True):
        responses.append(solution)  # the raw gold solution, ending in '#### <gold>'
        golds.append(item.answer)
    counts["gsm8k_raw"] = len(solutions)
    return responses, golds, counts


def test_every_vendored_gold_verifies_against_itself(verifier):
    responses, golds, counts = _gold_cases()
    assert counts == {**EXPECTED_COUNTS, "gsm8k_raw": 1319}
    assert len(responses) == 1319 + 500 + 30 + 30 + 40 + 1319
    start = time.monotonic()
    verdicts = verifier.verify_batch(responses, golds)
    assert time.monotonic() - start < 60
    failures = [(g, v) for g, v in zip(golds, verdicts) if not v.correct or v.error]
    assert failures == []
    assert all(v.reward == 1.0 for v in verdicts)


def test_integer_golds_against_unsimplified_fractions_take_the_slow_path(verifier):
    """Every integer gold of AIME 2024/2025 and AMC 2023 against an equivalent and a wrong
    fraction: neither is decidable by the fast path, so all 200 go through the worker pool."""
    golds = [it.answer for name in ("aime24", "aime25", "amc23") for it in load_benchmark(name)]
    assert len(golds) == 100
    equal = [f"\\boxed{{\\frac{{{2 * int(g)}}}{{2}}}}" for g in golds]
    wrong = [f"\\boxed{{\\frac{{{2 * int(g) + 1}}}{{2}}}}" for g in golds]
    verdicts = verifier.verify_batch(equal + wrong, golds + golds)
    assert [v.correct for v in verdicts] == [True] * 100 + [False] * 100
    assert all(v.error is None for v in verdicts)


def test_math_verify_accepts_every_non_numeric_math500_gold_against_itself():
    """The slow path on its own: each symbolic MATH-500 answer (intervals, matrices, text,
    degrees, bases...) parses and verifies against itself in math-verify."""
    golds = [it.answer for it in load_benchmark("math500") if not _is_plain_number(it.answer)]
    assert len(golds) > 150
    assert [g for g in golds if not math_verify_equal(g, g)] == []


def _is_plain_number(s: str) -> bool:
    return normalize_answer(s).lstrip("-").replace(".", "", 1).isdigit()


# --------------------------------------------------------------------------- equivalence table

EQUIVALENCES = [
    # (gold, answer in the response, expected correct)
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{2}", "\\dfrac12", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\frac{1}{2}", "0.6", False),
    ("25", "025", True),
    ("025", "25", True),
    (27.0, "27", True),
    ("27", "27.0", True),
    (27, "27.00", True),
    ("27", "28", False),
    ("2.5", "2.50", True),
    ("0.1", "0.10000000001", True),  # relative difference 1e-10 < 1e-9
    ("0.1", "0.1001", False),
    ("(1,2)", "(1, 2)", True),
    ("(1,2)", "(2,1)", False),
    ("(3,4]", "(3, 4]", True),
    ("[3,4]", "(3,4]", False),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", True),
    ("B", "B", True),
    ("B", "C", False),
    ("\\text{(C)}", "C", True),
    ("\\text{Monday}", "Monday", True),
    ("\\text{Monday}", "\\text{Monday}", True),
    ("\\text{Monday}", "\\text{Tuesday}", False),
    ("\\text{east}", "East", True),
    ("\\text{east}", "seat", False),  # math-verify alone says e*a*s*t == s*e*a*t
    ("\\text{east}", "seat+0", False),
    ("\\text{even}", "\\textit{even}", True),
    ("-5", "-5", True),
    ("-5", "5", False),
    ("-5", "-5.0", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("1,000", "1000", True),
    ("1000", "1,000", True),
    ("1000", "1,001", False),
    ("10080", "10,\\!080", True),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
    ("x^2+1", "1+x^2", True),
    ("3\\sqrt{13}", "\\sqrt{117}", True),
    ("90^\\circ", "90", True),
    ("\\frac{14}{3}", "4.67", False),
]


def test_equivalence_table(verifier):
    responses = [f"... so the answer is \\boxed{{{pred}}}" for _, pred, _ in EQUIVALENCES]
    verdicts = verifier.verify_batch(responses, [gold for gold, _, _ in EQUIVALENCES])
    got = [(gold, pred, v.correct) for (gold, pred, _), v in zip(EQUIVALENCES, verdicts)]
    assert got == EQUIVALENCES
    assert all(v.error is None for v in verdicts)


@pytest.mark.parametrize("response", ["", "   ", "I have no idea.", "\\boxed{}", "\\boxed{12"])
def test_no_answer_is_wrong_not_an_error(verifier, response):
    assert verifier.verify(response, "12") == Verdict(False, None, None)


def test_verdict_carries_the_normalised_prediction(verifier):
    v = verifier.verify("\\boxed{\\$1,000.}", 1000)
    assert v == Verdict(True, "1000", None)
    assert v.reward == 1.0
    assert Verdict(False, "3", None).reward == 0.0


def test_fast_path_never_starts_the_pool():
    with Verifier() as v:
        verdicts = v.verify_batch(["\\boxed{025}", "#### -3", "\\boxed{7}", "none"], ["25", -3.0, "8", "1"])
        assert [x.correct for x in verdicts] == [True, True, False, False]
        assert v._pool is None


def test_verify_one_uses_a_shared_verifier():
    assert verify_one("#### 42", 42.0) == Verdict(True, "42", None)
    assert verify_one("\\boxed{41}", "42") == Verdict(False, "41", None)


def test_batch_length_mismatch_is_an_error(verifier):
    with pytest.raises(ValueError, match="one gold per response"):
        verifier.verify_batch(["\\boxed{1}"], [])


# --------------------------------------------------------------------------- failure isolation


def test_pathological_answer_times_out_and_the_batch_goes_on():
    """9^(9^(9^9)) makes sympy compute a power tower for ever; the item is killed at its deadline,
    the pool is rebuilt, and every other item of the batch, and the next call, still score."""
    with Verifier(timeout_s=2.0, workers=2) as v:
        responses = [
            "\\boxed{9^{9^{9^{9}}}}",
            "\\boxed{\\frac{1}{2}}",
            "\\boxed{(1, 2)}",
            "\\boxed{12}",
            "\\boxed{\\sqrt{4}}",
        ]
        golds = ["3", "0.5", "(1,2)", "12", "2"]
        start = time.monotonic()
        verdicts = v.verify_batch(responses, golds)
        elapsed = time.monotonic() - start
        assert verdicts[0] == Verdict(False, "9^{9^{9^{9}}}", "timeout")
        assert [x.correct for x in verdicts[1:]] == [True, True, True, True]
        assert all(x.error is None for x in verdicts[1:])
        assert elapsed < 30
        assert v.verify("\\boxed{0.25}", "\\frac{1}{4}") == Verdict(True, "0.25", None)


def test_worker_exception_is_a_crash_verdict():
    with Verifier(timeout_s=5.0, compare=operator.truediv) as v:
        verdict = v.verify("\\boxed{\\frac{1}{3}}", "0.3")
    assert not verdict.correct
    assert verdict.error.startswith("crash: TypeError")
    assert verdict.pred == "\\frac{1}{3}"


def test_dead_worker_convicts_only_the_culprit():
    with Verifier(timeout_s=5.0, workers=2, compare=_die_on_boom) as v:
        verdicts = v.verify_batch(
            ["\\boxed{0.5}", "\\boxed{boom}", "\\boxed{\\frac{2}{4}}", "\\boxed{(1, 2)}"],
            ["\\frac{1}{2}", "1", "0.5", "(1,2)"],
        )
        assert verdicts[1] == Verdict(False, "boom", "crash: worker process died")
        assert [verdicts[i].correct for i in (0, 2, 3)] == [True, True, True]
        assert all(verdicts[i].error is None for i in (0, 2, 3))
        assert v.verify("\\boxed{1/4}", "0.25").correct


def test_invalid_settings():
    with pytest.raises(ValueError, match="timeout_s"):
        Verifier(timeout_s=0)
    with pytest.raises(ValueError, match="workers"):
        Verifier(workers=0)
