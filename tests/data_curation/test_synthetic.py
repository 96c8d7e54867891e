import re
from collections import Counter

from data_curation.synthetic import LEVELS, MAX_TOTAL, generate, write_dataset
from rewards.verifier import Verifier


def test_deterministic_and_seed_dependent():
    a = generate(0, 500, 100, [1, 2, 3, 4, 5])
    b = generate(0, 500, 100, [1, 2, 3, 4, 5])
    c = generate(1, 500, 100, [1, 2, 3, 4, 5])
    assert a == b
    assert [p.problem for p in a[0]] != [p.problem for p in c[0]]


def test_pool_and_heldout_disjoint_and_all_levels_present():
    pool, held = generate(0, 2000, 200, [1, 2, 3, 4, 5])
    assert len(pool) == 2000 and len(held) == 200
    assert not {p.problem for p in pool} & {p.problem for p in held}
    assert len({p.prompt_id for p in pool}) == 2000
    assert set(Counter(p.level for p in held)) == {1, 2, 3, 4, 5}


def test_solutions_are_step_by_step_and_correct():
    pool, _ = generate(0, 300, 50, [1, 2, 3, 4, 5])
    with Verifier() as v:
        verdicts = v.verify_batch([p.solution for p in pool], [p.answer for p in pool])
    assert all(x.correct for x in verdicts)
    for p in pool:
        steps = p.solution.splitlines()[:-1]
        assert len(steps) == LEVELS[p.level][0]  # one line per operation
        for s in steps:
            lhs, rhs = s.split("=")
            assert eval(lhs) == int(rhs) and 0 <= int(rhs) <= MAX_TOTAL  # eval of test data we made
        expr = re.match(r"What is (.*)\?", p.problem).group(1)
        assert eval(expr) == int(p.answer)


def test_write_dataset_parquet(tmp_path):
    import polars as pl

    counts = write_dataset(tmp_path, seed=0, pool_size=100, heldout_size=20, levels=[1, 3])
    pool = pl.read_parquet(tmp_path / "pool.parquet")
    assert counts == {"pool_prompts": 100.0, "heldout_prompts": 20.0}
    assert set(pool.columns) == {
        "prompt_id",
        "problem",
        "solution",
        "answer",
        "level",
        "split",
        "demonstration",
    }
    assert set(pool["level"].unique()) == {1, 3}


def test_demonstration_slips_at_the_configured_rate_without_changing_problems():
    exact, _ = generate(0, 1000, 50, [1, 2, 3, 4, 5], demo_error_rate=0.0)
    noisy, _ = generate(0, 1000, 50, [1, 2, 3, 4, 5], demo_error_rate=0.2)
    assert [p.problem for p in exact] == [p.problem for p in noisy]
    assert [p.answer for p in exact] == [p.answer for p in noisy]
    assert all(p.demonstration == p.solution for p in exact)
    steps = slipped = 0
    for p in noisy:
        for line in p.demonstration.splitlines()[:-1]:
            lhs, rhs = line.split("=")
            steps += 1
            slipped += eval(lhs) != int(rhs)
        assert len(p.demonstration.splitlines()) == len(p.solution.splitlines())
    assert 0.17 < slipped / steps < 0.23


def test_rambling_demonstrations_only_add_restatements():
    plain, _ = generate(0, 1000, 50, [1, 2, 3, 4, 5], demo_error_rate=0.15)
    ramble, _ = generate(0, 1000, 50, [1, 2, 3, 4, 5], demo_error_rate=0.15, demo_restate_rate=0.3)
    assert [p.problem for p in plain] == [p.problem for p in ramble]
    restated = steps = 0
    for a, b in zip(plain, ramble):
        lines = b.demonstration.splitlines()
        kept = [ln for ln in lines if not ln.startswith("so the total is ")]
        assert kept == a.demonstration.splitlines()  # the slips and the answer line are untouched
        total = None
        for ln in lines[:-1]:
            if ln.startswith("so the total is "):
                assert int(ln.rsplit(" ", 1)[1]) == total  # a restatement repeats the line before it
                restated += 1
            else:
                total, steps = int(ln.split("=")[1]), steps + 1
    # a geometric count per step capped at 3: 0.3 + 0.09 + 0.027 per step
    assert 0.38 < restated / steps < 0.46
    assert generate(0, 200, 20, [1, 2], 0.15, 0.0) == generate(0, 200, 20, [1, 2], 0.15)
