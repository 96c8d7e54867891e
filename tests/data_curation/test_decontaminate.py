"""Decontamination: planted benchmark items are caught and attributed; clean pools lose nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_curation.decontaminate import decontaminate
from data_curation.ingest import SourceSpec, ingest
from data_curation.synthetic import write_dataset
from evaluation.benchmarks import BENCHMARKS, BenchmarkItem, items_from_records, load_benchmark

ROOT = Path(__file__).resolve().parents[2]
MATH_FILE = ROOT / "data_curation" / "data" / "math_train.json"
ARITH = dict(id_field="prompt_id", level_field="level", extra_fields=("solution", "demonstration"))


def _edit_middle_word(text: str) -> str:
    words = text.split(" ")
    i = next(i for i in range(len(words) // 2, len(words)) if words[i].isalpha() and len(words[i]) > 3)
    words[i] = "quite" + words[i]
    return " ".join(words)


@pytest.fixture(scope="module")
def arith(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("arith")
    write_dataset(
        folder, seed=0, pool_size=3000, heldout_size=300, levels=[1, 2, 3, 4, 5], demo_error_rate=0.15
    )
    return folder


@pytest.fixture(scope="module")
def heldout(arith) -> list[BenchmarkItem]:
    return items_from_records(
        "arith_heldout", pq.read_table(arith / "heldout.parquet").to_pylist(), id_key="prompt_id"
    )


def test_planted_benchmark_items_are_caught_and_attributed(tmp_path, arith, heldout):
    gsm8k, math500 = load_benchmark("gsm8k"), load_benchmark("math500")
    long_math500 = [it for it in math500 if len(it.problem.split()) >= 50 and "[asy]" not in it.problem][:3]
    planted = (  # (record, the benchmark item it copies)
        [({"problem": it.problem, "answer": it.answer}, it) for it in gsm8k[100:105]]
        + [({"problem": _edit_middle_word(it.problem), "answer": it.answer}, it) for it in long_math500]
        + [({"problem": it.problem, "answer": it.answer}, it) for it in heldout[:2]]
    )
    assert all(rec["problem"] != it.problem for rec, it in planted[5:8])
    plants = tmp_path / "plants.jsonl"
    plants.write_text("".join(json.dumps(rec) + "\n" for rec, _ in planted), encoding="utf-8")
    sources = [
        SourceSpec("arith", str(arith / "pool.parquet"), **ARITH),
        SourceSpec("math_train", str(MATH_FILE), level_field="difficulty", subject_field="type"),
        SourceSpec("plants", str(plants)),
    ]
    ingested = ingest(sources, tmp_path / "ingest")
    assert ingested["ingested_plants"] == 10

    items = [it for name in BENCHMARKS for it in load_benchmark(name)] + heldout
    counts = decontaminate(tmp_path / "ingest" / "prompts.parquet", items, tmp_path / "out")

    hits = pq.read_table(tmp_path / "out" / "contamination.parquet").to_pylist()
    by_plant = {h["prompt_id"]: h for h in hits if h["source"] == "plants"}
    plant_ids = [
        r["prompt_id"]
        for r in pq.read_table(tmp_path / "ingest" / "prompts.parquet").to_pylist()
        if r["source"] == "plants"
    ]
    assert len(by_plant) == 10 == len([h for h in hits if h["source"] == "plants"])  # one item each
    for pid, (_, item) in zip(plant_ids, planted):
        hit = by_plant[pid]
        assert (hit["benchmark"], hit["benchmark_problem_id"]) == (item.benchmark, item.problem_id)
        assert hit["overlap"] >= 1 and hit["matched"]
    assert by_plant[plant_ids[8]]["matched"] == " ".join(["what", "is", *heldout[0].problem[8:-1], "?"])

    assert all(h["rule"] == "ngram" and h["score"] == h["coverage"] for h in by_plant.values())

    # Nothing from the arithmetic pool; from MATH train only siblings of MATH-500 items (same figure,
    # setup or template, another question: 27 of them by the n-gram rule, see decontaminate.py), and
    # two by the paraphrase rule: a template sibling and a short item with the same answer.
    assert not [h for h in hits if h["source"] == "arith"]
    math_hits = [h for h in hits if h["source"] == "math_train"]
    ngram_hits = [h for h in math_hits if h["rule"] == "ngram"]
    assert {h["benchmark"] for h in math_hits} == {"math500"} and all(
        h["coverage"] >= 0.7 for h in ngram_hits
    )
    assert len({h["prompt_id"] for h in ngram_hits}) == 27
    para = sorted((h["benchmark_problem_id"], h["rule"]) for h in math_hits if h["rule"] != "ngram")
    assert para == [
        ("test/intermediate_algebra/279.json", "paraphrase+answer"),
        ("test/prealgebra/1458.json", "paraphrase+answer"),
    ]
    assert all(
        0.6 <= h["score"] < 0.92 and h["coverage"] is None and h["matched"] is None
        for h in math_hits
        if h["rule"] != "ngram"
    )
    assert counts["contaminated_gsm8k"] == 5 and counts["contaminated_arith_heldout"] == 2
    assert counts["contaminated_math500"] == 3 + 27 + 2
    assert counts["contaminated_aime24"] == counts["contaminated_aime25"] == counts["contaminated_amc23"] == 0
    assert counts["contaminated"] == 10 + 29 and counts["clean"] == counts["prompts_in"] - 39
    assert counts["contaminated_ngram"] == 37 and counts["contaminated_paraphrase"] == 2

    kept = pq.read_table(tmp_path / "out" / "prompts.parquet")
    source = pq.read_table(tmp_path / "ingest" / "prompts.parquet")
    assert kept.schema == source.schema
    dirty = {h["prompt_id"] for h in hits}
    assert kept["prompt_id"].to_pylist() == [p for p in source["prompt_id"].to_pylist() if p not in dirty]


def test_clean_pools_lose_nothing(tmp_path, arith, heldout):
    ingest([SourceSpec("arith", str(arith / "pool.parquet"), **ARITH)], tmp_path / "arith")
    items = [it for name in BENCHMARKS for it in load_benchmark(name)] + heldout
    counts = decontaminate(tmp_path / "arith" / "prompts.parquet", items, tmp_path / "arith_out")
    assert counts["contaminated"] == 0 and counts["clean"] == counts["prompts_in"] == 3000
    assert set(counts) == {
        "prompts_in",
        "clean",
        "contaminated",
        "contaminated_arith_heldout",
        "contaminated_ngram",
        "contaminated_paraphrase",
        *(f"contaminated_{name}" for name in BENCHMARKS),
    }
    assert (tmp_path / "arith_out" / "prompts.parquet").read_bytes() != b""
    assert pq.read_table(tmp_path / "arith_out" / "prompts.parquet").equals(
        pq.read_table(tmp_path / "arith" / "prompts.parquet")
    )

    ingest([SourceSpec("math_train", str(MATH_FILE))], tmp_path / "math")
    others = [it for name in ("gsm8k", "aime24", "aime25", "amc23") for it in load_benchmark(name)]
    counts = decontaminate(tmp_path / "math" / "prompts.parquet", others, tmp_path / "math_out")
    assert counts["contaminated"] == 0 and counts["prompts_in"] == 7462
    assert pq.read_table(tmp_path / "math_out" / "contamination.parquet").num_rows == 0


def _pool(path: Path, problems: list[str]) -> Path:
    pq.write_table(
        pa.table(
            {
                "prompt_id": [f"p{i}" for i in range(len(problems))],
                "source": ["t"] * len(problems),
                "problem": problems,
            }
        ),
        path,
    )
    return path


def _bench(problems: list[str]) -> list[BenchmarkItem]:
    return [BenchmarkItem("toy", f"b{i}", p, "1") for i, p in enumerate(problems)]


def test_short_texts_match_whole_not_by_sub_grams(tmp_path):
    pool = _pool(
        tmp_path / "p.parquet",
        ["What is 3+4-2?", "what  is 3 + 4 - 2 ?", "What is 3+4-2+1?", "Compute: what is 3+4-2? Explain."],
    )
    decontaminate(pool, _bench(["What is 3+4-2?"]), tmp_path / "out")
    hits = pq.read_table(tmp_path / "out" / "contamination.parquet").to_pylist()
    assert [(h["prompt_id"], h["matched"], h["overlap"], h["coverage"]) for h in hits] == [
        ("p0", "what is 3 + 4 - 2 ?", 1, 1.0),
        ("p1", "what is 3 + 4 - 2 ?", 1, 1.0),
    ]


def test_coverage_threshold(tmp_path):
    item = (
        "Tim wants to invest some money in a bank which compounds quarterly with an annual interest rate of "
        "seven percent. To the nearest dollar, how much money should he invest if he wants a total of sixty "
        "thousand dollars at the end of five years?"
    )
    boilerplate = (
        "To the nearest dollar, how much money should he invest if he wants a total of sixty thousand?"
    )
    pool = _pool(tmp_path / "p.parquet", [item.upper(), boilerplate, item.replace("quarterly", "monthly")])
    counts = decontaminate(pool, _bench([item]), tmp_path / "out")
    hits = {h["prompt_id"]: h for h in pq.read_table(tmp_path / "out" / "contamination.parquet").to_pylist()}
    assert (
        set(hits) == {"p0", "p2"} and counts["contaminated_toy"] == 2
    )  # one 13-gram in common is not enough
    assert hits["p0"]["coverage"] == 1.0 and 0.7 < hits["p2"]["coverage"] < 0.8  # the edit is token 11 of 45
    counts = decontaminate(pool, _bench([item]), tmp_path / "any", min_coverage=0.2)
    assert counts["contaminated"] == 3


def test_deterministic_and_evaluation_items_untouched(tmp_path, arith, heldout):
    gsm8k = load_benchmark("gsm8k")
    problems = [it.problem for it in gsm8k[:3]] + pq.read_table(arith / "pool.parquet")[
        "problem"
    ].to_pylist()[:50]
    pool = _pool(tmp_path / "p.parquet", problems)
    before = list(gsm8k)
    for out in ("one", "two"):
        decontaminate(pool, gsm8k + heldout, tmp_path / out)
    for name in ("prompts", "contamination"):
        one, two = (tmp_path / out / f"{name}.parquet" for out in ("one", "two"))
        assert one.read_bytes() == two.read_bytes(), name
    assert gsm8k == before == load_benchmark("gsm8k")
    assert pq.read_table(tmp_path / "one" / "prompts.parquet").num_rows == 50


# --------------------------------------------------------------------------- paraphrase rule


def test_paraphrase_text_strips_style_figures_and_instructions():
    from data_curation.decontaminate import paraphrase_text

    def same(text: str) -> str:  # spacing is not compared (shingles are tokens)
        return "".join(paraphrase_text(text).split())

    base = same("If $x = 3$, find the area of $ABC$ in square units. [asy]draw((0,0)--(3,4));[/asy]")
    assert base == "v=3,findareaabcsquareunits."
    # renamed and restyled symbols, number words, style macros and solver instructions normalise away
    assert (
        same(
            "Solve the following math problem step by step.\n\nIf $\\mathit{y}=three$, find the "
            "area of $ABC$ in square units. Put your final answer within \\boxed{}."
        )
        == base
    )
    assert same("Question: If $\\mathcal{T} = \\text{3}$, find the area of $ABC$ in square units.") == base
    assert same("If $x=\\dfrac{1}{2}$, find $\\left(y\\right)$.") == same("If $z=\\frac{1}{2}$, find $(t)$.")
    assert same("twenty-five apples") == same("25 apples") != same("26 apples")


def _rewrite(item: BenchmarkItem) -> str:
    """A paraphrase: symbols renamed and restyled, figure code dropped, numbers in words, a wrapper."""
    import re

    text = re.sub(r"\[asy\].*?\[/asy\]", "", item.problem, flags=re.S)
    text = re.sub(r"(?<![A-Za-z\\])x(?![A-Za-z])", r"\\mathit{t}", text)
    text = re.sub(
        r"(?<![\d.$^{])\b([2-9])\b(?![\d.])",
        lambda m: ["two", "three", "four", "five", "six", "seven", "eight", "nine"][int(m.group(1)) - 2],
        text,
    )
    return (
        "Solve the following math problem step by step.\n\n" + text + "\n\nPut the final answer in \\boxed{}."
    )


def test_paraphrase_rule_catches_rewrites_the_ngram_rule_misses(tmp_path):

    math500 = load_benchmark("math500")
    chosen = [it for it in math500 if "[asy]" in it.problem and 15 <= len(it.problem.split()) < 200][:4] + [
        it for it in math500 if "$x" in it.problem and "[asy]" not in it.problem and len(it.problem) > 150
    ][:4]
    rewritten = [_rewrite(it) for it in chosen]
    assert all(r != it.problem for r, it in zip(rewritten, chosen))
    sibling = (
        "Determine the number of ways to arrange the letters of the word BANANA.",
        "60",
    )  # MATH-500's ELLIPSE
    pq.write_table(
        pa.table(
            {
                "prompt_id": [f"r{i}" for i in range(len(chosen))] + ["sib"],
                "source": ["t"] * (len(chosen) + 1),
                "problem": rewritten + [sibling[0]],
                "answer": [it.answer for it in chosen] + [sibling[1]],
            }
        ),
        tmp_path / "p.parquet",
    )

    off = decontaminate(tmp_path / "p.parquet", math500, tmp_path / "off", paraphrase=None)
    assert off["contaminated"] < len(chosen)  # the 13-gram rule alone misses most of these

    counts = decontaminate(
        tmp_path / "p.parquet", math500, tmp_path / "on", benchmark_hashes={"math500": "abc"}
    )
    hits = pq.read_table(tmp_path / "on" / "contamination.parquet").to_pylist()
    by = {h["prompt_id"]: h for h in hits}
    assert set(by) == {f"r{i}" for i in range(len(chosen))}  # every rewrite, and not the sibling
    for i, it in enumerate(chosen):
        h = by[f"r{i}"]
        assert (h["benchmark"], h["benchmark_problem_id"]) == ("math500", it.problem_id)
        assert h["rule"] in ("ngram", "paraphrase", "paraphrase+answer") and 0 < h["score"] <= 1
        if h["rule"] != "ngram":
            assert h["coverage"] is None and h["overlap"] > 0 and h["score"] >= 0.6
    assert counts["contaminated_paraphrase"] == len(chosen) - off["contaminated"]
    cert = json.loads((tmp_path / "on" / "certificate.json").read_text())
    assert cert["benchmarks"]["math500"] == {"sha256": "abc", "items": 500, "removed": len(chosen)}
    assert cert["rules"][0] == "ngram(n=13, min_coverage=0.7)" and cert["rules"][1].startswith("paraphrase(")


def test_paraphrase_rule_leaves_bare_expressions_and_rejects_bad_thresholds(tmp_path):
    from data_curation.decontaminate import ParaphraseParams

    pool = _pool(tmp_path / "p.parquet", ["What is 2+6+4?", "What is 5+7-9?"])
    counts = decontaminate(pool, _bench(["What is 0+2+6+4?", "What is 3+6-4+7-9?"]), tmp_path / "out")
    assert counts["contaminated"] == 0  # symbol siblings without words are the n-gram rule's to judge
    with pytest.raises(ValueError, match="moderate"):
        decontaminate(
            pool, _bench(["x"]), tmp_path / "bad", paraphrase=ParaphraseParams(high=0.5, moderate=0.7)
        )
