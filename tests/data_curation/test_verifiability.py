"""Verifiability of reference answers: each kind of unverifiable answer gets its reason at ingest,
short-form answers pass, and ``data.verifiability=off`` keeps every row."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conf.loader import load_config
from conf.schema import ConfigError
from data_curation.ingest import SourceSpec, ingest
from data_curation.verifiability import grade_answer

SHORT_FORM = [
    "7",
    "\\frac{1}{2}",
    "(1,2)",
    "x^2+1",
    "\\text{Monday}",
    "\\text{(C)}",
    "-2 \\text{ or } -12",
    "\\text{Softball, Kickball, Picnic}",
    "(-\\infty,-2) \\cup (-1,1)",
    "\\begin{pmatrix} 1 & 0 \\\\ 0 & 1 \\end{pmatrix}",
    "20\\text{ square units}",
    "-(ab + ac + bc)",
]

UNVERIFIABLE = {
    "Proof. Since n is even, n = 2k, so n^2 = 4k^2.": "proof",
    "We show that the sum is always 5": "proof",
    "It follows that n = 5 is prime. \\blacksquare": "proof",
    "a) 5 b) 6": "multi-part",
    "(a) 3; (b) 4": "multi-part",
    "(i) 3 (ii) 4": "multi-part",
    "Part (a): 5, part (b): 7": "multi-part",
    "\\boxed{2} and \\boxed{3}": "multi-part",
    "The answer is 5.": "free text",
    "Natalia sold 48/2 = 24 clips in May and 48+24 = 72 clips altogether in April and May. #### 72"
    " so she sold them all over two months of the spring season at the school fair": "free text",
    "x" * 301: "too long",
    "\\frac{1}{2": "unparseable",
    "\\boxed{5}": "unparseable",
}


@pytest.mark.parametrize("answer", SHORT_FORM)
def test_short_form_answers_are_verifiable(answer):
    assert grade_answer(answer) is None
    assert grade_answer(7) is None and grade_answer(2.5) is None


@pytest.mark.parametrize("answer,kind", UNVERIFIABLE.items())
def test_each_unverifiable_answer_gets_its_kind(answer, kind):
    graded = grade_answer(answer)
    assert graded is not None and graded.kind == kind, graded
    assert graded.reason.startswith(f"unverifiable answer: {kind} (")


def _pool(tmp_path):
    rows = [
        {"problem": f"Problem number {i} about sums of {i} things.", "answer": a}
        for i, a in enumerate(SHORT_FORM)
    ]
    rows += [
        {"problem": f"Another problem {i} on the theory of numbers.", "answer": a}
        for i, a in enumerate(UNVERIFIABLE)
    ]
    rows.append({"problem": "An empty one.", "answer": ""})
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SourceSpec(name="noisy", path=str(path))


def test_ingest_quarantines_unverifiable_answers_with_reasons_and_counts_them(tmp_path):
    spec = _pool(tmp_path)
    counts = ingest([spec], tmp_path / "out")
    q = pq.read_table(tmp_path / "out" / "quarantine.parquet").to_pylist()
    reasons = {json.loads(r["raw"])["answer"]: r["reason"] for r in q}
    assert reasons.pop("") == "empty answer"  # the existing reason is kept for empty answers
    assert {a: r.split(" (")[0] for a, r in reasons.items()} == {
        a: f"unverifiable answer: {k}" for a, k in UNVERIFIABLE.items()
    }
    assert counts["ingested"] == len(SHORT_FORM)
    assert counts["quarantined"] == len(UNVERIFIABLE) + 1
    assert counts["unverifiable"] == len(UNVERIFIABLE)
    assert counts["unverifiable_proof"] == 3 and counts["unverifiable_multi_part"] == 5
    assert counts["unverifiable_free_text"] == 2 and counts["unverifiable_too_long"] == 1
    assert counts["unverifiable_unparseable"] == 2


def test_verifiability_off_keeps_every_answer_and_adds_no_counts(tmp_path):
    counts = ingest([_pool(tmp_path)], tmp_path / "out", verifiability="off")
    assert counts["ingested"] == len(SHORT_FORM) + len(UNVERIFIABLE)
    assert counts["quarantined"] == 1
    assert not any(k.startswith("unverifiable") for k in counts)
    with pytest.raises(ValueError, match="verifiability='lenient' is not one of short_form, off"):
        ingest([_pool(tmp_path)], tmp_path / "out2", verifiability="lenient")


def test_data_verifiability_is_validated_and_defaults_to_short_form():
    assert load_config([]).data.verifiability == "short_form"
    assert load_config(["data.verifiability=off"]).data.verifiability == "off"
    with pytest.raises(
        ConfigError,
        match="data.verifiability='strict' is not supported; set data.verifiability to one of: short_form",
    ):
        load_config(["data.verifiability=strict"])
