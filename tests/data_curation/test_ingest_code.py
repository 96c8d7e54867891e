"""The ``code`` prompt-pool format: problem, tests and entry point become a ``CodeSpec`` answer kept
exactly (indentation and all), which ``code_tests`` scores."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from conf.schema import CodeTestsParams
from data_curation.ingest import SourceSpec, ingest
from environments.code import CodeSpec, CodeTests
from environments.sandbox import BubblewrapBackend
from rewards.components import Sample

CHECK = "def check(f):\n    assert f(2) == 4\ncheck(double)"
ROWS = [
    {"id": "add", "problem": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
     "entry_point": "add"},
    {"id": "double", "problem": "Complete double.", "tests": CHECK,
     "entry_point": "double", "prefix": "def double(x):\n    \"\"\"Twice x.\"\"\"\n"},
    {"id": "none", "problem": "No tests here."},
    {"id": "bad", "problem": "Tests of the wrong type.", "tests": [1, 2]},
]  # fmt: skip


def test_a_code_pool_keeps_its_tests_exactly_and_quarantines_rows_without(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    counts = ingest([SourceSpec("code", str(path), format="code", id_field="id")], tmp_path / "out")
    prompts = {r["prompt_id"]: r for r in pq.read_table(tmp_path / "out" / "prompts.parquet").to_pylist()}
    quarantine = pq.read_table(tmp_path / "out" / "quarantine.parquet").to_pylist()
    assert sorted(prompts) == ["add", "double"] and counts
    assert sorted((q["source_row"], q["reason"]) for q in quarantine) == [
        (2, "missing answer"),
        (3, "missing answer"),
    ]
    spec = CodeSpec.from_answer(prompts["double"]["answer"])
    assert (
        spec.prefix == ROWS[1]["prefix"]
        and spec.tests == (ROWS[1]["tests"],)
        and spec.entry_point == "double"
    )
    assert CodeSpec.from_answer(prompts["add"]["answer"]).tests == tuple(ROWS[0]["tests"])
    if BubblewrapBackend().unavailable() is not None:
        pytest.skip("bubblewrap cannot run here: the scoring half needs the sandbox")
    texts = ["```python\ndef add(a, b):\n    return a + b\n```", "    return x * 2\n"]
    samples = [Sample(t, prompts[k]["answer"], 0, 0) for t, k in zip(texts, ["add", "double"])]
    assert CodeTests(CodeTestsParams()).score(samples, [False, False]) == [1.0, 1.0]
