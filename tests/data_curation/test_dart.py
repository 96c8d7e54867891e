import math
import random

import polars as pl
import pytest

from conf.schema import DART_STRATEGIES
from data_curation.dart import DartParams, DartPlanner, arithmetic_consistent

# true pass rate per difficulty bucket; "never" can not be solved at all
BUCKETS = {"easy": 0.9, "mid": 0.5, "hard": 0.15, "never": 0.0}


def _attempts(per_bucket: int = 40, n: int = 8) -> tuple[pl.DataFrame, dict[str, float]]:
    rows, truth = [], {}
    for bucket, p in BUCKETS.items():
        for i in range(per_bucket):
            pid = f"{bucket}-{i:03d}"
            truth[pid] = p
            k = round(p * n)  # the difficulty stage's estimate, from n samples
            rows.append((pid, n, k, k / n, 100.0, 1.0, None))
    schema = {
        "prompt_id": pl.Utf8,
        "n": pl.Int64,
        "n_correct": pl.Int64,
        "pass_rate": pl.Float64,
        "mean_length": pl.Float64,
        "mean_entropy": pl.Float64,
        "level": pl.Int32,
    }
    return pl.DataFrame(rows, schema=schema, orient="row"), truth


def _sampler(truth: dict[str, float], seed: int = 0):
    """A seeded Bernoulli per prompt with its true pass rate; responses name their prompt and draw."""
    rng = random.Random(seed)
    calls = []

    def sample(plan):
        calls.append(plan)
        out = []
        for pid, n in plan:
            for _ in range(n):
                ok = rng.random() < truth[pid]
                out.append((pid, ok, f"{pid}:{len(calls)}:{rng.random():.6f}", 5 + len(out) % 7))
        return out

    sample.calls = calls
    return sample


def _bucket_totals(planner: DartPlanner) -> dict[str, dict[str, int]]:
    st = planner.stats().with_columns(pl.col("prompt_id").str.split("-").list.first().alias("bucket"))
    agg = st.group_by("bucket").agg(pl.col("trials").sum(), pl.col("corrects").sum())
    return {
        r["bucket"]: {"trials": r["trials"], "corrects": r["corrects"]} for r in agg.iter_rows(named=True)
    }


def _run(strategy: str, seed: int = 0, **kw) -> tuple[DartPlanner, pl.DataFrame, list]:
    attempts, truth = _attempts()
    planner = DartPlanner(attempts, DartParams(strategy=strategy, **kw))
    sample = _sampler(truth, seed)
    rft = planner.run(sample)
    return planner, rft, sample.calls


@pytest.mark.parametrize("budget", [1500, 4000])  # binding (both spend it all) and ample
def test_prop2diff_gives_hard_prompts_a_larger_share_than_uniform_under_one_budget(budget):
    shares = {}
    for strategy in ("uniform", "prop2diff"):
        planner, rft, _ = _run(strategy, k_u=4, k_p=8, max_trials=32, budget=budget, round_size=512)
        assert planner.summary()["trials"] <= budget
        by_bucket = rft.with_columns(pl.col("prompt_id").str.split("-").list.first().alias("b"))[
            "b"
        ].value_counts()
        counts = dict(by_bucket.iter_rows())
        total = sum(counts.values())
        shares[strategy] = {b: counts.get(b, 0) / total for b in BUCKETS}
    # the hardest solvable bucket gets a clearly larger share, the easiest a clearly smaller one
    assert shares["prop2diff"]["hard"] > shares["uniform"]["hard"] + 0.06, shares
    assert shares["prop2diff"]["easy"] < shares["uniform"]["easy"] - 0.12, shares
    assert shares["prop2diff"]["never"] == shares["uniform"]["never"] == 0


def test_uniform_reaches_k_u_on_easy_prompts():
    planner, _, _ = _run("uniform", k_u=4, max_trials=32, budget=20000)
    easy = planner.stats().filter(pl.col("prompt_id").str.starts_with("easy"))
    assert (easy["corrects"] >= 4).all()
    assert (easy["stopped_reason"] == "target").all()
    assert (easy["target"] == 4).all()


def test_targets_follow_the_strategy():
    attempts = pl.DataFrame({"prompt_id": ["a", "b", "c", "d"], "pass_rate": [1.0, 0.75, 0.7, 0.0]})
    p2d = DartPlanner(attempts, DartParams(strategy="prop2diff", k_p=10)).stats()
    # ceil(10 * fail_rate), at least 1; 10 * (1 - 0.7) = 3.0000000000000004 must give 3, not 4
    assert p2d["target"].to_list() == [1, 3, 3, 10]
    uni = DartPlanner(attempts, DartParams(strategy="uniform", k_u=7)).stats()
    assert uni["target"].to_list() == [7, 7, 7, 7]
    van = DartPlanner(attempts, DartParams(strategy="vanilla")).stats()
    assert van["target"].to_list() == [None] * 4


def test_budget_never_exceeded_and_rounds_respect_round_size():
    for strategy in DART_STRATEGIES:
        planner, rft, calls = _run(strategy, budget=300, round_size=64, max_trials=32)
        assert all(sum(n for _, n in plan) <= 64 for plan in calls)
        s = planner.summary()
        assert s["trials"] == s["trials_issued"] <= 300
        assert planner.next_round() == []
        if strategy != "vanilla":  # far too little budget for 160 prompts: some are cut by it
            assert s["trials"] == 300
            assert "budget" in planner.stats()["stopped_reason"].to_list()
        assert s["rft_examples"] == rft.height == planner.stats()["corrects"].sum()


def test_tight_round_gives_every_prompt_a_first_trial_before_any_a_second():
    attempts, truth = _attempts(per_bucket=10)
    planner = DartPlanner(attempts, DartParams(strategy="prop2diff", budget=10_000, round_size=16))
    sample = _sampler(truth)
    given: dict[str, int] = {}
    for _ in range(40 // 16 + 1):  # 40 prompts, 16 trials a round: 3 rounds cover every prompt once
        plan = planner.next_round()
        for pid, n in plan:
            given[pid] = given.get(pid, 0) + n
        planner.record(sample(plan))
    assert len(given) == 40 and sum(given.values()) == 48
    # the 8 second trials go to the prompts whose expected need is least served: the hardest ones
    assert all(pid.startswith(("hard", "never")) for pid, n in given.items() if n > 1)


def test_hard_prompts_are_not_starved_when_needs_exceed_the_round():
    attempts, _ = _attempts(per_bucket=10)
    planner = DartPlanner(attempts, DartParams(strategy="prop2diff", k_p=8, max_trials=32, round_size=200))
    plan = dict(planner.next_round())
    assert sum(plan.values()) == 200
    assert set(plan) == set(attempts["prompt_id"])  # every prompt gets trials in the first round
    easiest = max(v for k, v in plan.items() if k.startswith("easy"))
    assert min(v for k, v in plan.items() if k.startswith(("hard", "never"))) > easiest


def test_max_trials_respected_and_unsolvable_prompts_stop_there():
    planner, rft, _ = _run("prop2diff", k_p=8, max_trials=12, budget=20000)
    st = planner.stats()
    assert st["trials"].max() <= 12
    never = st.filter(pl.col("prompt_id").str.starts_with("never"))
    assert (never["trials"] == 12).all() and (never["stopped_reason"] == "max_trials").all()
    assert (never["corrects"] == 0).all()
    assert st["stopped_reason"].null_count() == 0
    assert not rft["prompt_id"].str.starts_with("never").any()


def test_vanilla_gives_every_prompt_the_same_trials_and_keeps_every_correct():
    planner, rft, _ = _run("vanilla", budget=3000, max_trials=32, round_size=256)
    st = planner.stats()
    assert st["trials"].unique().to_list() == [3000 // 160]  # 18, under the cap of 32
    assert (st["stopped_reason"] == "quota").all()
    assert rft.height == st["corrects"].sum()
    capped, _, _ = _run("vanilla", budget=20000, max_trials=32)
    assert capped.stats()["trials"].unique().to_list() == [32]  # budget // n = 125, capped at 32


def test_correct_responses_are_the_recorded_correct_ones_with_trial_indices():
    attempts = pl.DataFrame({"prompt_id": ["a", "b"], "pass_rate": [0.5, 0.5]})
    planner = DartPlanner(attempts, DartParams(strategy="uniform", k_u=2, round_size=8))
    plan = planner.next_round()
    assert plan == [("a", 4), ("b", 4)]  # need = ceil(2 / 0.5)
    planner.record(
        [
            ("a", False, "a0", 3),
            ("b", True, "b0", 4),
            ("a", True, "a1", 5),
            ("a", True, "a2", 6),
            ("b", False, "b1", 7),
            ("a", False, "a3", 8),
            ("b", False, "b2", 9),
            ("b", False, "b3", 1),
        ]
    )
    rft = planner.correct_responses()
    assert rft.rows() == [("a", "a1", 5, 1), ("a", "a2", 6, 2), ("b", "b0", 4, 0)]
    st = planner.stats()
    assert st.select("prompt_id", "trials", "corrects", "stopped_reason").rows() == [
        ("a", 4, 2, "target"),
        ("b", 4, 1, None),
    ]
    # b needs one more correct; its p_hat is now 1/4, so it is asked for 4 more trials
    assert planner.next_round() == [("b", 4)]
    planner.record([("b", True, "b4", 2)] + [("b", False, "x", 1)] * 3)
    assert planner.correct_responses()["trial_idx"].to_list() == [1, 2, 0, 4]
    assert planner.next_round() == []


def test_record_rejects_results_never_handed_out():
    attempts = pl.DataFrame({"prompt_id": ["a"], "pass_rate": [0.5]})
    planner = DartPlanner(attempts, DartParams(strategy="uniform", k_u=1))
    with pytest.raises(ValueError, match="never handed out"):
        planner.record([("a", True, "x", 1)])
    planner.next_round()  # a gets 2 trials
    with pytest.raises(ValueError, match="never handed out"):
        planner.record([("zzz", True, "x", 1)])
    with pytest.raises(ValueError, match="never handed out"):
        planner.record([("a", True, "x", 1)] * 3)
    assert planner.correct_responses().height == 0  # a rejected batch records nothing


def test_trials_in_flight_are_not_planned_again():
    attempts = pl.DataFrame({"prompt_id": ["a", "b"], "pass_rate": [0.5, 0.5]})
    planner = DartPlanner(attempts, DartParams(strategy="uniform", k_u=2))
    assert planner.next_round() == [("a", 4), ("b", 4)]
    assert planner.next_round() == []  # nothing recorded yet: both in flight
    planner.record([("a", True, "", 1)] + [("a", False, "", 1)] * 3)
    assert planner.next_round() == [("a", 4)]  # one more correct at p_hat 1/4; b still in flight


def test_deterministic():
    a1, r1, c1 = _run("prop2diff", seed=3, budget=2000, round_size=128)
    a2, r2, c2 = _run("prop2diff", seed=3, budget=2000, round_size=128)
    assert c1 == c2
    assert r1.equals(r2) and a1.stats().equals(a2.stats())
    _, r3, _ = _run("prop2diff", seed=4, budget=2000, round_size=128)
    assert not r1.equals(r3)


def test_parquet_input_and_bad_inputs(tmp_path):
    attempts, _ = _attempts(per_bucket=2)
    path = tmp_path / "attempts.parquet"
    attempts.write_parquet(path)
    assert DartPlanner(path, DartParams()).stats().equals(DartPlanner(attempts, DartParams()).stats())
    with pytest.raises(ValueError, match="duplicate"):
        DartPlanner(pl.concat([attempts, attempts.head(1)]), DartParams())
    with pytest.raises(ValueError, match="pass_rate"):
        DartPlanner(attempts.drop("pass_rate"), DartParams())
    with pytest.raises(ValueError, match="strategy"):
        DartParams(strategy="prop2")
    with pytest.raises(ValueError, match="budget"):
        DartPlanner(attempts, DartParams(strategy="vanilla", budget=3))
    # a null pass rate comes from n_correct / n
    filled = DartPlanner(
        attempts.with_columns(pl.lit(None, pl.Float64).alias("pass_rate")), DartParams()
    ).stats()
    given = DartPlanner(attempts, DartParams()).stats()["fail_rate"].to_list()
    assert filled["fail_rate"].to_list() == pytest.approx(given)
    assert math.isclose(filled["fail_rate"][0], 1 - round(0.9 * 8) / 8)


@pytest.mark.parametrize(
    "text, ok",
    [
        ("9-5=4\n4+4=8\n8-2=6\n#### 6", True),
        ("9-5=4\n4+4=9\n9-3=6\n#### 6", False),  # a lucky answer: a false step, then a compensating one
        ("3 + 4 = 8", False),
        ("10-3-2=9", False),
        ("2*3+1=8", False),
        ("so 12×3=37 apples", False),
        ("10-3-2=5", True),
        ("2*3+1=7", True),
        ("so 12×3=36 apples", True),
        ("#### 7", True),
        ("", True),
        # not stand-alone integer arithmetic: left alone
        ("x-3+2=1", True),
        ("1.5+2=3.5", True),
        ("2^3+1=9", True),
        ("1/2+1=3", True),
        ("(2+3)=6", True),
        ("a=3+4", True),
        ("-3+5=2", True),
    ],
)
def test_arithmetic_consistent_reads_stated_integer_equations_only(text, ok):
    assert arithmetic_consistent(text) is ok
