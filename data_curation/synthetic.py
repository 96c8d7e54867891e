"""Synthetic arithmetic with graded difficulty: the embedded default task.

Difficulty grows with the number of operations (one to five chained one-digit additions and
subtractions, running totals 0..19): each step is a fact to get right, so errors compound. Every
problem has a step-by-step gold solution (left to right, one operation per line) ending in
``#### <answer>``, the final-answer marker the verifier reads. Generation is deterministic from the
seed; the held-out set is drawn first and the pool never contains one of its expressions.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

# level -> (number of operations, largest operand). Each operand is 1..largest (the first 0..largest);
# running totals stay in 0..MAX_TOTAL: a subtraction is only drawn when the total stays non-negative,
# an addition only when it stays <= MAX_TOTAL. Difficulty grows with the length of the chain, each
# step a one- or two-digit fact the model must get right.
LEVELS: dict[int, tuple[int, int]] = {
    1: (1, 9),
    2: (2, 9),
    3: (3, 9),
    4: (4, 9),
    5: (5, 9),
    # long chains, outside the default mix: a few of them among short problems give the long-tailed
    # response lengths of reasoning workloads (benchmarks/rl_throughput.py)
    6: (10, 9),
    7: (20, 9),
    8: (30, 9),
}
MAX_TOTAL = 19
OPS = ("+", "-")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem. ``answer`` is the canonical integer string."""

    prompt_id: str
    problem: str
    solution: str
    answer: str
    level: int
    split: str
    demonstration: str
    """The warm-up SFT target: the gold solution, except that with ``demo_error_rate`` per step a
    result is off by 1 or 2 (and the chain carries the slip on), like demonstrations from an
    imperfect teacher. ``solution`` and ``answer`` are always correct."""


RESTATE_LINE = "so the total is {acc}"
"""A restatement a rambling demonstration adds after a step: it carries nothing (the total is on the
step's line already), so it is pure length, and its words repeat from the second one on."""


def _solve(
    operands: list[int],
    ops: list[str],
    slip: random.Random | None = None,
    rate: float = 0.0,
    restate: random.Random | None = None,
    restate_rate: float = 0.0,
) -> str:
    """The step-by-step solution; with ``slip``, each step's result is off by 1 or 2 with prob ``rate``;
    with ``restate``, after each step the running total is restated (``RESTATE_LINE``) a geometric
    number of times (each further one with prob ``restate_rate``, at most 3)."""
    steps, acc = [], operands[0]
    for op, x in zip(ops, operands[1:]):
        new = acc + x if op == "+" else acc - x
        if slip is not None and slip.random() < rate:
            new = max(0, new + slip.choice((-2, -1, 1, 2))) or new + 1
        steps.append(f"{acc}{op}{x}={new}")
        acc = new
        if restate is not None and restate_rate > 0:
            repeats = 0
            while repeats < 3 and restate.random() < restate_rate:
                repeats += 1
            steps += [RESTATE_LINE.format(acc=acc)] * repeats
    return "\n".join(steps + [f"#### {acc}"])


def _make(rng: random.Random, level: int) -> tuple[str, list[int], list[str]]:
    n_ops, largest = LEVELS[level]
    operands, ops = [rng.randint(0, largest)], []
    total = operands[0]
    for _ in range(n_ops):
        x = rng.randint(1, largest)
        allowed = [
            op for op in OPS if (op == "+" and total + x <= MAX_TOTAL) or (op == "-" and total - x >= 0)
        ]
        op = rng.choice(allowed)
        total = total + x if op == "+" else total - x
        operands.append(x)
        ops.append(op)
    expr = str(operands[0]) + "".join(f"{op}{x}" for op, x in zip(ops, operands[1:]))
    return expr, operands, ops


def problem_text(expr: str) -> str:
    return f"What is {expr}?"


def prompt_id(text: str) -> str:
    return "arith-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def generate(
    seed: int,
    pool_size: int,
    heldout_size: int,
    levels: list[int],
    demo_error_rate: float = 0.0,
    demo_restate_rate: float = 0.0,
    demo_full_stop_rate: float = 0.0,
) -> tuple[list[Problem], list[Problem]]:
    """(pool, heldout): disjoint, levels balanced round-robin, deterministic from ``seed``. The
    problems do not depend on ``demo_error_rate``, ``demo_restate_rate`` or ``demo_full_stop_rate``,
    nor each of these on the others (each draws from its own generator)."""
    rng = random.Random(f"arith:{seed}")
    slip = random.Random(f"arith-demo:{seed}")
    restate = random.Random(f"arith-restate:{seed}")
    full_stop = random.Random(f"arith-full-stop:{seed}")
    seen: set[str] = set()

    def draw(n: int, split: str) -> list[Problem]:
        """Levels in rotation; a level whose distinct problems run out leaves the rotation."""
        out: list[Problem] = []
        active = list(levels)
        misses = {lv: 0 for lv in levels}
        turn = 0
        while len(out) < n:
            if not active:
                raise ValueError(
                    f"cannot draw {n} distinct {split} problems from levels {levels}; "
                    "lower data.pool_size or data.heldout_size"
                )
            level = active[turn % len(active)]
            turn += 1
            expr, operands, ops = _make(rng, level)
            if expr in seen:
                misses[level] += 1
                if misses[level] > 500:
                    active.remove(level)
                continue
            misses[level] = 0
            seen.add(expr)
            text = problem_text(expr)
            solution = _solve(operands, ops)
            demonstration = _solve(operands, ops, slip, demo_error_rate, restate, demo_restate_rate)
            if demo_full_stop_rate > 0 and full_stop.random() < demo_full_stop_rate:
                demonstration += "."
            answer = solution.rsplit("#### ", 1)[1]
            out.append(Problem(prompt_id(text), text, solution, answer, level, split, demonstration))
        return out

    heldout = draw(heldout_size, "heldout")
    pool = draw(pool_size, "pool")
    return pool, heldout


PROMPT_TEMPLATE = "{problem}\n"
"""How the arithmetic task is put to a model without a chat template (the tiny default)."""


def write_dataset(
    out_dir,
    *,
    seed: int,
    pool_size: int,
    heldout_size: int,
    levels: list[int],
    demo_error_rate: float = 0.0,
    demo_restate_rate: float = 0.0,
    demo_full_stop_rate: float = 0.0,
) -> dict[str, float]:
    """Write ``pool.parquet`` and ``heldout.parquet`` (columns: prompt_id, problem, solution, answer,
    level, split, demonstration) into ``out_dir``; returns counts."""
    from dataclasses import asdict
    from pathlib import Path

    import polars as pl

    pool, heldout = generate(
        seed, pool_size, heldout_size, levels, demo_error_rate, demo_restate_rate, demo_full_stop_rate
    )
    for name, rows in (("pool", pool), ("heldout", heldout)):
        pl.DataFrame([asdict(p) for p in rows]).write_parquet(Path(out_dir) / f"{name}.parquet")
    return {"pool_prompts": float(len(pool)), "heldout_prompts": float(len(heldout))}
