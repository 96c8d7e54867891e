import random

import polars as pl
import pytest

from data_curation.hive import GresoFilter, prompt_entropy_keep, select_learning_edge

HISTORY_SCHEMA = {
    "prompt_id": pl.Utf8,
    "seq": pl.Int64,
    "mean_reward": pl.Float64,
    "n": pl.Int64,
    "origin": pl.Utf8,
}


def _attempts(rows):
    """rows: (prompt_id, n, n_correct)."""
    return pl.DataFrame(
        [(pid, n, k, k / n, 50.0, 1.0, 1) for pid, n, k in rows],
        schema={
            "prompt_id": pl.Utf8,
            "n": pl.Int64,
            "n_correct": pl.Int64,
            "pass_rate": pl.Float64,
            "mean_length": pl.Float64,
            "mean_entropy": pl.Float64,
            "level": pl.Int32,
        },
        orient="row",
    )


def _history(rows):
    """rows: (prompt_id, seq, mean_reward, n, origin)."""
    return pl.DataFrame(rows, schema=HISTORY_SCHEMA, orient="row")


# ---- select_learning_edge -----------------------------------------------------------------------


def _by_id(df):
    return {r["prompt_id"]: r for r in df.iter_rows(named=True)}


def test_attempts_only_zero_half_full():
    out = _by_id(select_learning_edge(_attempts([("a", 4, 0), ("b", 4, 2), ("c", 4, 4)]), None))
    assert out["a"]["reason"] == "too_hard" and not out["a"]["selected"]
    assert out["b"]["reason"] == "edge" and out["b"]["selected"]
    assert out["c"]["reason"] == "too_easy" and not out["c"]["selected"]
    assert out["b"]["pass_rate_est"] == 0.5 and out["b"]["score"] == 0.25 and out["b"]["n_observations"] == 4
    assert out["a"]["score"] == 0.0 and out["a"]["source"] == "attempts"


def test_history_rl_rows_override_attempts():
    attempts = _attempts([("a", 4, 0), ("b", 4, 2), ("c", 4, 4)])
    history = _history(
        [
            ("a", 1, 0.0, 4, "difficulty"),
            ("a", 10, 0.25, 8, "rl"),  # a: was too hard, now on the edge
            ("b", 2, 0.5, 4, "difficulty"),
            ("b", 11, 1.0, 8, "rl"),
            ("b", 20, 1.0, 8, "rl"),  # b: solved now
            ("c", 3, 1.0, 4, "difficulty"),  # c: no rl rows -> attempts
            ("zzz", 5, 0.5, 8, "rl"),  # not in attempts: ignored
        ]
    )
    out = select_learning_edge(attempts, history)
    assert out["prompt_id"].to_list() == ["a", "b", "c"]
    rows = _by_id(out)
    assert (
        rows["a"]["pass_rate_est"] == 0.25
        and rows["a"]["reason"] == "edge"
        and rows["a"]["source"] == "history"
    )
    assert rows["a"]["n_observations"] == 8
    assert rows["b"]["reason"] == "too_easy" and rows["b"]["n_observations"] == 16
    assert rows["c"]["source"] == "attempts" and rows["c"]["reason"] == "too_easy"


def test_history_uses_the_most_recent_k_rows_weighted_by_n():
    attempts = _attempts([("a", 4, 2)])
    history = _history(
        [("a", 1, 0.0, 8, "rl"), ("a", 7, 1.0, 4, "rl"), ("a", 3, 0.5, 8, "rl"), ("a", 5, 0.25, 8, "rl")]
    )

    def est(k: int) -> float:
        return select_learning_edge(attempts, history, recent_k=k)["pass_rate_est"][0]

    assert est(1) == 1.0  # latest by seq, not by position
    assert est(2) == pytest.approx((1.0 * 4 + 0.25 * 8) / 12)
    assert est(3) == pytest.approx((1.0 * 4 + 0.25 * 8 + 0.5 * 8) / 20)
    assert est(10) == pytest.approx((1.0 * 4 + 0.25 * 8 + 0.5 * 8 + 0.0) / 28)


def test_max_prompts_cut_and_ordering():
    attempts = _attempts(
        [("e", 8, 1), ("d", 8, 6), ("c", 8, 4), ("b", 8, 2), ("a", 8, 8), ("f", 8, 0), ("g", 8, 6)]
    )
    out = select_learning_edge(attempts, None, max_prompts=3)
    # edge ranked by p(1-p) desc then prompt_id: c (0.25), then b/d/g tie at 0.1875, then e (0.109)
    assert out["prompt_id"].to_list() == ["c", "b", "d", "g", "e", "a", "f"]
    assert out["edge_rank"].to_list()[:5] == [1, 2, 3, 4, 5]
    assert out["reason"].to_list() == ["edge"] * 3 + ["cut_by_max_prompts"] * 2 + ["too_easy", "too_hard"]
    assert out["selected"].to_list() == [True] * 3 + [False] * 4
    assert out.filter(pl.col("selected")).height == 3
    uncut = select_learning_edge(attempts, None)
    assert uncut["selected"].sum() == 5 and uncut["reason"].null_count() == 0


def test_custom_band_is_strict():
    attempts = _attempts([("a", 10, 2), ("b", 10, 3), ("c", 10, 8), ("d", 10, 9)])
    out = _by_id(select_learning_edge(attempts, None, min_pass=0.2, max_pass=0.9))
    assert [out[k]["reason"] for k in "abcd"] == ["too_hard", "edge", "edge", "too_easy"]


def test_parquet_inputs_and_a_given_connection(tmp_path):
    import duckdb

    attempts = _attempts([("a", 4, 1), ("b", 4, 2)])
    history = _history([("a", 1, 0.5, 4, "rl")])
    attempts.write_parquet(tmp_path / "a.parquet")
    history.write_parquet(tmp_path / "h.parquet")
    con = duckdb.connect()
    out = select_learning_edge(str(tmp_path / "a.parquet"), tmp_path / "h.parquet", con=con)
    assert out.equals(select_learning_edge(attempts, history))
    assert con.sql("SELECT COUNT(*) FROM duckdb_views() WHERE NOT internal").fetchall() == [
        (0,)
    ]  # cleaned up


# ---- GresoFilter --------------------------------------------------------------------------------


def _greso(rows, **kw):
    return GresoFilter(_history([(pid, seq, r, 8, "rl") for pid, seq, r in rows]), **kw)


def test_greso_skip_probabilities_by_hand():
    g = _greso(
        [
            ("easy3", 1, 0.5),
            ("easy3", 2, 1.0),
            ("easy3", 3, 0.99),
            ("easy3", 4, 1.0),  # 3 consecutive easy
            ("easy1", 1, 1.0),
            ("easy1", 2, 0.5),
            ("easy1", 3, 1.0),  # only the latest
            ("hard2", 1, 0.0),
            ("hard2", 2, 0.1),
            ("hard2", 3, 0.0),  # 3 consecutive hard
            ("recovered", 1, 0.0),
            ("recovered", 2, 0.0),
            ("recovered", 3, 0.5),  # latest above hard
            ("mixed", 3, 1.0),
            ("mixed", 1, 0.0),
            ("mixed", 2, 0.0),  # order by seq: latest easy
            *[("long", i, 1.0) for i in range(12)],  # 12 easy: floor
        ]
    )
    assert g.skip_probability("easy3") == pytest.approx(1 - 0.5**3)  # 0.875
    assert g.skip_probability("easy1") == pytest.approx(0.5)
    assert g.skip_probability("hard2") == pytest.approx(1 - 0.5**3)
    assert g.skip_probability("recovered") == 0.0
    assert g.skip_probability("mixed") == pytest.approx(0.5)
    assert g.skip_probability("long") == pytest.approx(0.99)  # 1 - max(0.5 ** 12, 0.01)
    assert g.skip_probability("never-seen") == 0.0
    assert g.runs("hard2") == (0, 3)


def test_greso_thresholds_are_inclusive_and_p_applies_per_kind():
    g = _greso([("e", 1, 0.98), ("h", 1, 0.11), ("x", 1, 0.9799), ("y", 1, 0.1101)], p_easy=0.9, p_hard=0.2)
    assert g.skip_probability("e") == pytest.approx(0.1)
    assert g.skip_probability("h") == pytest.approx(0.8)
    assert g.skip_probability("x") == 0.0 and g.skip_probability("y") == 0.0


def test_greso_observe_updates_the_history():
    g = GresoFilter()
    assert g.skip_probability("a") == 0.0  # no history: never skipped
    g.observe("a", 1.0)
    g.observe("a", 1.0)
    assert g.skip_probability("a") == pytest.approx(0.75)
    g.observe("a", 0.5)
    assert g.skip_probability("a") == 0.0
    g.observe("a", 0.0)
    assert g.skip_probability("a") == pytest.approx(0.5)
    assert g.history_rows() == [{"prompt_id": "a", "mean_reward": r} for r in (1.0, 1.0, 0.5, 0.0)]
    # observations continue a loaded history
    h = _greso([("b", 1, 1.0)])
    h.observe("b", 1.0)
    assert h.skip_probability("b") == pytest.approx(0.75)


def test_greso_p_adaptation_direction_and_bounds():
    g = GresoFilter()
    g.end_step(easy_zero_var_ratio=0.25 / 3, hard_zero_var_ratio=0.0)  # at target -> down; below -> up
    assert (g.p_easy, g.p_hard) == (0.49, 0.51)
    g.end_step(0.0, 0.5)
    assert (g.p_easy, g.p_hard) == (0.5, 0.5)
    for _ in range(100):
        g.end_step(1.0, 0.0)
    assert (g.p_easy, g.p_hard) == (0.05, 0.95)
    g.end_step(0.0, 1.0)
    assert (g.p_easy, g.p_hard) == (0.06, 0.94)
    g.observe("a", 1.0)
    assert g.skip_probability("a") == pytest.approx(0.94)  # skip more when easy groups keep coming back


def test_greso_filter_is_deterministic_with_a_seeded_rng():
    g = _greso([(f"p{i}", 1, 1.0 if i % 3 == 0 else (0.0 if i % 3 == 1 else 0.5)) for i in range(300)])
    ids = [f"p{i}" for i in range(300)] + ["unseen"]
    kept, skipped = g.filter(ids, random.Random(7))
    assert (kept, skipped) == g.filter(ids, random.Random(7))
    assert sorted(kept + skipped) == sorted(ids) and kept == [p for p in ids if p in set(kept)]
    assert not {f"p{i}" for i in range(2, 300, 3)} & set(skipped)  # mean 0.5: never skipped
    assert "unseen" in kept
    assert 60 < len(skipped) < 140  # 200 prompts at skip probability 0.5


def test_greso_origins_filter():
    h = _history([("a", 1, 1.0, 8, "difficulty"), ("a", 2, 1.0, 8, "rl")])
    assert GresoFilter(h).skip_probability("a") == pytest.approx(0.75)
    assert GresoFilter(h, origins=["rl"]).skip_probability("a") == pytest.approx(0.5)


# ---- prompt_entropy_keep ------------------------------------------------------------------------


def test_entropy_median_rule():
    assert prompt_entropy_keep([0.1, 0.5, 0.3, 0.9, 0.7]) == [False, True, False, True, True]  # median 0.5
    assert prompt_entropy_keep([4.0, 1.0, 2.0, 3.0]) == [True, False, False, True]  # median 2.5
    assert prompt_entropy_keep([1.0, 1.0, 1.0]) == [True, True, True]  # ties kept
    assert prompt_entropy_keep([]) == []


def test_entropy_paper_rule():
    xs = [0.8, 0.1, 0.7, 0.2, 0.6, 0.3, 0.5, 0.4]
    # descending: .8 .7 | .6 .5 .4 .3 | .2 .1 -> drop the top 2, keep the next 4
    assert prompt_entropy_keep(xs, "paper") == [False, False, False, False, True, True, True, True]
    # ties resolved by position: the top 1 of 4 dropped, the next 2 kept
    assert prompt_entropy_keep([1.0, 1.0, 1.0, 1.0], "paper") == [False, True, True, False]
    assert prompt_entropy_keep([0.3], "paper") == [True]
    with pytest.raises(ValueError, match="rule"):
        prompt_entropy_keep([1.0], "mean")
