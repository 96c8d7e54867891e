"""Every input is bounded: ingest quarantines what it cannot take, with a reason, instead of crashing;
a file it cannot read at all fails with one line naming the file; the verifier gives a verdict for
every item. Issue 26, case 3: a 10 MB prompt was ingested (and every batch padded to it), a level of
99999999999 or of 400 digits crashed ingest, a random-bytes .parquet crashed it without naming the
file, and a 2-million-digit answer raised ``decimal.Overflow`` out of the verifier's fast path."""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conf.schema import DataConfig
from core.errors import StageError
from data_curation.ingest import SourceError, SourceSpec, ingest, normalize_text
from rewards.verifier import Verifier

ROOT = Path(__file__).resolve().parents[2]
LIMIT = DataConfig().max_prompt_chars


def write_jsonl(path: Path, rows: list, extra_lines: tuple[str, ...] = ()) -> Path:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def quarantine(out: Path) -> dict[int, str]:
    return {r["source_row"]: r["reason"] for r in pq.read_table(out / "quarantine.parquet").to_pylist()}


def test_a_10mb_prompt_is_quarantined_not_ingested(tmp_path):
    rows = [
        {"problem": "x" * 10_000_000, "answer": "1"},  # 10 MB
        {"problem": "y" * LIMIT, "answer": "2"},  # exactly at the limit: kept
        {"problem": "z" * (LIMIT + 1), "answer": "3"},
        {"problem": "What is 1+1?", "answer": "2"},
    ]
    m = ingest([SourceSpec("big", str(write_jsonl(tmp_path / "big.jsonl", rows)))], tmp_path / "out")
    reasons = quarantine(tmp_path / "out")
    assert reasons == {
        0: f"problem too long (10,000,000 characters > data.max_prompt_chars={LIMIT:,})",
        2: f"problem too long ({LIMIT + 1:,} characters > data.max_prompt_chars={LIMIT:,})",
    }
    assert (m["ingested"], m["quarantined"]) == (2.0, 2.0)
    kept = pq.read_table(tmp_path / "out" / "prompts.parquet").column("problem").to_pylist()
    assert max(len(p) for p in kept) == LIMIT
    # the limit is the caller's (data.max_prompt_chars)
    m = ingest([SourceSpec("big", str(tmp_path / "big.jsonl"))], tmp_path / "out2", max_prompt_chars=12)
    assert m["ingested"] == 1.0 and quarantine(tmp_path / "out2")[1].endswith("data.max_prompt_chars=12)")


def test_the_default_limit_keeps_every_vendored_prompt_and_the_synthetic_task():
    """The longest real prompt (MATH train, 4,308 characters after normalisation) is far below it."""
    from data_curation.synthetic import generate

    longest = {}
    data = json.loads((ROOT / "data_curation" / "data" / "math_train.json").read_text())
    longest["math_train"] = max(
        len(normalize_text(r["problem"])) for r in data if isinstance(r.get("problem"), str)
    )
    for path in sorted((ROOT / "evaluation" / "data").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        longest[path.stem] = max(len(normalize_text(r.get("problem") or r.get("question"))) for r in rows)
    pool, heldout = generate(0, 2000, 100, list(range(1, 9)), 0.15)
    longest["synthetic"] = max(len(p.problem) for p in pool + heldout)
    assert longest["math_train"] == 4308 and max(longest.values()) == 4308, longest
    assert max(longest.values()) * 3 < LIMIT


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_levels_out_of_range_are_quarantined_with_a_reason(tmp_path, fmt):
    levels = [3, 99999999999, -(2**40), 2**31 - 1]
    if fmt == "jsonl":  # JSON can hold what parquet's int64 cannot: 400-digit integers, infinities
        levels += ["Level 4", int("9" * 400), "Level " + "9" * 400, float("inf"), 1e300]
    else:
        levels += [4]
    rows = [{"problem": f"problem {i}", "answer": str(i), "level": lv} for i, lv in enumerate(levels)]
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "p.jsonl", rows)
    else:
        path = tmp_path / "p.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        assert pq.read_schema(path).field("level").type == pa.int64()
    m = ingest([SourceSpec("lv", str(path), level_field="level")], tmp_path / "out")
    reasons = quarantine(tmp_path / "out")
    bad = {1, 2} | ({5, 6, 7, 8} if fmt == "jsonl" else set())
    assert set(reasons) == bad, reasons
    assert all(
        r.startswith("level out of range (") and "-2147483648..2147483647" in r for r in reasons.values()
    )
    assert "99999999999;" in reasons[1]
    if fmt == "jsonl":
        assert "(400 characters)" in reasons[5] and len(reasons[5]) < 200  # the value is shown cut short
    kept = pq.read_table(tmp_path / "out" / "prompts.parquet").to_pylist()
    assert sorted(r["level"] for r in kept) == [3, 4, 2**31 - 1]
    assert m["rows_in"] == m["ingested"] + m["quarantined"]


def test_json_that_python_cannot_parse_is_quarantined_per_row(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"problem": "fine", "answer": "1"}],
        extra_lines=(
            '{"problem": "deep", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}",
            '{"problem": "a huge answer", "answer": ' + "9" * 5000 + "}",
        ),
    )
    m = ingest([SourceSpec("j", str(path))], tmp_path / "out")
    reasons = quarantine(tmp_path / "out")
    assert reasons[1].startswith("bad json: RecursionError") and reasons[2].startswith("bad json: ValueError")
    assert m["ingested"] == 1.0


def _assert_one_line_naming(err: BaseException, file: Path, *fragments: str) -> None:
    text = str(err)
    assert "\n" not in text and str(file) in text, text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert isinstance(err, StageError) and isinstance(err, ValueError)
    chain = "".join(traceback.format_exception(err))
    assert "During handling" not in chain and "direct cause" not in chain  # one traceback, not three


@pytest.mark.parametrize("layout", ["file_auto", "file_parquet", "folder"])
def test_a_random_bytes_parquet_fails_with_one_line_naming_the_file(tmp_path, layout):
    bad = tmp_path / "data" / "b_corrupt.parquet"
    bad.parent.mkdir()
    bad.write_bytes(os.urandom(4096))
    spec = SourceSpec("pool", str(bad))
    if layout == "file_parquet":
        spec = SourceSpec("pool", str(bad), format="parquet")
    elif layout == "folder":  # a good file first: the bad one is found while reading, not while sniffing
        pq.write_table(
            pa.Table.from_pylist([{"problem": "p", "answer": "1"}]), tmp_path / "data" / "a_good.parquet"
        )
        spec = SourceSpec("pool", str(tmp_path / "data"))
    with pytest.raises(SourceError) as err:
        ingest([spec], tmp_path / "out")
    _assert_one_line_naming(
        err.value, bad, "source 'pool'", "cannot read", "as parquet", "Parquet magic bytes not found"
    )


def test_a_random_bytes_json_document_fails_with_one_line(tmp_path):
    bad = tmp_path / "pool.json"
    bad.write_bytes(b"\xff\xfe" + os.urandom(2048))
    with pytest.raises(SourceError) as err:
        ingest([SourceSpec("pool", str(bad))], tmp_path / "out")
    _assert_one_line_naming(err.value, bad, "source 'pool'", "is not a UTF-8 JSON document")


def test_a_2_million_digit_answer_gets_a_verdict_not_an_overflow():
    huge = "1" * 2_000_000
    with Verifier() as v:  # the fast path decides all of these: no worker pool starts
        verdicts = v.verify_batch(
            [f"#### {huge}", f"#### {huge}.5", f"#### {huge}.5", f"#### {huge}"],
            ["1.5", f"{huge}.5000000000001", f"2{huge[1:]}.5", huge],
        )
        assert [(x.correct, x.error) for x in verdicts] == [
            (False, None),
            (True, None),
            (False, None),
            (True, None),
        ]
        # a gold Python cannot even print (an int past its 4,300-digit str() limit): a verdict with a reason
        big_int = v.verify("#### 7", 10**5000)
        assert big_int.correct is False and big_int.error.startswith("error: ValueError")
        assert v._pool is None
