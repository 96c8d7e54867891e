"""Is a reference answer one the verifier can check? Short-form answers (a number, an expression, a
tuple, an interval, a word) are; a proof, a multi-part answer, a free-text sentence or an answer
the verifier's own extraction does not read back are not, and a reward computed against them is
noise. ``grade_answer`` names what is wrong with one answer; ingest quarantines such rows with the
reason ``unverifiable answer: <kind> (<detail>)``. The rules and what they drop on real pools are in
docs/curation.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rewards.verifier import extract_answer, normalize_answer

__all__ = [
    "MAX_ANSWER_CHARS",
    "SOLUTION_WORDS",
    "UNVERIFIABLE",
    "UNVERIFIABLE_KINDS",
    "Unverifiable",
    "grade_answer",
]

UNVERIFIABLE = "unverifiable answer"
"""The prefix of every quarantine reason this module gives."""
UNVERIFIABLE_KINDS = ("proof", "multi-part", "free text", "too long", "unparseable")
MAX_ANSWER_CHARS = 300
"""Longer answers are not short-form (MATH train's longest, a 3x3 matrix of fractions, has 159)."""

SOLUTION_WORDS = 20
"""An answer of this many words is a worked solution or an essay, whatever else it holds."""
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_PROOF = re.compile(
    r"\b(?:proofs?|prove[sdn]?|proving|show(?:n|s)? that|q\.?e\.?d\.?)(?![A-Za-z])|\\(?:qed|blacksquare)\b",
    re.I,
)
_PROOF_MARK = re.compile(r"^(?:proof|prove|show that)\b|\\(?:qed|blacksquare)\b|q\.e\.d", re.I)
_PART = re.compile(r"(?:^|[\s,;:.])\(?([a-h]|i{1,3}|iv|vi{0,3})\)(?=\s|$)")
_PART_WORD = re.compile(r"\bpart\s*\(?([a-h1-9])\)?", re.I)
_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
_STOPWORDS = frozenset(
    "the is are was were be been this that these those it its we our so since because therefore "
    "thus hence which where when then of for with from into by as has have can will would".split()
)


@dataclass(frozen=True)
class Unverifiable:
    """Why one answer is not short-form: ``kind`` is one of ``UNVERIFIABLE_KINDS``."""

    kind: str
    detail: str

    @property
    def reason(self) -> str:
        return f"{UNVERIFIABLE}: {self.kind} ({self.detail})"


def _braces_balanced(text: str) -> bool:
    depth = 0
    for ch in text.replace("\\{", "").replace("\\}", ""):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _words(text: str) -> list[str]:
    """Words of two or more letters outside LaTeX commands (``\\frac``, ``\\text``)."""
    return _WORD.findall(_COMMAND.sub(" ", text))


def grade_answer(answer: str | int | float) -> Unverifiable | None:
    """None for a short-form answer the verifier can compare; else what is wrong with it: a proof
    (it starts as one, ends with a QED mark, or says "prove"/"show that" and boxes no answer), free
    text of ``SOLUTION_WORDS`` words or more (a worked solution), several answers (``\boxed`` twice,
    parts "a) ... b) ..."), a shorter sentence (5 words, or 3 with a function word such as "is"),
    more than ``MAX_ANSWER_CHARS`` characters, unbalanced braces, or an answer that the verifier's
    own extraction does not read back from ``\boxed{answer}``. ``answer`` is the reference answer
    as ingest has it (``normalize_text``-ed, before ``normalize_answer``); numbers always pass."""
    if not isinstance(answer, str):
        return None
    text = answer.strip()
    proof = _PROOF.search(text)
    if proof and (_PROOF_MARK.search(text) or not _BOX.search(text)):
        return Unverifiable("proof", f"says {proof.group(0)!r}")
    words = _words(text)
    if len(words) >= SOLUTION_WORDS:
        return Unverifiable("free text", f"{len(words)} words")
    boxes = len(_BOX.findall(text))
    if boxes > 1:
        return Unverifiable("multi-part", f"{boxes} boxed answers")
    parts = list(dict.fromkeys(m.lower() for m in _PART.findall(text))) or list(
        dict.fromkeys(m.lower() for m in _PART_WORD.findall(text))
    )
    if len(parts) > 1:
        return Unverifiable("multi-part", f"parts {', '.join(p + ')' for p in parts)}")
    if len(words) >= 5 or (len(words) >= 3 and any(w.lower() in _STOPWORDS for w in words)):
        return Unverifiable("free text", f"{len(words)} words")
    if len(text) > MAX_ANSWER_CHARS:
        return Unverifiable("too long", f"{len(text):,} characters > {MAX_ANSWER_CHARS}")
    if not _braces_balanced(text):
        return Unverifiable("unparseable", "unbalanced braces")
    gold = normalize_answer(text)
    read_back = normalize_answer(extract_answer(f"\\boxed{{{gold}}}"))
    if read_back != gold:
        return Unverifiable("unparseable", f"the verifier reads a boxed copy back as {read_back[:40]!r}")
    return None
