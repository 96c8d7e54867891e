"""Benchmarks from ``eval.benchmarks`` file specs: read like data sources (jsonl with dotted fields,
verl parquet), hashed for the cache and certificates, and every bad spec a ConfigError naming the
key before anything is written."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conf.loader import load_config
from conf.schema import BenchmarkFileConfig, ConfigError
from core.artifacts import hash_file
from data_curation.benchmark_files import BenchmarkFileError, load_file_benchmark
from evaluation.benchmarks import DEFAULT_TEMPLATE
from evaluation.stages import benchmark_hash, benchmark_items, load_items
from tasks.stages.decontaminate import decontam_files
from tasks.stages.evaluate import benchmark_files
from tasks.preflight import load_checked

ROWS = [
    {"q": {"text": "What is 2+3?"}, "gold": "5", "uid": "a"},
    {"q": {"text": "What is 10/4?"}, "gold": 2.50, "uid": "b"},
    {"q": {"text": "Name the day after Monday."}, "gold": "$\\text{Tuesday}$", "uid": "c"},
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _spec(path, **kw) -> str:
    fields = {"name": "mine", "path": str(path), "problem_field": "q.text", "answer_field": "gold", **kw}
    return "eval.benchmarks=[arith_heldout,{" + ", ".join(f"{k}: {v!r}" for k, v in fields.items()) + "}]"


def test_a_jsonl_file_benchmark_reads_dotted_fields_and_normalises_answers(jsonl):
    cfg = load_checked([_spec(jsonl, id_field="uid")])
    spec = cfg.eval.benchmark_files()["mine"]
    assert cfg.eval.benchmark_names() == ["arith_heldout", "mine"]
    assert spec.score_with == ["math_verify"] and spec.format == "auto"
    bench = load_file_benchmark(spec)
    assert [(it.problem_id, it.problem, it.answer) for it in bench.items] == [
        ("a", "What is 2+3?", "5"),
        ("b", "What is 10/4?", "2.5"),
        ("c", "Name the day after Monday.", "Tuesday"),
    ]
    assert bench.sha256 == hash_file(jsonl) and bench.template == DEFAULT_TEMPLATE
    files = {"mine": bench}
    assert load_items("mine", None, files) == list(bench.items)
    assert benchmark_hash("mine", None, files) == hash_file(jsonl)
    items, totals = benchmark_items(cfg.eval, None, 0, files)  # no data artifact: the held-out set is skipped
    assert totals == {"mine": 3} and len(items) == 3
    # the file's hash keys the eval stage and decontamination like a vendored benchmark's
    assert benchmark_files(cfg) == {"benchmark:mine": hash_file(jsonl)}
    assert decontam_files(cfg)["benchmark:mine"] == hash_file(jsonl)


def test_a_verl_parquet_benchmark_and_row_ids(tmp_path):
    path = tmp_path / "v.parquet"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
            "reward_model": {"ground_truth": str(i + 1)},
        }
        for i in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    bench = load_file_benchmark(BenchmarkFileConfig(name="v", path=str(path), template="Q: {problem}"))
    assert [(it.problem_id, it.answer) for it in bench.items] == [
        ("0", "1"),
        ("1", "2"),
        ("2", "3"),
        ("3", "4"),
    ]
    assert bench.items[2].problem == "What is 2+1?" and bench.template == "Q: {problem}"


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "eval.benchmarks=[{name: mine, path: PATH, format: xml}]",
            "eval.benchmarks[0].format='xml' is not supported",
        ),
        ("eval.benchmarks=[{name: mine}]", "eval.benchmarks[0] needs a name and a path"),
        (
            "eval.benchmarks=[{name: mine, path: PATH, answer: x}]",
            "unknown config key 'eval.benchmarks[0].answer'",
        ),
        (
            "eval.benchmarks=[{name: mine, path: PATH, score_with: [cosine]}]",
            "eval.benchmarks[0].score_with='cosine' is not a reward component (did you mean "
            "'cosine_length'?); choose one of math_verify, cosine_length,",
        ),
        ("eval.benchmarks=[{name: 'a b', path: PATH}]", "eval.benchmarks[0].name='a b' is not an identifier"),
        ("eval.benchmarks=[{name: mine, path: PATH, template: 'no slot'}]", "must contain {problem}"),
        ("eval.benchmarks=[mine,{name: mine, path: PATH}]", "names a benchmark twice"),
    ],
)
def test_bad_file_specs_fail_at_load_naming_the_key(jsonl, override, message):
    with pytest.raises(ConfigError) as err:
        load_checked([override.replace("PATH", str(jsonl))])
    assert message in str(err.value)


def test_bad_files_fail_in_preflight_naming_the_row_and_field(jsonl, tmp_path):
    with pytest.raises(ConfigError, match=r"eval.benchmarks\[1\]: eval benchmark 'mine' .* no such file"):
        load_checked([_spec(tmp_path / "absent.jsonl")])
    with pytest.raises(ConfigError, match="row 0 has no field 'question' \\(problem_field\\)"):
        load_checked([_spec(jsonl, problem_field="question")])
    with pytest.raises(
        ConfigError, match="eval.benchmarks\\[1\\].name='math500' is a vendored benchmark's name"
    ):
        load_checked([_spec(jsonl, name="math500")])
    with pytest.raises(ConfigError, match="'arith_heldout' is a vendored"):
        load_checked(["eval.benchmarks=[{name: arith_heldout, path: " + str(jsonl) + "}]"])
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[0]) + "\n")
    with pytest.raises(ConfigError, match="duplicate problem id 'a'"):
        load_checked([_spec(dup, id_field="uid")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({**ROWS[0], "gold": " $ $ "}) + "\n")
    with pytest.raises(BenchmarkFileError, match="row 0 has an empty 'gold'"):
        load_file_benchmark(load_config([_spec(empty)]).eval.benchmark_files()["mine"])
