"""HumanEval, vendored: its 164 problems, its canonical solutions passing 164/164 through the same
scoring path as sampled responses (code_tests in the sandbox), and pass@k."""

from __future__ import annotations

import hashlib
import re

import pytest

from environments.code import CodeSpec
from environments.sandbox import BubblewrapBackend
from evaluation.benchmarks import DATA_DIR
from evaluation.code_benchmarks import CODE_BENCHMARKS, humaneval_rows, load_humaneval, score_code


@pytest.fixture(autouse=True)
def bwrap_or_skip():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


def test_humaneval_is_the_packages_file_with_164_problems():
    readme = (DATA_DIR / "README.md").read_text(encoding="utf-8")
    digest = re.search(r"^([0-9a-f]{64})  HumanEval\.jsonl\.gz$", readme, re.M).group(1)
    assert hashlib.sha256((DATA_DIR / CODE_BENCHMARKS["humaneval"]).read_bytes()).hexdigest() == digest
    items = load_humaneval()
    assert len(items) == 164 and len({it.problem_id for it in items}) == 164
    spec = CodeSpec.from_answer(items[0].answer)
    assert items[0].problem_id == "HumanEval/0" and spec.entry_point == "has_close_elements"
    assert spec.prefix == items[0].problem and spec.tests[0].endswith("check(has_close_elements)\n")


def test_the_canonical_solutions_pass_164_of_164_and_a_wrong_one_does_not():
    rows = humaneval_rows()
    items = load_humaneval()
    right = score_code(items, [[r["canonical_solution"]] for r in rows])
    assert right["pass@1"] == 1.0 and sum(right["passed"].values()) == 164
    wrong = score_code(items[:20], [["    return None\n"] for _ in range(20)])
    assert wrong["pass@1"] < 0.2


def test_pass_at_k_over_several_samples():
    items = load_humaneval()[:2]
    body = humaneval_rows()[0]["canonical_solution"]
    out = score_code(items, [[body, "    return None\n"], ["    return None\n"] * 2])
    assert out["passed"] == {"HumanEval/0": 1, "HumanEval/1": 0}
    assert out["pass@1"] == pytest.approx(0.25) and out["pass@2"] == pytest.approx(0.5)


class Fixed:
    """A real fake of the math verifier: every answer right."""

    def verify_batch(self, texts, golds):
        from rewards.verifier import Verdict

        return [Verdict(True, "x") for _ in texts]


def test_evaluation_scores_code_items_in_the_sandbox_and_math_items_with_the_verifier():
    from types import SimpleNamespace

    from evaluation.benchmarks import BenchmarkItem
    from evaluation.evaluate import _verdicts

    he = load_humaneval()[:2]
    body = humaneval_rows()[0]["canonical_solution"]
    items = [he[0], BenchmarkItem("gsm8k", "0", "1+1?", "2"), he[1]]
    trajectories = [SimpleNamespace(text=t, prompt=SimpleNamespace(answer=it.answer)) for t, it in
                    zip([body, "#### 2", "    return None\n"], items)]  # fmt: skip
    assert [v.correct for v in _verdicts(items, trajectories, Fixed())] == [True, True, False]
