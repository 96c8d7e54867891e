"""Instruction wrappers shared by a source's rows ("Solve the following math problem step by step.
... {problem} ... Remember to put your answer on its own line after "Answer:"").

RL prompt pools in verl format store every problem inside the instruction the pool's authors
trained with. Ingest takes the wrapper out, so that the pool holds bare problems (near dedup
and decontamination compare problems, not wrappers) and the project's own template wraps every
source alike; the wrapper is kept as the source's template (``templates.parquet``, catalog table
``source_templates``).

A wrapper is a prefix and/or a suffix that at least ``min_share`` of the source's rows (and at
least ``min_rows`` rows) start or end with, at least ``min_chars`` long, cut at a sentence or line
boundary so that it never takes the first or last word of a problem: the longest prefix shared by
that many rows is the longest common prefix of a window of ``ceil(min_share * n)`` consecutive rows
in sorted order (the suffix likewise on reversed texts). Rows that have the wrapper lose it; the
others are unchanged. A source whose rows share no such wrapper is unchanged.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from collections.abc import Sequence

__all__ = ["Template", "detect_template", "strip_template"]

MIN_SHARE = 0.9
MIN_ROWS = 8
MIN_CHARS = 16
_SENTENCE_END = ".?!:"


@dataclass(frozen=True)
class Template:
    prefix: str
    suffix: str
    rows: int
    """Rows of the source looked at."""
    matched: int
    """Rows that carry the wrapper (prefix and suffix where both are set) and lose it."""

    @property
    def text(self) -> str:
        """The source's template, as ``evaluation.benchmarks`` templates are written."""
        return f"{self.prefix}{{problem}}{self.suffix}"


def _shared(texts: Sequence[str], k: int) -> str:
    """The longest prefix that at least ``k`` of ``texts`` start with."""
    s = sorted(texts)
    best = ""
    for i in range(len(s) - k + 1):
        common = os.path.commonprefix([s[i], s[i + k - 1]])
        if len(common) > len(best):
            best = common
    return best


def _cut_prefix(prefix: str) -> str:
    """``prefix`` up to its last line break, or its last sentence end followed by a space."""
    for i in range(len(prefix), 0, -1):
        if prefix[i - 1] == "\n" or (prefix[i - 1].isspace() and i >= 2 and prefix[i - 2] in _SENTENCE_END):
            return prefix[:i]
    return ""


def _cut_suffix(suffix: str) -> str:
    """``suffix`` from its first line break or its first space before a capital letter (the start
    of the instruction's first sentence; characters before it end the problems themselves)."""
    for j, ch in enumerate(suffix):
        if ch == "\n" or (ch.isspace() and j + 1 < len(suffix) and suffix[j + 1].isupper()):
            return suffix[j:]
    return ""


def detect_template(
    problems: Sequence[str],
    *,
    min_share: float = MIN_SHARE,
    min_rows: int = MIN_ROWS,
    min_chars: int = MIN_CHARS,
) -> Template | None:
    """The wrapper most rows of ``problems`` share (see the module docstring), or None."""
    if not 0 < min_share <= 1:
        raise ValueError(f"min_share must be in (0, 1], got {min_share}")
    n = len(problems)
    if n < max(min_rows, 1):
        return None
    k = max(min_rows, math.ceil(min_share * n))
    if k > n:
        return None
    prefix = _cut_prefix(_shared(problems, k))
    prefix = prefix if len(prefix.strip()) >= min_chars else ""
    suffix = _cut_suffix(_shared([p[::-1] for p in problems], k)[::-1])
    suffix = suffix if len(suffix.strip()) >= min_chars else ""
    if not prefix and not suffix:
        return None
    matched = sum(1 for p in problems if _has(p, prefix, suffix))
    if matched < k:  # prefix and suffix each common, but not on the same rows
        return None
    return Template(prefix, suffix, n, matched)


def _has(problem: str, prefix: str, suffix: str) -> bool:
    return (
        problem.startswith(prefix)
        and problem.endswith(suffix)
        and len(problem) > len(prefix) + len(suffix)
        and problem[len(prefix) : len(problem) - len(suffix)].strip() != ""
    )


def strip_template(problem: str, template: Template | None) -> str:
    """``problem`` without the wrapper (stripped of the whitespace at its edges), or unchanged when
    it does not carry the whole wrapper."""
    if template is None or not _has(problem, template.prefix, template.suffix):
        return problem
    return problem[len(template.prefix) : len(problem) - len(template.suffix)].strip()
