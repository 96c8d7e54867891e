"""The judge's parts (``environments.judge``): the plain-data codec, tests read as input/output
pairs, and the rounds between the program's run and the fresh check run on tests of other shapes."""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, namedtuple

import pytest

from environments.code import CodeSpec
from environments.judge import Judgement, judge, plain
from environments.judge.pairs import Expect, defined_names, pair_test
from environments.judge.rounds import Failed, read_results
from environments.sandbox import BubblewrapBackend
from evaluation.code_benchmarks import load_humaneval


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -3,
        2**80,
        1.5,
        "é\n",
        b"\x00\xff",
        2 + 3j,
        [1, [2.0, "x"]],
        (1, (2,)),
        {"a": 1, (1, 2): [3]},
        {1, 2},
        frozenset({"a"}),
        [],
        (),
        {},
    ],
)
def test_plain_data_round_trips_with_its_exact_types(value):
    back = plain.decode(plain.encode(value))
    assert back == value and type(back) is type(value)


def test_non_finite_floats_round_trip():
    back = plain.decode(plain.encode([math.inf, -math.inf, math.nan]))
    assert back[:2] == [math.inf, -math.inf] and math.isnan(back[2])


def test_subclasses_of_plain_types_are_coerced_to_their_base():
    Point = namedtuple("Point", "x y")

    class Loud(int):
        def __eq__(self, other):
            return True

    got = plain.decode(plain.encode([Counter("aab"), OrderedDict(b=1), Point(1, 2), Loud(7), True]))
    assert got == [{"a": 2, "b": 1}, {"b": 1}, (1, 2), 7, True]
    assert [type(x) for x in got] == [dict, dict, tuple, int, bool]


@pytest.mark.parametrize("value", [lambda: 0, iter([1]), object(), [1, print], {"k": range(3)}])
def test_anything_else_is_not_plain(value):
    with pytest.raises(plain.NotPlain):
        plain.encode(value)


def test_too_deep_or_unknown_data_is_refused():
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(plain.NotPlain, match="too_deep"):
        plain.encode(deep)
    for bad in [{"eq_any": True}, {"t": 1}, {"f": "1e5"}, {"d": [[[1], 2]]}, {"s": [[1]]}, {"a": 1, "b": 2}]:
        with pytest.raises(ValueError):
            plain.decode(bad)


def test_result_lines_are_read_as_data_the_first_record_of_each_call_counting():
    out = "junk\n{'i': 1, 'v': 5}\n{'i': 1, 'v': 6}\n__import__('os')\n{'i': 7, 'v': 1}\n"
    out += "{'i': 0, 'raised': 'X'}\n{'i': 2, 'v': {'eq_any': 1}}\n"
    assert read_results(out.rsplit("{'i': 2", 1)[0], 3) == [{"raised": "X"}, {"v": 5}, {"raised": "NoResult"}]
    with pytest.raises(Failed, match="bad_result"):
        read_results(out, 3)


PREFIX = 'def helper(x):\n    return x + 1\n\ndef f(x):\n    """doc"""\n'


@pytest.mark.parametrize(
    "src, expects",
    [
        ("assert f(1) == 2", [Expect(0, "eq", 2)]),
        ("assert 2 == f(1)", [Expect(0, "eq", 2)]),
        ("assert f(1, k=[2]) != (3,)", [Expect(0, "ne", (3,))]),
        ("assert f('a')\nassert not f('')", [Expect(0, "truthy"), Expect(1, "falsy")]),
        ("assert f(0) is None", [Expect(0, "is", None)]),
        ("assert abs(f(2.0) - 3.5) < 1e-6", [Expect(0, "close_lt", (3.5, 1e-6))]),
        ("assert f(3 * 19) == [3, 19 - 0]", [Expect(0, "eq", [3, 19])]),
        ("assert abs(f(1) - 2.0 / 4.0) <= 1e-6", [Expect(0, "close_le", (0.5, 1e-6))]),
        ("assert tuple(f([1])) == tuple([1, 2])", [Expect(0, "eq", (1, 2), "tuple")]),
        ("assert f('ab' + 'c', k=-(2 ** 3)) == {'n': 1 ** 0}", [Expect(0, "eq", {"n": 1})]),
        (
            "METADATA = {}\ndef check(c):\n    import math\n    assert True\n    assert c(-1) == 0\ncheck(f)",
            None,
        ),
    ],
)
def test_asserts_on_one_call_with_literal_arguments_are_pairs(src, expects):
    got = pair_test(src, "f", defined_names(PREFIX))
    assert got is not None
    if expects is not None:
        assert list(got.expects) == expects
    else:
        assert got.calls == (("f", [-1], {}),) and got.expects == (Expect(0, "eq", 0),)


@pytest.mark.parametrize(
    "src",
    [
        "assert helper(f(1)) == 3",
        "assert helper(1) == 2",
        "for x in range(3):\n    assert f(x) == x + 1",
        "x = 3\nassert f(x) == 4",
        "assert f(1) == f(2)",
        "assert f(1) < 3",
        "assert f(1) is 3",
        "assert f(*[1]) == 2",
        "assert f('a' * 100000) == 1",
        "assert f(2 ** 1000) == 1",
        "assert tuple(sorted(f(1))) == ()",
        "assert sorted(helper(1)) == [2]",
        "def check(c):\n    assert c(1) == 2\ncheck(f)\ncheck(f)",
    ],
)
def test_other_shapes_are_not_pairs(src):
    assert pair_test(src, "f", defined_names(PREFIX)) is None


def test_humaneval_has_156_tests_as_pairs():
    specs = [CodeSpec.from_answer(it.answer) for it in load_humaneval()]
    pairs = [pair_test(s.tests[0], s.entry_point, defined_names(s.prefix)) for s in specs]
    assert len(specs) == 164 and sum(p is not None for p in pairs) == 156


@pytest.fixture
def bwrap():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


def spec(*tests: str, prefix: str = PREFIX) -> CodeSpec:
    return CodeSpec(tuple(tests), "f", prefix)


def test_a_test_whose_calls_depend_on_results_resolves_round_by_round(bwrap):
    chain = (
        "def check(c):\n    x = 1\n    for _ in range(3):\n        x = c(x)\n    assert x == 8\ncheck(f)\n"
    )
    assert judge("    return 2 * x\n", spec(chain), 10) == Judgement(1, 1)
    assert judge("    return 3 * x\n", spec(chain), 10).passed == 0


def test_the_prefix_helpers_run_in_the_check_process_not_the_program(bwrap):
    test = "def check(c):\n    y = c(4)\n    assert helper(y) == 9\ncheck(f)\n"
    cheat = "    return 4\ndef helper(x):\n    return 9\n"  # redefining the helper changes nothing
    assert judge("    return 2 * x\n", spec(test), 10).passed == 1
    assert judge(cheat, spec(test), 10).passed == 0


def test_the_programs_exceptions_reach_the_test_by_builtin_type_only(bwrap):
    test = "def check(c):\n    try:\n        c(-1)\n    except ValueError:\n        return\n"
    test += "    assert False\ncheck(f)\n"
    assert judge("    raise ValueError('no')\n", spec(test), 10).passed == 1
    assert judge("    raise SystemExit(0)\n", spec(test), 10).passed == 0
    assert judge("    return 0\n", spec(test), 10).passed == 0


def test_pass_fraction_counts_tests_and_an_unseeded_random_test_still_decides(bwrap):
    rnd = "import random\ndef check(c):\n    for _ in range(5):\n        x = random.randint(0, 99)\n"
    rnd += "        assert c(x) == x + 1\ncheck(f)\n"
    got = judge("    return x + 1\n", spec("assert f(1) == 2", "assert f(2) == 4", rnd), 10)
    assert got == Judgement(2, 3)


def test_a_wrapped_result_is_compared_after_the_wrap_on_plain_data(bwrap):
    test = "assert tuple(f(3)) == (0, 1, 2)"
    assert judge("def f(n):\n    return list(range(n))\n", spec(test, prefix=""), 10) == Judgement(1, 1)
    loud = "class L(list):\n    def __eq__(s, o):\n        return True\ndef f(n):\n    return L([9])\n"
    assert judge(loud, spec(test, prefix=""), 10) == Judgement(0, 1)


def test_a_test_leaning_on_the_programs_import_of_a_standard_module_still_runs(bwrap):
    test = "assert math.isclose(f(2), 2.5, rel_tol=1e-9)"
    assert judge("import math\ndef f(x):\n    return x + 0.5\n", spec(test, prefix=""), 10) == Judgement(1, 1)
