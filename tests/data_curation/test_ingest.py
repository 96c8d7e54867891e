"""Ingest: every source format, normalisation, quarantine, exact and near dedup on a real pool."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_curation.ingest import SourceSpec, ingest, normalize_text, read_source, resolve_format

ROOT = Path(__file__).resolve().parents[2]
MATH_FILE = ROOT / "data_curation" / "data" / "math_train.json"
MATH = json.loads(MATH_FILE.read_text(encoding="utf-8"))

# One record per answer-normalisation case; field names differ from the defaults on purpose.
RECORDS = [
    {
        "question": "What is ３+４?",
        "gold": 7,
        "uid": "r1",
        "lvl": "Level 3",
        "topic": "Arithmetic",
        "sol": "3+4=7",
    },
    {
        "question": "Find $x$ if  $2x = 1$.\r\nGive a fraction.",
        "gold": "\\frac{1}{2}",
        "uid": "r2",
        "lvl": 2.0,
        "topic": None,
        "sol": None,
    },
    {
        "question": "Compute $3^3$ as a decimal.",
        "gold": 27.0,
        "uid": "r3",
        "lvl": 4,
        "topic": "Algebra",
        "sol": "27",
    },
    {
        "question": "Write twenty-five with three digits.",
        "gold": "025",
        "uid": "r4",
        "lvl": None,
        "topic": "Words",
        "sol": "025",
    },
]
SPEC_FIELDS = dict(
    problem_field="question",
    answer_field="gold",
    id_field="uid",
    level_field="lvl",
    subject_field="topic",
    extra_fields=("sol",),
)
EXPECTED = {  # prompt_id -> (problem, answer, level, subject, sol)
    "r1": ("What is 3+4?", "7", 3, "Arithmetic", "3+4=7"),
    "r2": ("Find $x$ if $2x = 1$.\nGive a fraction.", "\\frac{1}{2}", 2, None, None),
    "r3": ("Compute $3^3$ as a decimal.", "27", 4, "Algebra", "27"),
    "r4": ("Write twenty-five with three digits.", "25", None, "Words", "025"),
}


def _rows(out: Path, name: str = "prompts") -> list[dict]:
    return pq.read_table(out / f"{name}.parquet").to_pylist()


def _check_expected(out: Path, source: str) -> None:
    rows = _rows(out)
    assert [r["prompt_id"] for r in rows] == list(EXPECTED)
    for r in rows:
        assert (r["problem"], r["answer"], r["level"], r["subject"], r["sol"]) == EXPECTED[r["prompt_id"]]
        assert r["source"] == source
    assert [r["source_row"] for r in rows] == [0, 1, 2, 3]


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _typed(records: list[dict]) -> list[dict]:
    """The records with one type per column (parquet and Arrow need it): answers and levels as text."""
    return [
        {**r, "gold": str(r["gold"]), "lvl": None if r["lvl"] is None else str(r["lvl"])} for r in records
    ]


def test_normalize_text():
    assert normalize_text("  ＡＢＣ　１２３\t\tx  ") == "ABC 123 x"  # NFKC: full-width letters, digits, space
    assert normalize_text("line one  \r\n\tline two\r\rend") == "line one\nline two\n\nend"
    assert normalize_text("x²") == "x2" and normalize_text("ﬁnd") == "find"


@pytest.mark.parametrize("kind", ["jsonl", "json_list", "json_data", "parquet", "hf_disk", "hf_jsonl"])
def test_formats_with_field_mapping(tmp_path, kind, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    fmt = "auto"
    if kind == "jsonl":
        path = _write_jsonl(tmp_path / "pool.jsonl", RECORDS)
    elif kind == "json_list":
        path = tmp_path / "pool.json"
        path.write_text(json.dumps(RECORDS), encoding="utf-8")
    elif kind == "json_data":
        path = tmp_path / "pool.json"
        path.write_text(json.dumps({"data": RECORDS, "version": 1}), encoding="utf-8")
    elif kind == "parquet":
        path = tmp_path / "pool.parquet"
        pq.write_table(pa.Table.from_pylist(_typed(RECORDS)), path)
    elif kind == "hf_disk":
        path = tmp_path / "pool_ds"
        datasets.Dataset.from_list(_typed(RECORDS)).save_to_disk(str(path))
    else:
        path, fmt = _write_jsonl(tmp_path / "pool.jsonl", _typed(RECORDS)), "hf"
    spec = SourceSpec(name="toy", path=str(path), format=fmt, **SPEC_FIELDS)
    assert (
        resolve_format(spec)
        == {
            "jsonl": "jsonl",
            "json_list": "json",
            "json_data": "json",
            "parquet": "parquet",
            "hf_disk": "hf",
            "hf_jsonl": "hf",
        }[kind]
    )
    counts = ingest([spec], tmp_path / "out")
    assert counts["rows_in"] == counts["ingested"] == 4 == counts["rows_in_toy"]
    _check_expected(tmp_path / "out", "toy")
    schema = pq.read_schema(tmp_path / "out" / "prompts.parquet")
    assert schema.names == [
        "prompt_id",
        "source",
        "source_row",
        "problem",
        "answer",
        "level",
        "subject",
        "text_hash",
        "sol",
    ]
    assert (schema.field("source_row").type, schema.field("level").type) == (pa.int64(), pa.int32())


def test_verl_parquet(tmp_path):
    def row(i, messages, truth):
        return {
            "data_source": "openai/gsm8k",
            "prompt": messages,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": i, "split": "train"},
        }

    rows = [
        row(
            0,
            [
                {"role": "system", "content": "Reason step by step."},
                {"role": "user", "content": "What is 2+3?"},
            ],
            "5",
        ),
        row(
            1,
            [
                {"role": "user", "content": "Ignore me."},
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "Compute  $6\\cdot7$."},
            ],
            "42.0",
        ),
        row(2, [{"role": "system", "content": "No user turn here."}], "1"),
    ]
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    spec = SourceSpec(name="verl", path=str(path), id_field="extra_info.index", extra_fields=("data_source",))
    assert resolve_format(spec) == "verl"  # auto: a parquet with prompt + reward_model columns
    counts = ingest([spec], tmp_path / "out")
    got = [(r["prompt_id"], r["problem"], r["answer"], r["data_source"]) for r in _rows(tmp_path / "out")]
    assert got == [
        ("0", "What is 2+3?", "5", "openai/gsm8k"),
        ("1", "Compute $6\\cdot7$.", "42", "openai/gsm8k"),
    ]
    assert [(q["source_row"], q["reason"]) for q in _rows(tmp_path / "out", "quarantine")] == [
        (2, "missing problem")
    ]
    assert counts["rows_in"] == 3


def test_folder_of_jsonl_files_numbers_rows_across_files(tmp_path):
    folder = tmp_path / "pool"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", RECORDS[:2])
    _write_jsonl(folder / "b.jsonl", RECORDS[2:])
    spec = SourceSpec(name="toy", path=str(folder), **SPEC_FIELDS)
    assert resolve_format(spec) == "jsonl"
    ingest([spec], tmp_path / "out")
    _check_expected(tmp_path / "out", "toy")


def test_derived_ids_quarantine_reasons_and_duplicate_ids(tmp_path):
    lines = [
        json.dumps({"problem": "What is 1+2?", "answer": "3", "id": "a"}),
        json.dumps({"problem": "What is 2+2?", "answer": "4", "id": "b"}),
        json.dumps({"problem": "What is 5+5?", "answer": "10", "id": "a"}),  # id taken by line 0
        json.dumps({"problem": 12, "answer": "3", "id": "c"}),
        json.dumps({"problem": "   ", "answer": "3", "id": "d"}),
        json.dumps({"problem": "What is 3+3?", "answer": None, "id": "e"}),
        json.dumps({"problem": "What is 3+3?", "answer": [6], "id": "f"}),
        json.dumps({"problem": "What is 4+3?", "answer": "7"}),
        json.dumps("just a string"),
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ingest([SourceSpec("s", str(path), id_field="id")], tmp_path / "with_ids")
    reasons = {q["source_row"]: q["reason"] for q in _rows(tmp_path / "with_ids", "quarantine")}
    assert reasons == {
        2: "duplicate id",
        3: "non-string problem",
        4: "empty problem",
        5: "missing answer",
        6: "non-scalar answer",
        7: "missing id",
        8: "not an object (str)",
    }
    assert json.loads(_rows(tmp_path / "with_ids", "quarantine")[0]["raw"])["problem"] == "What is 5+5?"

    ingest([SourceSpec("s", str(path))], tmp_path / "derived")
    rows = _rows(tmp_path / "derived")
    assert rows[0]["prompt_id"] == "s-" + hashlib.sha256(b"What is 1+2?").hexdigest()[:16]
    assert [r["source_row"] for r in rows] == [0, 1, 2, 7]  # no id field: no duplicate or missing ids


def _math_pool_with_plants(path: Path) -> dict:
    """The vendored MATH file as JSON lines, with malformed rows and duplicates appended.
    Returns the line number of each plant."""
    lines = [json.dumps(r).encode() for r in MATH]
    plants: dict[str, int] = {}

    def plant(name: str, line: bytes) -> None:
        plants[name] = len(lines)
        lines.append(line)

    plant("bad_json", b'{"problem": "What is 1+1?", "answer": "2"')
    plant("missing_problem", json.dumps({"answer": "3", "type": "Algebra"}).encode())
    plant("empty_answer", json.dumps({"problem": "Compute $2+2$.", "answer": "  "}).encode())
    plant("undecodable", b'{"problem": "caf\xe9 \xff costs?", "answer": "1"}')
    lines.append(b"")  # a blank line is skipped but still numbered
    plant("exact", json.dumps({**MATH[10], "difficulty": 9.0}).encode())
    shouted = re.sub(r" ", "   ", MATH[20]["problem"]).upper().replace(".", ".\n")
    plant("exact_ws_case", json.dumps({**MATH[20], "problem": shouted}).encode())
    two_words = MATH[9]["problem"].replace("invest", "deposit").replace("nearest", "closest")
    plant("near_two_words", json.dumps({**MATH[9], "problem": two_words}).encode())
    three_words = (
        MATH[18]["problem"]
        .replace("Find $a$", "Determine $a$")
        .replace("lifting your pencil", "raising your pen")
    )
    plant("near_three_words", json.dumps({**MATH[18], "problem": three_words}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert MATH[9]["problem"] != two_words and MATH[18]["problem"] != three_words
    return plants


def _math_id(i: int) -> str:
    return "math-" + hashlib.sha256(normalize_text(MATH[i]["problem"]).encode()).hexdigest()[:16]


def test_planted_malformed_rows_and_duplicates_in_a_real_pool(tmp_path):
    plants = _math_pool_with_plants(tmp_path / "math.jsonl")
    spec = SourceSpec("math", str(tmp_path / "math.jsonl"), level_field="difficulty", subject_field="type")
    t0 = time.perf_counter()
    counts = ingest([spec], tmp_path / "out")
    print(f"ingest of {counts['rows_in']:.0f} rows: {time.perf_counter() - t0:.2f} s")

    quarantine = {q["source_row"]: q for q in _rows(tmp_path / "out", "quarantine")}
    assert quarantine[plants["bad_json"]]["reason"].startswith("bad json: ")
    assert quarantine[plants["bad_json"]]["raw"] == '{"problem": "What is 1+1?", "answer": "2"'
    assert quarantine[plants["missing_problem"]]["reason"] == "missing problem"
    assert quarantine[plants["empty_answer"]]["reason"] == "empty answer"
    assert quarantine[plants["undecodable"]]["reason"] == "undecodable bytes"
    assert "\ufffd" in quarantine[plants["undecodable"]]["raw"]

    dups = {d["source_row"]: d for d in _rows(tmp_path / "out", "duplicates")}
    for name, original, kind in [
        ("exact", 10, "exact"),
        ("exact_ws_case", 20, "exact"),
        ("near_two_words", 9, "near"),
        ("near_three_words", 18, "near"),
    ]:
        d = dups[plants[name]]
        assert (d["kind"], d["canonical_id"]) == (kind, _math_id(original)), name
        assert d["similarity"] == 1.0 if kind == "exact" else 0.85 <= d["similarity"] < 1.0
    prompts = _rows(tmp_path / "out")
    assert {r["source_row"] for r in prompts}.isdisjoint(plants.values())
    assert len({r["prompt_id"] for r in prompts}) == len(prompts) == len({r["text_hash"] for r in prompts})
    assert counts["rows_in"] == len(MATH) + len(plants)
    assert counts["rows_in"] == (
        counts["ingested"] + counts["quarantined"] + counts["duplicates_exact"] + counts["duplicates_near"]
    )
    assert (counts["quarantined"], counts["duplicates_exact"], counts["duplicates_near"]) == (
        4 + 4,
        2 + 2,
        6 + 2,
    )


def test_vendored_math_file(tmp_path):
    readme = (MATH_FILE.parent / "README.md").read_text(encoding="utf-8")
    digest = re.search(r"^([0-9a-f]{64})  math_train\.json$", readme, re.M).group(1)
    assert hashlib.sha256(MATH_FILE.read_bytes()).hexdigest() == digest
    assert len(MATH) == 7474

    spec = SourceSpec("math_train", str(MATH_FILE), level_field="difficulty", subject_field="type")
    counts = ingest([spec], tmp_path / "out")
    # 4 rows without an answer; 2 exact and 6 near duplicates (the same answer, reworded)
    assert counts == {
        "rows_in": 7474.0,
        "ingested": 7462.0,
        "quarantined": 4.0,
        "duplicates_exact": 2.0,
        "duplicates_near": 6.0,
        "rows_in_math_train": 7474.0,
        "ingested_math_train": 7462.0,
    }
    assert {q["source_row"]: q["reason"] for q in _rows(tmp_path / "out", "quarantine")} == {
        886: "missing answer",
        1009: "missing answer",
        5328: "empty answer",
        5330: "empty answer",
    }
    first = _rows(tmp_path / "out")[0]
    assert (first["answer"], first["level"], first["subject"]) == ("0", 5, "Algebra")

    # Without the same-answer rule, siblings ("sum" vs "product" of the roots) count as near duplicates too.
    loose = ingest([spec], tmp_path / "loose", near_dup_same_answer=False)
    assert loose["duplicates_near"] > 40


def test_arithmetic_pool_survives_with_its_ids(tmp_path):
    from data_curation.synthetic import write_dataset

    write_dataset(
        tmp_path, seed=0, pool_size=3000, heldout_size=300, levels=[1, 2, 3, 4, 5], demo_error_rate=0.15
    )
    arith = dict(id_field="prompt_id", level_field="level", extra_fields=("solution", "demonstration"))
    sources = [
        SourceSpec("arith", str(tmp_path / "pool.parquet"), **arith),
        SourceSpec("heldout", str(tmp_path / "heldout.parquet"), **arith),
    ]
    counts = ingest(sources, tmp_path / "out")
    assert counts["ingested"] == counts["rows_in"] == 3300 and counts["duplicates_near"] == 0
    pool = pq.read_table(tmp_path / "pool.parquet").to_pylist()
    got = [r for r in _rows(tmp_path / "out") if r["source"] == "arith"]
    for key in ("prompt_id", "problem", "answer", "level", "solution", "demonstration"):
        assert [r[key] for r in got] == [p[key] for p in pool], key


def test_exact_duplicates_across_sources_keep_the_first_source(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"problem": "Find  the sum of 2 and 3.", "answer": "5"}])
    b = _write_jsonl(
        tmp_path / "b.jsonl",
        [
            {"problem": "Evaluate 9-1.", "answer": "8"},
            {"problem": "find the SUM of 2 and\n3.", "answer": "5.0"},
        ],
    )
    counts = ingest([SourceSpec("a", str(a)), SourceSpec("b", str(b))], tmp_path / "out")
    assert [(r["source"], r["source_row"]) for r in _rows(tmp_path / "out")] == [("a", 0), ("b", 0)]
    (dup,) = _rows(tmp_path / "out", "duplicates")
    assert (dup["source"], dup["source_row"], dup["kind"], dup["similarity"]) == ("b", 1, "exact", 1.0)
    assert dup["canonical_id"] == _rows(tmp_path / "out")[0]["prompt_id"]
    assert counts["rows_in_a"] == 1 and counts["rows_in_b"] == 2 and counts["ingested_b"] == 1


def test_deterministic_outputs(tmp_path):
    _math_pool_with_plants(tmp_path / "math.jsonl")
    spec = SourceSpec("math", str(tmp_path / "math.jsonl"))
    ingest([spec], tmp_path / "one")
    ingest([spec], tmp_path / "two", seed=0)
    for name in ("prompts", "quarantine", "duplicates"):
        one, two = (tmp_path / out / f"{name}.parquet" for out in ("one", "two"))
        assert one.read_bytes() == two.read_bytes(), name


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="format="):
        SourceSpec("x", "a.jsonl", format="csv")
    with pytest.raises(ValueError, match="clash"):
        SourceSpec("x", "a.jsonl", extra_fields=("answer",))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"problem": "x", "answer": 1},', encoding="utf-8")
    with pytest.raises(ValueError, match="format='jsonl'"):
        read_source(SourceSpec("x", str(bad)))
    other = tmp_path / "pool.txt"
    other.write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="set format"):
        ingest([SourceSpec("x", str(other))], tmp_path / "out")
    good = _write_jsonl(tmp_path / "good.jsonl", RECORDS)
    with pytest.raises(ValueError, match="unique"):
        ingest([SourceSpec("x", str(good)), SourceSpec("x", str(good))], tmp_path / "out")
