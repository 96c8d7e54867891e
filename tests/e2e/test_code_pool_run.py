"""A code pool trains end to end with ``code_tests`` as its verdict, through the real CLI.

The pool mixes problems whose tests every program passes (``assert True``) with problems no response
of the tiny model can pass (a function it never writes). Judged by the code tests, the first kind is
solved every time and the second never; judged by the math verifier (a response against the JSON of
the tests), nothing is ever solved. So each count below fails if the math verifier judges code again:
difficulty's pass rates (which steer DART and HIVE), the RL steps' accuracy and the evaluation of a
code benchmark file.
"""

from __future__ import annotations

import json

import pytest

from tests.configs import TINY_CURATED
from tests.evaluation.test_eval_cli import laminar, query

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EASY = ["assert True"]
HARD = ["assert solve_it(3) == 9", "assert solve_it(0) == 0"]
BENCH_EASY = ["assert 1 + 1 == 2"]
BENCH_HARD = ["assert find_max([4, 1]) == 4"]
"""The benchmark's tests differ from the pool's (decontamination compares answers too)."""


WORDS = (
    "apple river stone cloud maple tiger violet ocean pencil garden rocket silver candle forest "
    "marble window harbor thunder lemon castle meadow copper falcon island jungle lantern"
).split()


def rows(n: int, offset: int = 0, tests=(EASY, HARD)) -> list[dict]:
    """``n`` code problems, every other one with tests any program passes; distinct wording, so
    deduplication and decontamination keep them all."""
    out = []
    for i in range(offset, offset + n):
        a, b, c = (WORDS[(i * k + k) % len(WORDS)] for k in (3, 5, 7))
        out.append(
            {
                "id": f"p{i}",
                "problem": f"Problem {i}: given the {a} and the {b}, write solve_it(x) returning {c} {i}.",
                "tests": tests[0] if i % 2 == 0 else tests[1],
                "entry_point": "solve_it",
            }
        )
    return out


def write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def code_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("code_pool")
    pool, bench = tmp / "pool.jsonl", tmp / "bench.jsonl"
    write(pool, rows(16))
    bench_rows = [
        {
            **r,
            "problem": f"Exercise {r['id']}: return the largest item of a list (find_max).",
            "entry_point": "find_max",
        }
        for r in rows(4, offset=100, tests=(BENCH_EASY, BENCH_HARD))
    ]
    write(bench, bench_rows)
    keep = ("sft.", "rl.", "model.", "curation.", "threads", "eval.n_samples", "eval.max_new_tokens")
    args = [o for o in TINY_CURATED if o.startswith(keep) and not o.startswith("curation.select")]
    args += [
        "data.source=files",
        f"data.sources=[{{name: code, path: {pool}, format: code, id_field: id}}]",
        "reward=code",
        f"eval.benchmarks=[{{name: codebench, path: {bench}, format: code, id_field: id}}]",
        "curation.select.strategy=uniform",
        "curation.dart.check_arithmetic=false",
    ]
    ws = tmp / "ws"
    laminar("run", *args, ws=ws)
    summary = json.loads(next((ws / "runs").glob("2*/summary.json")).read_text())
    return ws, summary


def test_difficulty_pass_rates_come_from_the_code_tests(code_run):
    ws, summary = code_run
    import polars as pl

    attempts = pl.concat(
        [pl.read_parquet(p) for p in (ws / "artifacts" / "attempts").glob("*/attempts.parquet")]
    )
    easy = attempts.filter(pl.col("prompt_id").is_in([f"p{i}" for i in range(0, 16, 2)]))
    hard = attempts.filter(~pl.col("prompt_id").is_in([f"p{i}" for i in range(0, 16, 2)]))
    assert easy.height and hard.height
    assert easy["pass_rate"].min() == 1.0, easy
    assert hard["pass_rate"].max() == 0.0, hard


def test_rl_and_evaluation_count_the_code_verdicts(code_run):
    ws, summary = code_run
    accuracy = query(ws, "SELECT max(value) FROM metrics WHERE stage = 'rl' AND name = 'accuracy'")[0][0]
    assert accuracy is not None and accuracy > 0, accuracy
    terms = query(ws, "SELECT count(*) FROM metrics WHERE stage = 'rl' AND name = 'reward/code_tests'")
    assert terms[0][0] > 0
    rows_ = query(
        ws, "SELECT problem_id, bool_and(correct) FROM eval_results WHERE benchmark = 'codebench' GROUP BY 1"
    )
    judged = dict(rows_)
    assert judged and all(judged[f"p{i}"] == (i % 2 == 0) for i in range(100, 104)), judged
    assert summary["stages"]["eval_rl"]["status"] == "ran"
