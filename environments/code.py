"""The code domain: a code problem's gold answer (its unit tests, as JSON), the program extracted from
a response, and the ``code_tests`` reward component that judges one against the other
(``environments.judge``: the program computes in the sandbox, a checker outside it compares).
Importing this module registers ``code_tests`` with ``rewards.compose``."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from conf.schema import CodeTestsParams, SandboxConfig
from environments.judge import Judgement, judge
from rewards.components import Sample
from rewards.compose import register_component

FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
MAX_PARALLEL = 8
"""Sandbox runs of one batch in flight at once."""


@dataclass(frozen=True)
class CodeSpec:
    """A code problem's gold answer: ``tests`` (each a snippet that raises when the program is wrong),
    the ``entry_point`` (the function the tests call, if any) and a ``prefix`` run before the program
    (HumanEval: the prompt, so a response that completes the function body runs)."""

    tests: tuple[str, ...]
    entry_point: str | None = None
    prefix: str = ""

    def to_answer(self) -> str:
        """The spec as the prompt pool's ``answer`` string (JSON)."""
        out = {"tests": list(self.tests), "entry_point": self.entry_point, "prefix": self.prefix}
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_answer(cls, answer: str) -> CodeSpec:
        try:
            raw = json.loads(answer)
        except (TypeError, json.JSONDecodeError):
            raise ValueError(f"not a code answer (JSON with tests): {str(answer)[:80]!r}") from None
        tests = raw.get("tests") if isinstance(raw, dict) else None
        tests = [tests] if isinstance(tests, str) else tests
        if not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise ValueError(
                f"a code answer needs tests (a string or a list of strings): {str(answer)[:80]!r}"
            )
        return cls(tuple(tests), raw.get("entry_point"), raw.get("prefix") or "")


def extract_program(text: str, completion: bool = False) -> str:
    """The response's program: its last fenced code block (```python ... ```; an unclosed one runs to
    the end), else the whole response. ``completion``: the prompt opened the code (HumanEval), so a
    response that does not start with a fence is code up to its first fence."""
    if completion and not text.lstrip().startswith("```"):
        return text.split("```", 1)[0]
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def run_tests(
    program: str, spec: CodeSpec, timeout_s: float, config: SandboxConfig | None = None
) -> Judgement:
    """``program`` judged against ``spec`` (``environments.judge``): the program computes in the
    sandbox, a trusted checker outside it compares; the tests passed, or why judging failed."""
    return judge(program, spec, timeout_s, config)


@dataclass(frozen=True)
class CodeTests:
    """The response's program (``extract_program``) against the unit tests of its gold answer
    (``CodeSpec``), judged outside the program (``environments.judge``): the share of tests passed
    (``score=pass_fraction``) or 1 when all pass (``score=all_pass``). A gold answer that is no code
    spec raises (the sample falls back to 0); a judging that fails (a result that is not plain data,
    ...: ``environments.judge.ERRORS``) gives the fallback with its reason (``score_reasons``).
    ``sandbox_config``: the run's ``sandbox`` settings, for every sandbox run of the judging."""

    params: CodeTestsParams
    sandbox_config: SandboxConfig | None = field(default=None, compare=False)
    name: str = "code_tests"
    correctness: bool = False
    fallback: float = 0.0

    def one(self, sample: Sample) -> tuple[float, str | None]:
        """(score, None), or (the fallback, the reason) when judging failed."""
        spec = CodeSpec.from_answer(sample.answer)
        program = extract_program(sample.text, completion=bool(spec.prefix))
        got = run_tests(program, spec, self.params.timeout_s, self.sandbox_config)
        if got.reason is not None:
            return self.fallback, got.reason
        if self.params.score == "all_pass":
            return (1.0 if got.passed == got.total else 0.0), None
        return got.passed / got.total, None

    def score_reasons(
        self, samples: Sequence[Sample], correct: Sequence[bool]
    ) -> list[tuple[float, str | None]]:
        """Per sample, its score and why judging failed (None: it did not)."""
        with ThreadPoolExecutor(max(1, min(MAX_PARALLEL, len(samples)))) as pool:
            return list(pool.map(self.one, samples))

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        return [x for x, _ in self.score_reasons(samples, correct)]


def _build(params: CodeTestsParams, sandbox: SandboxConfig | None = None) -> CodeTests:
    return CodeTests(params, sandbox)


register_component("code_tests", CodeTestsParams, _build)
