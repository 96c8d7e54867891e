"""The benchmark registry over the vendored files."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation.benchmarks import (
    BENCHMARKS,
    DATA_DIR,
    BenchmarkItem,
    build_prompt,
    items_from_records,
    load_benchmark,
    load_with_datasets,
)
from evaluation.code_benchmarks import CODE_BENCHMARKS
from rewards.verifier import normalize_answer

EXPECTED_COUNTS = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "amc23": 40}
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_registry_names():
    assert set(BENCHMARKS) == set(EXPECTED_COUNTS)
    assert all(name == spec.name for name, spec in BENCHMARKS.items())


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_counts_ids_and_normalised_answers(name):
    items = load_benchmark(name)
    assert len(items) == EXPECTED_COUNTS[name]
    assert len({it.problem_id for it in items}) == len(items)
    for item in items:
        assert item.benchmark == name
        assert item.problem.strip()
        assert item.answer and item.answer == normalize_answer(item.answer)


def test_vendored_files_match_the_readme_checksums():
    readme = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    sums = dict((f, h) for h, f in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    assert set(sums) == {spec.file for spec in BENCHMARKS.values()} | set(CODE_BENCHMARKS.values())
    for file, digest in sums.items():
        assert hashlib.sha256((DATA_DIR / file).read_bytes()).hexdigest() == digest, file


def test_answers_of_mixed_types_are_normalised():
    aime24 = {it.problem_id: it.answer for it in load_benchmark("aime24")}
    assert "025" not in aime24.values() and "25" in aime24.values()  # "025" in the file
    assert all(re.fullmatch(r"\d+", a) and not a.startswith("0") for a in aime24.values())
    assert load_benchmark("amc23")[0].answer == "27"  # 27.0 in the file
    assert "-1" in {it.answer for it in load_benchmark("amc23")}  # -1.0 in the file
    assert load_benchmark("aime25")[0].answer == "70"  # int 70 in the file
    gsm8k = load_benchmark("gsm8k")
    assert gsm8k[0].answer == "18"  # after '#### '
    assert "2125" in {it.answer for it in gsm8k}  # '#### 2,125'
    assert all(re.fullmatch(r"-?\d+", it.answer) for it in gsm8k)


def test_math500_carries_level_and_subject():
    items = load_benchmark("math500")
    assert {it.level for it in items} == {"1", "2", "3", "4", "5"}
    assert len({it.subject for it in items}) == 7
    assert items[0].problem_id == "test/precalculus/807.json"
    assert items[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert all(it.level is None and it.subject is None for it in load_benchmark("aime24"))


def test_unknown_benchmark_lists_valid_names():
    with pytest.raises(ValueError, match="unknown benchmark 'math501'.*aime24.*gsm8k.*math500"):
        load_benchmark("math501")


def test_load_from_another_data_dir(tmp_path):
    shutil.copy(DATA_DIR / BENCHMARKS["aime25"].file, tmp_path)
    assert load_benchmark("aime25", data_dir=tmp_path) == load_benchmark("aime25")
    with pytest.raises(FileNotFoundError, match="aime24_test.jsonl"):
        load_benchmark("aime24", data_dir=tmp_path)


@pytest.mark.parametrize("name", sorted(EXPECTED_COUNTS))
def test_datasets_loader_gives_the_same_items(name, tmp_path):
    assert load_with_datasets(name, cache_dir=str(tmp_path)) == load_benchmark(name)


def test_build_prompt_default_and_custom_templates():
    item = load_benchmark("math500")[0]
    prompt = build_prompt(item)
    assert prompt.startswith(item.problem)
    assert "\\boxed{}" in prompt
    assert all(build_prompt(load_benchmark(name)[0]).count("\\boxed{}") == 1 for name in BENCHMARKS)
    assert build_prompt(item, "Q: {problem}\nA:") == f"Q: {item.problem}\nA:"
    with pytest.raises(ValueError, match="must contain"):
        build_prompt(item, "no placeholder")


def test_items_from_records():
    records = [
        {"problem_id": "h1", "problem": "What is 3+4?", "answer": 7, "level": 1},
        {"problem_id": "h2", "problem": "What is 10-12?", "answer": "-2", "level": 3},
    ]
    items = items_from_records("arith_heldout", records)
    assert items == [
        BenchmarkItem("arith_heldout", "h1", "What is 3+4?", "7", "1", None),
        BenchmarkItem("arith_heldout", "h2", "What is 10-12?", "-2", "3", None),
    ]
    with pytest.raises(ValueError, match="pass template"):
        build_prompt(items[0])
    assert build_prompt(items[0], "{problem}\n") == "What is 3+4?\n"
    with pytest.raises(ValueError, match="lacks 'answer'"):
        items_from_records("x", [{"problem_id": "1", "problem": "p"}])


def test_items_from_records_accepts_objects_and_another_id_key():
    class Problem:
        prompt_id, problem, answer, level = "q7", "What is 1+1?", "2", 2

    assert items_from_records("arith", [Problem()], id_key="prompt_id") == [
        BenchmarkItem("arith", "q7", "What is 1+1?", "2", "2", None)
    ]


def test_evaluation_never_imports_prefect():
    code = (
        "import sys, rewards.verifier, evaluation.metrics, evaluation.benchmarks\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'torch'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
