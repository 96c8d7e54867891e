"""Sampling metrics over verified responses: pass@k, avg@n, maj@k and a per-run summary.

Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rewards.components import repeated_ngram_rate
from rewards.verifier import normalize_answer

__all__ = ["avg_at_n", "maj_at_k", "pass_at_k", "summarize"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) to stay stable for large n."""
    if n < 1 or k < 1:
        raise ValueError(f"pass_at_k needs n >= 1 and k >= 1, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least k samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_n(correct: Sequence[bool]) -> float:
    """Mean correctness over the samples of one problem."""
    if len(correct) == 0:
        raise ValueError("avg_at_n needs at least one sample")
    return sum(bool(x) for x in correct) / len(correct)


def maj_at_k(preds: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """Majority vote over the first ``k`` samples: the most frequent normalised prediction among
    them (samples with no prediction do not vote; ties go to the answer seen first). Returns 1.0
    if that answer's samples are correct, 0.0 otherwise or when no sample has a prediction."""
    if len(preds) != len(correct):
        raise ValueError(f"maj_at_k: {len(preds)} preds but {len(correct)} correctness flags")
    if not 1 <= k <= len(preds):
        raise ValueError(f"maj@{k} needs 1 <= k <= number of samples ({len(preds)})")
    votes: Counter[str] = Counter()
    first: dict[str, int] = {}
    for i in range(k):
        if preds[i] is None:
            continue
        answer = normalize_answer(preds[i])
        votes[answer] += 1
        first.setdefault(answer, i)
    if not votes:
        return 0.0
    winner = min(votes, key=lambda a: (-votes[a], first[a]))
    return 1.0 if correct[first[winner]] else 0.0


def _field(row: Any, key: str, default: Any = None) -> Any:
    if isinstance(row, Mapping):
        return row.get(key, default)
    return getattr(row, key, default)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def default_ks(n: int) -> tuple[int, ...]:
    """Powers of two up to ``n``, and ``n`` itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return tuple(ks) if ks[-1] == n else (*ks, n)


def summarize(rows: Sequence[Any], n_samples: int, ks: Sequence[int] | None = None) -> dict[str, Any]:
    """Metrics of one evaluation run over ``rows``, one per (problem, sample).

    A row is a mapping or an object with ``problem_id``, ``sample_idx``, ``correct``, ``pred``,
    ``length`` (response tokens), ``truncated`` and optionally ``level`` / ``subject``. Every
    problem must have exactly ``n_samples`` rows. Returns ``avg@n``, ``pass@k`` for each k in
    ``ks`` (default: powers of two and n) with k <= n, ``maj@n``, ``mean_length``,
    ``truncation_rate``, ``n_problems``, and ``by_level`` / ``by_subject`` (each value has
    ``avg@n`` and ``count``, the number of problems) when rows carry those keys.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if not rows:
        raise ValueError("summarize needs at least one row")
    problems: dict[str, list[Any]] = defaultdict(list)
    for row in rows:
        problems[str(_field(row, "problem_id"))].append(row)
    for pid, samples in problems.items():
        if len(samples) != n_samples:
            raise ValueError(f"problem {pid!r} has {len(samples)} samples, expected n_samples={n_samples}")
        samples.sort(key=lambda r: _field(r, "sample_idx"))

    ks = [k for k in (ks if ks is not None else default_ks(n_samples)) if k <= n_samples]
    n = n_samples
    per_problem = {
        pid: (
            [bool(_field(r, "correct")) for r in samples],
            [_field(r, "pred") for r in samples],
        )
        for pid, samples in problems.items()
    }
    summary: dict[str, Any] = {
        "n_problems": len(problems),
        "n_samples": n,
        f"avg@{n}": _mean(avg_at_n(c) for c, _ in per_problem.values()),
    }
    for k in ks:
        summary[f"pass@{k}"] = _mean(pass_at_k(n, sum(c), k) for c, _ in per_problem.values())
    summary[f"maj@{n}"] = _mean(maj_at_k(p, c, n) for c, p in per_problem.values())
    summary["mean_length"] = _mean(float(_field(r, "length")) for r in rows)
    summary["truncation_rate"] = _mean(float(bool(_field(r, "truncated"))) for r in rows)
    for key in ("level", "subject"):
        groups: dict[str, list[float]] = defaultdict(list)
        for pid, samples in problems.items():
            value = _field(samples[0], key)
            if value is not None:
                groups[str(value)].append(avg_at_n(per_problem[pid][0]))
        if groups:
            summary[f"by_{key}"] = {
                g: {f"avg@{n}": _mean(v), "count": len(v)} for g, v in sorted(groups.items())
            }
    return summary


def reranked_accuracy(rows: Sequence[dict], component: str) -> float:
    """Best-of-n reranked by a scorer: per problem, whether the sample ``component`` scored highest
    (its ``terms`` entry; the lowest ``sample_idx`` among ties) is correct, averaged over problems.
    Problems with no sample the scorer scored are left out."""
    best: dict[str, tuple[float, int, bool]] = {}
    for r in rows:
        score = next((t[1] for t in r["terms"] if t[0] == component), None)
        if score is None:
            continue
        cand = (score, -int(r["sample_idx"]), bool(r["correct"]))
        pid = str(r["problem_id"])
        if pid not in best or cand[:2] > best[pid][:2]:
            best[pid] = cand
    return _mean(float(c) for _, _, c in best.values()) if best else float("nan")


REPEAT_NGRAM = 3
"""The n of ``repeated_ngram_rate`` in evaluation reports (the ``repetition`` component's default)."""


def shaping_metrics(rows: Sequence[dict]) -> dict[str, float | None]:
    """What the shaping terms act on, beside avg@n: the mean length (tokens) of correct and of wrong
    responses (None when there are none) and the mean repeated word-3-gram rate
    (``rewards.components.repeated_ngram_rate``)."""
    right = [r["length"] for r in rows if r["correct"]]
    wrong = [r["length"] for r in rows if not r["correct"]]
    rates = [repeated_ngram_rate(r.get("response") or "", REPEAT_NGRAM) for r in rows]
    return {
        "mean_length_correct": sum(right) / len(right) if right else None,
        "mean_length_wrong": sum(wrong) / len(wrong) if wrong else None,
        "repeated_ngram_rate": sum(rates) / len(rates) if rates else 0.0,
    }
