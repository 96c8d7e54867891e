"""DART: difficulty-aware rejection tuning (arXiv 2407.13690; hkust-nlp/dart-math @ 219b324).

Collect correct responses per prompt, with sampling trials allocated by difficulty, to build the
RFT dataset. Difficulty = fail rate = ``1 - pass_rate`` from the difficulty stage's attempts.

Strategies (``conf.schema.DartStrategy``; one target rule and one cap rule each, dispatched through dicts):

- ``uniform``: every prompt targets ``k_u`` correct responses.
- ``prop2diff``: prompt i targets ``max(1, ceil(k_p * fail_rate_i))`` correct responses, so the
  hardest prompts get ``k_p`` and every prompt at least one.
- ``vanilla``: vanilla rejection tuning, the DART paper's baseline: the same number of trials for every
  prompt (``budget // n_prompts``, capped by ``max_trials`` if > 0), every correct response kept,
  no target.

A prompt stops when ``trials >= max_trials`` (if > 0) or ``corrects >= target``. The dart-math
repo writes the second test as ``n_corrects > min_n_corrects`` (strictly greater); ours is the same
rule with ``min_n_corrects = target - 1``. Prompts with pass rate 0 may never succeed: they stop at
``max_trials`` (with ``max_trials = 0`` only the budget stops them).

The total ``budget`` of trials is shared by all prompts, so strategies run under one budget are
comparable. Trials are handed out in rounds (``next_round``): the sampler generates them, the
caller ``record``s the verdicts, and the next round is planned from the updated state. The state
(trials handed out, trials recorded, corrects per prompt) lives in a DuckDB table and each round's
allocation is one SQL query:

1. Active prompts: not stopped, under their cap, and with no trials in flight (handed out but not
   yet recorded: they are planned again once their results are in).
2. Each active prompt's need: the trials it is expected to still need,
   ``ceil((target - corrects) / max(p_hat, p_floor))`` clamped to ``[1, cap - handed_out]``
   (vanilla: ``cap - handed_out``). ``p_hat`` pools the attempts and DART's own trials:
   ``(n_correct + corrects) / (n + trials)`` (the attempts' ``pass_rate`` when both counts are 0).
3. If the needs fit the round (``min(round_size, budget left)``) every prompt gets its need;
   otherwise each gets ``floor(need * R / sum(needs))`` (exact integer arithmetic) and the
   ``R - sum(floors)`` leftover trials go one each to the prompts that hold the smallest share of
   their expected total, ``(handed_out + floor) / (handed_out + need)``, then the largest remainder,
   then the highest fail rate, then prompt id. Scaling in proportion to need keeps the hard prompts
   (largest needs) from being starved; when a round holds fewer trials than there are prompts,
   every prompt gets a first trial before any gets a second, and after that trials go where the
   least of the expected need has been served (so under a tight budget prompts get trials in
   proportion to their expected needs, as the strategy's targets ask).

Everything is deterministic: the same attempts, params and recorded results give the same plans.

``arithmetic_consistent`` is an acceptance check beyond the DART paper (``curation.dart.check_arithmetic``):
a response whose final answer is right but which states a false integer equation on the way (``4+4=9``
then ``9-3=6``) is a lucky guess, not a solution. On the default task these make up most of the
"correct" responses to the hardest prompts (seed 0, warm-up model: 63% at level 5, 44% at level 4,
10% at level 2), so a strategy that collects more responses for hard prompts (Prop2Diff) would mostly
collect more wrong steps to imitate. DART-Math checks the final answer only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable

from conf.schema import DART_STRATEGIES, DartStrategy

if TYPE_CHECKING:
    import polars as pl

# A stated integer equation: an expression of integers and + - * (at least one operator) = an integer,
# standing alone (not part of a longer expression, a decimal, a power, a fraction or a name).
_EQUATION = re.compile(r"(?<![\w.^/)(+\-*×·])(\d+(?:\s*[-+*×·]\s*\d+)+)\s*=\s*(\d+)(?![\w.^/(])")
_TOKEN = re.compile(r"\d+|[-+*×·]")


def _evaluate(expr: str) -> int:
    """An expression of non-negative integers with + - * (× and · as *), usual precedence."""
    tokens = _TOKEN.findall(expr)
    total, term, sign = 0, int(tokens[0]), 1
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op in "*×·":
            term *= int(num)
        else:
            total += sign * term
            term, sign = int(num), (1 if op == "+" else -1)
    return total + sign * term


def arithmetic_consistent(text: str) -> bool:
    """False when ``text`` states an integer equation that is wrong (``4+4=9``, ``3*4=11``); text
    with no such equation passes. Only stand-alone equations of integers and + - * are read, so
    algebra (``x-3=1``), decimals, powers and fractions are left alone."""
    for m in _EQUATION.finditer(text):
        lhs, rhs = m.group(1), m.group(2)
        if len(lhs) > 200:  # not arithmetic anyone checks by hand; do not spend time on it
            continue
        if _evaluate(lhs) != int(rhs):
            return False
    return True


def top_ranked(trials: pl.DataFrame, stats: pl.DataFrame, default_keep: int) -> pl.DataFrame:
    """Rank instead of verify (``curation.dart.select=reward_model``): per prompt, its ``target``
    trials with the highest ``rm_score`` (ties to the earlier trial), ``default_keep`` where the
    strategy sets no target (vanilla), every trial a candidate whether the verifier accepted it or not.
    ``trials``: one row per trial (prompt_id, response, length, trial_idx, rm_score, verified);
    ``stats``: ``DartPlanner.stats()``. Returns the kept rows ordered by prompt_id, trial_idx."""
    import polars as pl

    rank = pl.int_range(pl.len()).over("prompt_id")
    return (
        trials.join(stats.select("prompt_id", "target"), on="prompt_id", how="left")
        .sort(["prompt_id", "rm_score", "trial_idx"], descending=[False, True, False])
        .filter(rank < pl.col("target").fill_null(default_keep))
        .drop("target")
        .sort(["prompt_id", "trial_idx"])
    )


# ceil() of k_p * fail_rate must not round a product like 10 * (1 - 0.7) = 3.0000000000000004 up to 4.
_CEIL_EPS = 1e-9


@dataclass(frozen=True)
class DartParams:
    """DART's knobs. ``k_u``/``k_p`` default small for the embedded task (the repo example uses
    ``k_u = 40``; a third-party reading of the DART paper gives ``k_p = 192``)."""

    strategy: DartStrategy = "prop2diff"
    k_u: int = 4  # uniform: correct responses targeted per prompt
    k_p: int = 8  # prop2diff: target = max(1, ceil(k_p * fail_rate))
    max_trials: int = 32  # per-prompt trial cap (0 = none)
    budget: int = 20000  # total trials over all prompts (the same budget makes strategies comparable)
    round_size: int = 1024  # trials handed out per round
    p_floor: float = 0.05  # allocation only: the pass rate assumed at least, when estimating trials needed

    def __post_init__(self) -> None:
        if self.strategy not in DART_STRATEGIES:
            raise ValueError(
                f"dart strategy {self.strategy!r} is unknown: use one of {', '.join(DART_STRATEGIES)}"
            )
        for name in ("k_u", "k_p", "budget", "round_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"dart {name} = {getattr(self, name)} must be >= 1")
        if self.max_trials < 0:
            raise ValueError(f"dart max_trials = {self.max_trials} must be >= 0 (0 = no cap)")
        if not 0.0 < self.p_floor <= 1.0:
            raise ValueError(f"dart p_floor = {self.p_floor} must be in (0, 1]")


# target per prompt (SQL over the column fail_rate); NULL = no target
_TARGETS: dict[DartStrategy, Callable[[DartParams], str]] = {
    "uniform": lambda p: f"{int(p.k_u)}",
    "prop2diff": lambda p: f"GREATEST(1, CAST(CEIL({int(p.k_p)} * fail_rate - {_CEIL_EPS}) AS BIGINT))",
    "vanilla": lambda p: "NULL",
}


def _vanilla_cap(p: DartParams, n_prompts: int) -> int:
    per = p.budget // n_prompts
    if per < 1:
        raise ValueError(
            f"dart vanilla: budget {p.budget} is below the number of prompts ({n_prompts}), so no "
            f"prompt would get a trial; raise dart budget to at least {n_prompts}"
        )
    return min(per, p.max_trials) if p.max_trials > 0 else per


# per-prompt trial cap; None = no cap (only the budget stops a prompt)
_CAPS: dict[DartStrategy, Callable[[DartParams, int], int | None]] = {
    "uniform": lambda p, n: p.max_trials or None,
    "prop2diff": lambda p, n: p.max_trials or None,
    "vanilla": _vanilla_cap,
}

_STATE_SQL = """
CREATE TABLE dart_state (
    prompt_id VARCHAR, fail_rate DOUBLE, prior_n BIGINT, prior_correct BIGINT, prior_p DOUBLE,
    target BIGINT, cap BIGINT, issued BIGINT, trials BIGINT, corrects BIGINT
);
CREATE TABLE dart_responses (prompt_id VARCHAR, response VARCHAR, length BIGINT, trial_idx BIGINT);
"""


def _register(con: Any, name: str, obj: Any) -> None:
    """Expose a polars DataFrame (zero-copy through Arrow) or a parquet path to SQL as ``name``."""
    if isinstance(obj, (str, Path)):
        path = str(obj).replace("'", "''")
        con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS SELECT * FROM read_parquet('{path}')")
    else:
        con.register(name, obj.to_arrow())


def _unregister(con: Any, name: str, obj: Any) -> None:
    if isinstance(obj, (str, Path)):
        con.execute(f"DROP VIEW IF EXISTS {name}")
    else:
        con.unregister(name)


def _polars(con: Any, sql: str) -> pl.DataFrame:
    return con.sql(sql).pl()


class DartPlanner:
    """Plans DART's sampling rounds and collects the correct responses.

    ``attempts``: a polars DataFrame or parquet path with ``prompt_id`` (unique) and ``pass_rate``
    (``n`` and ``n_correct`` are used when present: a null pass rate is ``n_correct / n``).
    Use: ``while plan := planner.next_round(): planner.record(sample(plan))`` (or ``run(sample)``).
    """

    def __init__(self, attempts: pl.DataFrame | str | Path, params: DartParams = DartParams()):
        from data_curation.db import memory_db

        self.params = params
        self.rounds = 0
        self._con = memory_db()
        self._con.execute(_STATE_SQL)
        _register(self._con, "dart_attempts", attempts)
        self.n_prompts = self._load(attempts)

    def _load(self, attempts: Any) -> int:
        con, p = self._con, self.params
        cols = {r[0] for r in con.execute("DESCRIBE dart_attempts").fetchall()}
        missing = {"prompt_id", "pass_rate"} - cols
        if missing:
            raise ValueError(
                f"dart attempts lack column(s) {sorted(missing)}: give the difficulty stage's table "
                "(prompt_id, n, n_correct, pass_rate, ...)"
            )
        n = "CAST(n AS BIGINT)" if "n" in cols else "CAST(NULL AS BIGINT)"
        nc = "CAST(n_correct AS BIGINT)" if "n_correct" in cols else "CAST(NULL AS BIGINT)"
        con.execute(f"""CREATE TEMP TABLE dart_src AS
            SELECT CAST(prompt_id AS VARCHAR) AS prompt_id, {n} AS n, {nc} AS n_correct,
                   COALESCE(CAST(pass_rate AS DOUBLE), {nc} / NULLIF({n}, 0)) AS pass_rate
            FROM dart_attempts""")
        n_prompts, dups, bad = con.execute(
            "SELECT COUNT(*), COUNT(*) - COUNT(DISTINCT prompt_id), "
            "COUNT(*) FILTER (WHERE prompt_id IS NULL OR pass_rate IS NULL OR isnan(pass_rate) "
            "OR pass_rate < 0 OR pass_rate > 1) FROM dart_src"
        ).fetchall()[0]
        if n_prompts == 0:
            raise ValueError("dart attempts are empty: there is nothing to sample")
        if dups:
            raise ValueError(f"dart attempts hold {dups} duplicate prompt_id(s): give one row per prompt")
        if bad:
            ex = con.execute(
                "SELECT prompt_id, pass_rate FROM dart_src WHERE prompt_id IS NULL OR pass_rate IS NULL "
                "OR isnan(pass_rate) OR pass_rate < 0 OR pass_rate > 1 LIMIT 3"
            ).fetchall()
            raise ValueError(
                f"dart attempts: {bad} row(s) lack a prompt_id or a pass_rate in [0, 1], e.g. {ex}"
            )
        cap = _CAPS[p.strategy](p, n_prompts)
        con.execute(f"""INSERT INTO dart_state
            SELECT prompt_id, fail_rate, COALESCE(n, 0), COALESCE(n_correct, 0), pass_rate,
                   {_TARGETS[p.strategy](p)}, {"NULL" if cap is None else int(cap)}, 0, 0, 0
            FROM (SELECT *, 1.0 - pass_rate AS fail_rate FROM dart_src) ORDER BY prompt_id""")
        con.execute("DROP TABLE dart_src")
        _unregister(con, "dart_attempts", attempts)
        return int(n_prompts)

    # ---- planning ---------------------------------------------------------------------------------

    def _budget_left(self) -> int:
        (issued,) = self._con.execute("SELECT COALESCE(SUM(issued), 0) FROM dart_state").fetchall()[0]
        return self.params.budget - int(issued)

    def next_round(self) -> list[tuple[str, int]]:
        """The trials to sample now as ``(prompt_id, n_samples)``, sorted by prompt id; ``[]`` when done
        (every prompt stopped or the budget spent; or every active prompt has trials in flight)."""
        p = self.params
        r = min(p.round_size, self._budget_left())
        if r <= 0:
            return []
        need = (
            "cap_left"
            if p.strategy == "vanilla"
            else "LEAST(cap_left, GREATEST(1, CAST(CEIL((target - corrects) / "
            f"GREATEST(p_hat, {float(p.p_floor)})) AS BIGINT)))"
        )
        # Active = not stopped and nothing in flight. Stop rule: trials >= cap or corrects >= target. The
        # dart-math repo writes the second as `n_corrects > min_n_corrects` (strictly greater): the same
        # rule with min_n_corrects = target - 1.
        self._con.execute(f"""CREATE OR REPLACE TEMP TABLE dart_plan AS
            WITH active AS (
                SELECT prompt_id, fail_rate, issued, target, corrects,
                       COALESCE(cap, {int(p.budget)}) - issued AS cap_left,
                       CASE WHEN prior_n + trials > 0 THEN (prior_correct + corrects) / (prior_n + trials)
                            ELSE prior_p END AS p_hat
                FROM dart_state
                WHERE issued = trials AND issued < COALESCE(cap, {int(p.budget)})
                  AND (target IS NULL OR corrects < target)
            ), needs AS (
                SELECT prompt_id, fail_rate, issued, CAST({need} AS HUGEINT) AS need FROM active
            ), sized AS (
                SELECT *, SUM(need) OVER () AS total FROM needs
            ), scaled AS (
                SELECT *, CASE WHEN total <= {r} THEN need ELSE need * {r} // total END AS base,
                          CASE WHEN total <= {r} THEN 0 ELSE need * {r} % total END AS rem
                FROM sized
            ), ranked AS (
                SELECT *, {r} - SUM(base) OVER () AS leftover,
                       ROW_NUMBER() OVER (ORDER BY (rem > 0) DESC,
                                          CAST(issued + base AS DOUBLE) / (issued + need),
                                          rem DESC, fail_rate DESC, prompt_id) AS rk
                FROM scaled
            )
            SELECT prompt_id,
                   CAST(base + CASE WHEN rem > 0 AND rk <= leftover THEN 1 ELSE 0 END AS BIGINT) AS n
            FROM ranked WHERE base > 0 OR (rem > 0 AND rk <= leftover)""")
        self._con.execute(
            "UPDATE dart_state SET issued = dart_state.issued + pl.n FROM dart_plan pl "
            "WHERE dart_state.prompt_id = pl.prompt_id"
        )
        plan = self._con.execute("SELECT prompt_id, n FROM dart_plan ORDER BY prompt_id").fetchall()
        if plan:
            self.rounds += 1
        return [(pid, int(n)) for pid, n in plan]

    def record(self, results: Iterable[tuple[str, bool, str, int]]) -> None:
        """Record sampled trials as ``(prompt_id, correct, response_text, length)``. Every trial handed
        out should come back (a failed generation is recorded as incorrect); a prompt's trials are
        numbered (``trial_idx``) in the order they are recorded. Raises ValueError, recording nothing,
        for an unknown prompt or more results than trials handed out."""
        import polars as pl

        rows = list(results)
        if not rows:
            return
        batch = pl.DataFrame(
            {
                "prompt_id": [r[0] for r in rows],
                "correct": [bool(r[1]) for r in rows],
                "response": [r[2] for r in rows],
                "length": [r[3] for r in rows],
                "pos": range(len(rows)),
            },
            schema={
                "prompt_id": pl.Utf8,
                "correct": pl.Boolean,
                "response": pl.Utf8,
                "length": pl.Int64,
                "pos": pl.Int64,
            },
        )
        con = self._con
        con.register("dart_batch", batch.to_arrow())
        try:
            bad = con.execute("""
                SELECT b.prompt_id, COUNT(*) AS k, ANY_VALUE(s.issued - s.trials) AS pending
                FROM dart_batch b LEFT JOIN dart_state s USING (prompt_id)
                GROUP BY b.prompt_id
                HAVING ANY_VALUE(s.issued) IS NULL OR COUNT(*) > ANY_VALUE(s.issued - s.trials)
                ORDER BY b.prompt_id LIMIT 3""").fetchall()
            if bad:
                raise ValueError(
                    "dart record: results that were never handed out by next_round "
                    f"(prompt_id, results, trials in flight; pending None = unknown prompt): {bad}"
                )
            con.execute("BEGIN")
            con.execute("""INSERT INTO dart_responses
                SELECT prompt_id, response, length, trial_idx FROM (
                    SELECT b.prompt_id, b.response, b.length, b.correct, b.pos,
                           s.trials + ROW_NUMBER() OVER (PARTITION BY b.prompt_id ORDER BY b.pos) - 1
                               AS trial_idx
                    FROM dart_batch b JOIN dart_state s USING (prompt_id))
                WHERE correct ORDER BY pos""")
            con.execute("""UPDATE dart_state
                SET trials = dart_state.trials + a.k, corrects = dart_state.corrects + a.c
                FROM (SELECT prompt_id, COUNT(*) AS k, COUNT(*) FILTER (WHERE correct) AS c
                      FROM dart_batch GROUP BY prompt_id) a
                WHERE dart_state.prompt_id = a.prompt_id""")
            con.execute("COMMIT")
        finally:
            con.unregister("dart_batch")

    def run(
        self, sample: Callable[[list[tuple[str, int]]], Iterable[tuple[str, bool, str, int]]]
    ) -> pl.DataFrame:
        """Plan, sample and record rounds until done; returns ``correct_responses()``."""
        while plan := self.next_round():
            self.record(sample(plan))
        return self.correct_responses()

    # ---- results ----------------------------------------------------------------------------------

    def correct_responses(self) -> pl.DataFrame:
        """The RFT dataset: every correct response (prompt_id, response, length, trial_idx)."""
        return _polars(
            self._con,
            "SELECT prompt_id, response, length, trial_idx FROM dart_responses ORDER BY prompt_id, trial_idx",
        )

    def stats(self) -> pl.DataFrame:
        """One row per prompt: prompt_id, fail_rate, target (null for vanilla), trials (recorded),
        corrects, stopped_reason: 'target' (corrects >= target), 'max_trials' (cap reached; for
        vanilla 'quota'), 'budget' (still active when the budget ran out) or null (still active or
        trials in flight)."""
        at_cap = "quota" if self.params.strategy == "vanilla" else "max_trials"
        spent = self._budget_left() <= 0
        return _polars(
            self._con,
            f"""
            SELECT prompt_id, fail_rate, target, trials, corrects,
                   CASE WHEN target IS NOT NULL AND corrects >= target THEN 'target'
                        WHEN cap IS NOT NULL AND trials >= cap THEN '{at_cap}'
                        WHEN issued > trials THEN NULL
                        WHEN {spent} THEN 'budget' END AS stopped_reason
            FROM dart_state ORDER BY prompt_id""",
        )

    def summary(self) -> dict[str, float]:
        """Headline numbers: trials (recorded), trials_issued, budget, rounds, prompts,
        prompts_with_correct, prompts_target_reached, prompts_at_cap, rft_examples,
        mean_correct_length, yield (rft_examples / trials)."""
        s = self.stats()
        trials, issued, with_correct = self._con.execute(
            "SELECT COALESCE(SUM(trials), 0), COALESCE(SUM(issued), 0), COUNT(*) FILTER (WHERE corrects > 0) "
            "FROM dart_state"
        ).fetchall()[0]
        n_rft, mean_len = self._con.execute("SELECT COUNT(*), AVG(length) FROM dart_responses").fetchall()[0]
        return {
            "trials": float(trials),
            "trials_issued": float(issued),
            "budget": float(self.params.budget),
            "rounds": float(self.rounds),
            "prompts": float(self.n_prompts),
            "prompts_with_correct": float(with_correct),
            "prompts_target_reached": float((s["stopped_reason"] == "target").sum()),
            "prompts_at_cap": float(s["stopped_reason"].is_in(["max_trials", "quota"]).sum()),
            "rft_examples": float(n_rft),
            "mean_correct_length": float(mean_len or 0.0),
            "yield": float(n_rft) / float(trials) if trials else 0.0,
        }

    def close(self) -> None:
        self._con.close()
