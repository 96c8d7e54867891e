"""HIVE prompt selection (arXiv 2603.25184), whose stage 1 follows GRESO (Infini-AI-Lab/GRESO @ b277843).

- ``select_learning_edge``: coarse selection before RL. One SQL query over the difficulty stage's
  attempts and the reward history keeps the prompts whose estimated pass rate lies strictly inside
  ``(min_pass, max_pass)`` (the learning edge) and ranks them by uncertainty ``p * (1 - p)``.
- ``GresoFilter``: online stage 1 (GRESO's rules): skip prompts whose recent history predicts a
  zero-variance group (all correct or all wrong), with probabilities that adapt every step.
- ``prompt_entropy_keep``: stage 2: keep the candidates of highest prompt entropy (the entropy
  itself needs the policy model and is computed by the caller).

Tables: attempts (prompt_id, n, n_correct, pass_rate, ...), one row per prompt; reward history
(prompt_id, seq, mean_reward, n, origin), one row per rollout group, ``seq`` increasing in the
order of observation, ``origin`` 'difficulty' or 'rl'. Either may be a polars DataFrame or a
parquet path.
"""

from __future__ import annotations

import math
import random
import statistics
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

if TYPE_CHECKING:
    import polars as pl

REASONS = ("edge", "too_easy", "too_hard", "cut_by_max_prompts", "no_estimate")


def _register(con: Any, obj: Any, prefix: str) -> str:
    """Expose a polars DataFrame (zero-copy through Arrow) or a parquet path to SQL; returns its name."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    if isinstance(obj, (str, Path)):
        path = str(obj).replace("'", "''")
        con.execute(f"CREATE TEMP VIEW {name} AS SELECT * FROM read_parquet('{path}')")
    else:
        con.register(name, obj.to_arrow())
    return name


def _unregister(con: Any, name: str, obj: Any) -> None:
    if isinstance(obj, (str, Path)):
        con.execute(f"DROP VIEW IF EXISTS {name}")
    else:
        con.unregister(name)


def _columns(con: Any, name: str, required: set[str], what: str) -> set[str]:
    cols = {r[0] for r in con.execute(f"DESCRIBE {name}").fetchall()}
    if required - cols:
        raise ValueError(
            f"hive: the {what} table lacks column(s) {sorted(required - cols)} (it has {sorted(cols)})"
        )
    return cols


def _origin_in(origins: Sequence[str]) -> str:
    if not origins:
        return "false"
    return "origin IN (" + ", ".join("'" + str(o).replace("'", "''") + "'" for o in origins) + ")"


# ---- stage 1, before RL: the learning edge ---------------------------------------------------------


def _history_estimate_sql(h: str, cols: set[str], recent_k: int, origins: Sequence[str]) -> str:
    """Per prompt: the n-weighted mean reward of its ``recent_k`` most recent history rows of the
    given origins (latest first by seq), and the responses behind it. A window sum in seq order, so
    the float result does not depend on thread scheduling."""
    w = "CAST(COALESCE(n, 1) AS DOUBLE)" if "n" in cols else "1.0"
    where = "mean_reward IS NOT NULL"
    if "origin" in cols:
        where += f" AND {_origin_in(origins)}"
    return f"""
        SELECT prompt_id, wsum / NULLIF(wtot, 0) AS p, wtot AS n_obs FROM (
            SELECT CAST(prompt_id AS VARCHAR) AS prompt_id,
                   SUM(CAST(mean_reward AS DOUBLE) * {w}) OVER win AS wsum, SUM({w}) OVER win AS wtot,
                   ROW_NUMBER() OVER win AS rn, COUNT(*) OVER (PARTITION BY prompt_id) AS cnt
            FROM {h} WHERE {where}
            WINDOW win AS (PARTITION BY prompt_id ORDER BY seq DESC, mean_reward DESC
                           ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
        ) WHERE rn = LEAST(cnt, {int(recent_k)})"""


def select_learning_edge(
    attempts: pl.DataFrame | str | Path,
    history: pl.DataFrame | str | Path | None,
    *,
    min_pass: float = 0.0,
    max_pass: float = 1.0,
    max_prompts: int | None = None,
    recent_k: int = 4,
    history_origins: Sequence[str] = ("rl",),
    con: Any = None,
) -> pl.DataFrame:
    """HIVE stage 1 before RL: every prompt of ``attempts`` with its decision.

    Estimated pass rate per prompt: when the history holds rows of ``history_origins`` (default the
    RL rows only: the 'difficulty' rows repeat the attempts) for it, the n-weighted mean reward of
    its ``recent_k`` most recent such rows (latest by ``seq``; the policy moves, so old groups say
    less); otherwise the attempts' ``pass_rate`` (``n_correct / n`` when null). ``n_observations``
    is the number of responses behind the estimate. Prompts only in the history are ignored.

    Decision: ``pass_rate_est <= min_pass`` -> 'too_hard', ``>= max_pass`` -> 'too_easy', strictly
    inside -> 'edge' (no estimate at all -> 'no_estimate'). Edge prompts are ranked by
    ``score = p * (1 - p)`` (intermediate difficulty first), then prompt id; with ``max_prompts``
    the ones ranked below it become 'cut_by_max_prompts'.

    Returns prompt_id, pass_rate_est, score, n_observations, selected, reason, edge_rank (null off
    the edge), source ('history' | 'attempts'); edge prompts first in rank order, then the rest by
    score (desc) and prompt id. ``con``: a DuckDB connection to run on (default: a fresh in-memory one).
    """
    from data_curation.db import memory_db

    _check_edge_args(min_pass, max_pass, max_prompts, recent_k)
    own = con is None
    con = memory_db() if own else con
    a = _register(con, attempts, "hive_attempts")
    h = _register(con, history, "hive_history") if history is not None else None
    try:
        acols = _columns(con, a, {"prompt_id", "pass_rate"}, "attempts")
        if h is not None:
            hcols = _columns(con, h, {"prompt_id", "seq", "mean_reward"}, "history")
            hist = _history_estimate_sql(h, hcols, recent_k, history_origins)
        else:
            hist = (
                "SELECT CAST(NULL AS VARCHAR) AS prompt_id, CAST(NULL AS DOUBLE) AS p, "
                "CAST(NULL AS DOUBLE) AS n_obs WHERE false"
            )
        return con.sql(_learning_edge_sql(a, acols, hist, min_pass, max_pass, max_prompts)).pl()
    finally:
        _unregister(con, a, attempts)
        if h is not None:
            _unregister(con, h, history)
        if own:
            con.close()


def _check_edge_args(min_pass: float, max_pass: float, max_prompts: int | None, recent_k: int) -> None:
    if not 0.0 <= min_pass < max_pass <= 1.0:
        raise ValueError(
            f"hive: need 0 <= min_pass < max_pass <= 1, got min_pass={min_pass}, max_pass={max_pass}"
        )
    if max_prompts is not None and max_prompts < 0:
        raise ValueError(f"hive: max_prompts = {max_prompts} must be >= 0 (or None for no cut)")
    if recent_k < 1:
        raise ValueError(f"hive: recent_k = {recent_k} must be >= 1")


def _learning_edge_sql(
    a: str, acols: set[str], hist: str, min_pass: float, max_pass: float, max_prompts: int | None
) -> str:
    """The query of ``select_learning_edge`` over the attempts view ``a`` (columns ``acols``) and the
    history estimates ``hist`` (``_history_estimate_sql``): estimate, zone, edge rank, cut."""
    n = "CAST(n AS BIGINT)" if "n" in acols else "CAST(NULL AS BIGINT)"
    nc = "CAST(n_correct AS DOUBLE)" if "n_correct" in acols else "CAST(NULL AS DOUBLE)"
    cut = "NULL" if max_prompts is None else str(int(max_prompts))
    return f"""
            WITH a AS (
                SELECT CAST(prompt_id AS VARCHAR) AS prompt_id, {n} AS n,
                       COALESCE(CAST(pass_rate AS DOUBLE), {nc} / NULLIF({n}, 0)) AS p
                FROM {a}
            ), hs AS ({hist}
            ), est AS (
                SELECT a.prompt_id,
                       CASE WHEN hs.p IS NOT NULL THEN hs.p ELSE a.p END AS pass_rate_est,
                       CASE WHEN hs.p IS NOT NULL THEN CAST(hs.n_obs AS BIGINT) ELSE a.n END
                           AS n_observations,
                       CASE WHEN hs.p IS NOT NULL THEN 'history' ELSE 'attempts' END AS source
                FROM a LEFT JOIN hs USING (prompt_id)
            ), cls AS (
                SELECT *, pass_rate_est * (1.0 - pass_rate_est) AS score,
                       CASE WHEN pass_rate_est IS NULL OR isnan(pass_rate_est) THEN 'no_estimate'
                            WHEN pass_rate_est <= {float(min_pass)!r} THEN 'too_hard'
                            WHEN pass_rate_est >= {float(max_pass)!r} THEN 'too_easy'
                            ELSE 'edge' END AS zone
                FROM est
            ), ranked AS (
                SELECT *, CASE WHEN zone = 'edge' THEN ROW_NUMBER() OVER (
                              PARTITION BY zone = 'edge' ORDER BY score DESC, prompt_id) END AS edge_rank
                FROM cls
            )
            SELECT prompt_id, pass_rate_est, score, n_observations,
                   COALESCE(zone = 'edge' AND ({cut} IS NULL OR edge_rank <= {cut}), false) AS selected,
                   CASE WHEN zone = 'edge' AND edge_rank > {cut} THEN 'cut_by_max_prompts' ELSE zone END
                       AS reason,
                   edge_rank, source
            FROM ranked
            ORDER BY edge_rank NULLS LAST, score DESC NULLS LAST, prompt_id"""


# ---- stage 1, online: GRESO ----------------------------------------------------------------------


class GresoFilter:
    """Online stage 1 (GRESO): skip prompts predicted to give zero-variance groups, from their reward history.

    Per prompt, from its history of group mean rewards (latest last):
    - easy: ``count`` = the most recent consecutive entries with mean >= ``easy_threshold``; if
      ``count > 0``, ``skip_prob = 1 - max(p_easy ** count, min_keep)``;
    - otherwise hard, only if the latest mean <= ``hard_threshold``: ``count`` = the most recent
      consecutive entries <= ``hard_threshold``, ``skip_prob = 1 - max(p_hard ** count, min_keep)``;
    - no history (or neither case): never skipped.
    ``end_step`` moves ``p_easy`` / ``p_hard`` by ``step_size`` within ``bounds``: down (skip more)
    when that kind's observed zero-variance ratio is at or above its target, up otherwise.

    Only the two run lengths per prompt are kept (they are all the rules read), computed once in
    SQL from ``history`` (rows of ``origins``; default all: the difficulty stage's groups are
    observations too) and updated in O(1) by ``observe``. Save ``p_easy`` and ``p_hard`` with a
    checkpoint: the history alone does not restore them.
    """

    def __init__(
        self,
        history: pl.DataFrame | str | Path | None = None,
        *,
        p_easy: float = 0.5,
        p_hard: float = 0.5,
        easy_threshold: float = 0.98,
        hard_threshold: float = 0.11,
        target_easy: float = 0.25 / 3,
        target_hard: float = 0.25 * 2 / 3,
        step_size: float = 0.01,
        bounds: tuple[float, float] = (0.05, 0.95),
        min_keep: float = 0.01,
        origins: Sequence[str] | None = None,
    ):
        lo, hi = bounds
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"greso bounds {bounds} must satisfy 0 <= low <= high <= 1")
        for name, v in (("p_easy", p_easy), ("p_hard", p_hard)):
            if not lo <= v <= hi:
                raise ValueError(f"greso {name} = {v} lies outside bounds {bounds}")
        if hard_threshold >= easy_threshold:
            raise ValueError(
                f"greso hard_threshold ({hard_threshold}) must be below easy_threshold ({easy_threshold})"
            )
        self.p_easy, self.p_hard = float(p_easy), float(p_hard)
        self.easy_threshold, self.hard_threshold = float(easy_threshold), float(hard_threshold)
        self.target_easy, self.target_hard = float(target_easy), float(target_hard)
        self.step_size, self.bounds, self.min_keep = float(step_size), (float(lo), float(hi)), float(min_keep)
        # prompt_id -> (easy run, hard run); prompts with both runs 0 are left out
        self._runs: dict[str, tuple[int, int]] = {}
        self._observed: list[dict] = []
        if history is not None:
            self._runs = self._load_runs(history, origins)

    def _load_runs(self, history: Any, origins: Sequence[str] | None) -> dict[str, tuple[int, int]]:
        from data_curation.db import memory_db

        con = memory_db()
        try:
            h = _register(con, history, "greso_history")
            cols = _columns(con, h, {"prompt_id", "seq", "mean_reward"}, "history")
            where = ""
            if origins is not None and "origin" in cols:
                where = f"WHERE {_origin_in(origins)}"
            # run length from the latest entry = (first rank, latest first, that breaks the run) - 1;
            # a null or NaN reward breaks both runs
            easy = f"COALESCE(r >= {self.easy_threshold!r} AND NOT isnan(r), false)"
            hard = f"COALESCE(r <= {self.hard_threshold!r} AND NOT isnan(r), false)"
            rows = con.sql(f"""
                SELECT prompt_id,
                       COALESCE(MIN(rn) FILTER (WHERE NOT {easy}), COUNT(*) + 1) - 1 AS easy_run,
                       COALESCE(MIN(rn) FILTER (WHERE NOT {hard}), COUNT(*) + 1) - 1 AS hard_run
                FROM (SELECT CAST(prompt_id AS VARCHAR) AS prompt_id, CAST(mean_reward AS DOUBLE) AS r,
                             ROW_NUMBER() OVER (PARTITION BY prompt_id ORDER BY seq DESC) AS rn
                      FROM {h} {where})
                GROUP BY prompt_id HAVING easy_run > 0 OR hard_run > 0""").fetchall()
            _unregister(con, h, history)
        finally:
            con.close()
        return {pid: (int(e), int(k)) for pid, e, k in rows}

    def runs(self, prompt_id: str) -> tuple[int, int]:
        """(easy run, hard run): the most recent consecutive entries at/above the easy threshold and
        at/below the hard threshold."""
        return self._runs.get(prompt_id, (0, 0))

    def skip_probability(self, prompt_id: str) -> float:
        easy, hard = self._runs.get(prompt_id, (0, 0))
        if easy > 0:  # easy check first
            return 1.0 - max(self.p_easy**easy, self.min_keep)
        if hard > 0:  # the latest mean is <= hard_threshold
            return 1.0 - max(self.p_hard**hard, self.min_keep)
        return 0.0

    def filter(self, prompt_ids: Sequence[str], rng: random.Random) -> tuple[list[str], list[str]]:
        """(kept, skipped), each in input order. One ``rng.random()`` draw per prompt, skipped or not,
        so the stream a seeded rng yields does not depend on the history."""
        kept, skipped = [], []
        for pid in prompt_ids:
            (skipped if rng.random() < self.skip_probability(pid) else kept).append(pid)
        return kept, skipped

    def observe(self, prompt_id: str, mean_reward: float) -> None:
        """Append one rollout group's mean reward to the prompt's history."""
        r = float(mean_reward)
        if math.isnan(r):
            raise ValueError(f"greso observe: mean_reward of {prompt_id!r} is NaN")
        easy, hard = self._runs.get(prompt_id, (0, 0))
        runs = (easy + 1 if r >= self.easy_threshold else 0, hard + 1 if r <= self.hard_threshold else 0)
        if runs == (0, 0):
            self._runs.pop(prompt_id, None)
        else:
            self._runs[prompt_id] = runs
        self._observed.append({"prompt_id": prompt_id, "mean_reward": r})

    def end_step(self, easy_zero_var_ratio: float, hard_zero_var_ratio: float) -> None:
        """Adapt after a training step. Ratios: the fraction of this step's rolled-out groups whose
        rewards were all at the maximum (easy) / all at the minimum (hard)."""
        self.p_easy = self._adapt(self.p_easy, easy_zero_var_ratio, self.target_easy)
        self.p_hard = self._adapt(self.p_hard, hard_zero_var_ratio, self.target_hard)

    def _adapt(self, p: float, ratio: float, target: float) -> float:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"greso end_step: a zero-variance ratio must lie in [0, 1], got {ratio}")
        p = p - self.step_size if ratio >= target else p + self.step_size
        lo, hi = self.bounds
        return min(hi, max(lo, round(p, 12)))  # round: 0.5 - 0.01 * 3 stays 0.47, not 0.47000000000000003

    def history_rows(self) -> list[dict]:
        """The rows observed since construction, in order: {prompt_id, mean_reward}."""
        return [dict(r) for r in self._observed]

    def state(self) -> dict:
        """What a checkpoint needs to continue exactly (JSON): the adapted skip bases, every prompt's
        run lengths and the rows observed so far."""
        return {
            "p_easy": self.p_easy,
            "p_hard": self.p_hard,
            "runs": {pid: list(r) for pid, r in sorted(self._runs.items())},
            "observed": [dict(r) for r in self._observed],
        }

    def load_state(self, state: dict) -> None:
        self.p_easy, self.p_hard = float(state["p_easy"]), float(state["p_hard"])
        self._runs = {pid: (int(e), int(h)) for pid, (e, h) in state["runs"].items()}
        self._observed = [dict(r) for r in state["observed"]]


# ---- stage 2, online: prompt entropy ---------------------------------------------------------------


def _check(entropies: Sequence[float]) -> list[float]:
    xs = [float(e) for e in entropies]
    if any(math.isnan(x) for x in xs):
        raise ValueError(
            "prompt_entropy_keep: an entropy is NaN; compute it over at least two prompt positions"
        )
    return xs


def _keep_median(xs: list[float]) -> list[bool]:
    med = statistics.median(xs)
    return [x >= med for x in xs]


def _keep_paper(xs: list[float], drop_top: float = 0.25, keep: float = 0.5) -> list[bool]:
    order = sorted(range(len(xs)), key=lambda i: (-xs[i], i))  # entropy desc, ties by position
    n_drop = math.floor(len(xs) * drop_top)
    n_keep = min(len(xs) - n_drop, max(1, math.floor(len(xs) * keep)))
    out = [False] * len(xs)
    for i in order[n_drop : n_drop + n_keep]:
        out[i] = True
    return out


_ENTROPY_RULES: dict[str, Callable[[list[float]], list[bool]]] = {
    "median": _keep_median,
    "paper": _keep_paper,
}


def prompt_entropy_keep(entropies: Sequence[float], rule: str = "median") -> list[bool]:
    """HIVE stage 2: which candidates to keep, by prompt entropy.

    - 'median' (default): keep candidates with entropy >= the median of the pool (mean of the two
      middle values for an even pool; every tie with the median is kept).
    - 'paper' (the appendix): sort by entropy descending (ties by position), drop the top
      ``floor(n/4)`` and keep the next ``max(1, floor(n/2))``.
    """
    if rule not in _ENTROPY_RULES:
        raise ValueError(
            f"prompt_entropy_keep: rule {rule!r} is unknown: use one of {', '.join(_ENTROPY_RULES)}"
        )
    xs = _check(entropies)
    return _ENTROPY_RULES[rule](xs) if xs else []
