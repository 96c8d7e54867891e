"""The code domain: a code problem's gold answer (its unit tests, as JSON), the program extracted from
a response, and the ``code_tests`` reward component that runs one against the other in the sandbox.
Importing this module registers ``code_tests`` with ``rewards.compose``."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from conf.schema import CodeTestsParams, SandboxConfig
from environments import sandbox
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


def harness(program: str, spec: CodeSpec, nonce: str) -> tuple[str, dict[str, str]]:
    """``main.py`` and its files: the program loads as module ``solution`` (its ``__main__`` block does
    not run; a crash or ``sys.exit`` while loading leaves what it defined), then each test runs in its
    namespace, then one line ``<nonce> <passed> <total>`` is printed. A program that ends the process
    early prints no such line and scores 0."""
    main = (
        "import sys\n"
        "g = {'__name__': 'solution', '__builtins__': __builtins__}\n"
        "try:\n"
        "    exec(compile(open('solution.py').read(), 'solution.py', 'exec'), g)\n"
        "except BaseException as e:\n"
        "    print(f'the program failed to load: {e!r}', file=sys.stderr)\n"
        f"tests = {list(spec.tests)!r}\n"
        "passed = 0\n"
        "for i, t in enumerate(tests):\n"
        "    try:\n"
        "        exec(compile(t, f'test_{i}', 'exec'), g)\n"
        "        passed += 1\n"
        "    except BaseException as e:\n"
        "        print(f'test {i} failed: {e!r}'[:300], file=sys.stderr)\n"
        f"print({nonce!r}, passed, len(tests))\n"
    )
    return main, {"solution.py": spec.prefix + ("\n" if spec.prefix else "") + program}


def run_tests(
    program: str, spec: CodeSpec, timeout_s: float, config: SandboxConfig | None = None
) -> tuple[int, int]:
    """(tests passed, tests) of ``program`` in one sandbox run; 0 passed when it never reports."""
    nonce = secrets.token_hex(16)
    main, files = harness(program, spec, nonce)
    result = sandbox.run(main, files=files, timeout_s=timeout_s, config=config)
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce:
            return int(parts[1]), int(parts[2])
    return 0, len(spec.tests)


@dataclass(frozen=True)
class CodeTests:
    """The response's program (``extract_program``) against the unit tests of its gold answer
    (``CodeSpec``), in the sandbox: the share of tests passed (``score=pass_fraction``) or 1 when all
    pass (``score=all_pass``). A gold answer that is no code spec raises (the sample falls back to 0)."""

    params: CodeTestsParams
    sandbox_config: SandboxConfig | None = field(default=None, compare=False)
    name: str = "code_tests"
    correctness: bool = False
    fallback: float = 0.0

    def one(self, sample: Sample) -> float:
        spec = CodeSpec.from_answer(sample.answer)
        program = extract_program(sample.text, completion=bool(spec.prefix))
        passed, total = run_tests(program, spec, self.params.timeout_s, self.sandbox_config)
        if self.params.score == "all_pass":
            return 1.0 if passed == total else 0.0
        return passed / total

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        with ThreadPoolExecutor(max(1, min(MAX_PARALLEL, len(samples)))) as pool:
            return list(pool.map(self.one, samples))


register_component("code_tests", CodeTestsParams, CodeTests)
