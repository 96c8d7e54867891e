"""Instruction wrappers shared by a source's rows are taken out at ingest and kept as its template."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_curation.decontaminate import decontaminate
from data_curation.ingest import SourceSpec, ingest, normalize_text
from data_curation.templates import detect_template, strip_template
from evaluation.benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
MATH_FILE = ROOT / "data_curation" / "data" / "math_train.json"
DAPO = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n",
    '\n\nRemember to put your answer on its own line after "Answer:".',
)
VERL_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."


@pytest.fixture(scope="module")
def math_rows() -> list[dict]:
    return json.loads(MATH_FILE.read_text())[:400]


def test_no_wrapper_no_template(math_rows):
    problems = [normalize_text(r["problem"]) for r in math_rows]
    assert detect_template(problems) is None
    assert detect_template(["What is 1+2?"] * 3 + ["What is 2+3?"] * 20) is None  # "What is " is no wrapper
    assert detect_template([DAPO[0] + p for p in problems[:7]]) is None  # too few rows to tell


def test_prefix_suffix_and_minority_rows(math_rows):
    problems = [normalize_text(r["problem"]) for r in math_rows]
    wrapped = [normalize_text(DAPO[0] + p + DAPO[1]) for p in problems[:380]] + problems[380:]  # 95% wrapped
    t = detect_template(wrapped)
    assert (
        t is not None
        and t.prefix == normalize_text(DAPO[0] + "x")[:-1]
        and t.suffix.strip() == DAPO[1].strip()
    )
    assert (
        t.rows == 400
        and t.matched == 380
        and t.text.startswith("Solve the following")
        and "{problem}" in t.text
    )
    assert [strip_template(w, t) for w in wrapped] == problems  # bare problems; the unwrapped 5% unchanged
    assert detect_template(wrapped, min_share=0.97) is None

    suffixed = [normalize_text(p + VERL_SUFFIX) for p in problems]
    t = detect_template(suffixed)
    assert t.prefix == "" and t.suffix == VERL_SUFFIX and [strip_template(s, t) for s in suffixed] == problems
    # a shared first word of the problems themselves is never taken with the wrapper
    lets = [normalize_text("Answer the question below: Let " + p) for p in problems]
    t = detect_template(lets)
    assert t.prefix == "Answer the question below: " and strip_template(lets[0], t) == "Let " + problems[0]
    assert (
        detect_template([normalize_text("Question: " + p) for p in problems]) is None
    )  # under 16 characters


def _verl(path: Path, rows: list[dict], wrap: tuple[str, str]) -> Path:
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "data_source": "math",
                    "prompt": [{"role": "user", "content": wrap[0] + r["problem"] + wrap[1]}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(r["answer"])},
                }
                for r in rows
            ]
        ),
        path,
    )
    return path


def test_verl_pool_with_wrapper_curates_like_the_bare_pool(tmp_path, math_rows):
    """Same prompts, same duplicates, same contamination, with or without the pool's wrapper."""
    gsm8k, math500 = load_benchmark("gsm8k"), load_benchmark("math500")
    rows = list(math_rows[:300])
    rows += [dict(math_rows[i]) for i in (3, 10, 50)]  # exact duplicates
    rows += [
        {"problem": math_rows[i]["problem"].replace("Find", "Determine", 1), "answer": math_rows[i]["answer"]}
        for i in range(60, 200)
        if "Find" in math_rows[i]["problem"]
    ][:3]  # near duplicates
    rows += [{"problem": it.problem, "answer": it.answer} for it in gsm8k[:4] + math500[:3]]  # contaminated
    rows += [
        {"problem": "What is $1+1$? Give your answer as an integer.", "answer": "2"},
        {"problem": "What is $5-3$? Give your answer as an integer.", "answer": "2"},
    ]  # short, same answer
    items = gsm8k + math500
    out = {}
    for name, wrap in (("bare", ("", "")), ("wrapped", DAPO)):
        src = _verl(tmp_path / f"{name}.parquet", rows, wrap)
        counts = ingest([SourceSpec("pool", str(src))], tmp_path / name)
        dec = decontaminate(tmp_path / name / "prompts.parquet", items, tmp_path / f"{name}_dec")
        out[name] = (
            counts,
            dec,
            *(
                pq.read_table(tmp_path / name / f"{t}.parquet")
                for t in ("prompts", "duplicates", "templates")
            ),
            pq.read_table(tmp_path / f"{name}_dec" / "contamination.parquet"),
        )
    bare, wrapped = out["bare"], out["wrapped"]
    assert wrapped[0]["templated_sources"] == 1 and wrapped[0]["template_stripped"] == len(rows)
    assert {k: v for k, v in wrapped[0].items() if not k.startswith("templ")} == bare[0]
    assert bare[0]["duplicates_exact"] == 3 and bare[0]["duplicates_near"] == 3
    assert wrapped[1] == bare[1] and bare[1]["contaminated"] == 7
    for i in (2, 3, 5):  # prompts (ids derived from the bare text), duplicates, contamination
        assert wrapped[i].equals(bare[i]), i
    assert bare[4].num_rows == 0
    tpl = wrapped[4].to_pylist()
    assert tpl == [
        {
            "source": "pool",
            "template": normalize_text(DAPO[0] + "{problem}" + DAPO[1]),
            "prefix": normalize_text(DAPO[0] + "x")[:-1],
            "suffix": "\n\n" + DAPO[1].strip(),
            "rows": len(rows),
            "matched": len(rows),
        }
    ]

    # kept in, the wrapper is what near dedup compares: the two short problems (Jaccard 0.57 bare,
    # 0.74 wrapped) become "duplicates" at a 0.7 threshold
    src = [SourceSpec("pool", str(tmp_path / "wrapped.parquet"))]
    stripped = ingest(src, tmp_path / "stripped07", near_dup_threshold=0.7)
    kept = ingest(src, tmp_path / "kept07", near_dup_threshold=0.7, template_share=None)
    assert kept["duplicates_near"] > stripped["duplicates_near"] and "templated_sources" not in kept
