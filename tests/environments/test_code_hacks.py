"""``code_tests`` against a hostile program: each hack class that scored 1.0 for a wrong program when
the program and its tests shared one process (always-equal objects, patched builtins, a nonce read
from ``main.py`` or a frame, a forged report at exit, the tests or their answers read or rewritten
through the harness's frames) scores 0 now that the program only computes and a checker outside it
compares; a result that is not plain data is an error with its reason; correct programs still pass;
and the run's sandbox settings reach ``code_tests`` built from config, tools and evaluation."""

from __future__ import annotations

import pytest

from conf.loader import load_config
from conf.schema import CodeTestsParams
from environments.code import CodeSpec, CodeTests
from environments.sandbox import BubblewrapBackend
from rewards.components import Sample
from rewards.compose import Reward
from rewards.verifier import Verdict

PAIRS = CodeSpec(("assert add(1, 2) == 3", "assert add(-1, 2) == 1", "assert add(2, 2) == 4"), "add")
"""Tests that read as input/output pairs (checked outside, no test code runs)."""
CHECK = CodeSpec(
    (
        "def check(candidate):\n"
        "    for x, y in [(1, 3), (-1, 1), (2, 4)]:\n"
        "        assert candidate(x, y - x) == y\n"
        "check(add)\n",
    ),
    "add",
    'def add(a, b):\n    """a + b"""\n',
)
"""A HumanEval-shaped test with a loop (run in the fresh check process, on the program's results)."""
SPECS = {"pairs": PAIRS, "check": CHECK}
RIGHT = "def add(a, b):\n    return a + b\n"

FIND_NONCE = (
    "import ast, re\n"
    "_src = open('main.py').read()\n"
    "NONCE = re.search(r\"print\\('([0-9a-f]{32})'\", _src).group(1)\n"
    "TOTAL = len(ast.literal_eval(re.search(r'^tests = (.*)$', _src, re.M).group(1)))\n"
)
"""What a program reads of the old harness's ``main.py``: the report's nonce and the test count."""

HACKS = {
    "always_equal": (
        "class Anything:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b):\n"
        "    return Anything()\n"
    ),
    "int_subclass_always_equal": (
        "class Int(int):\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n"
        "    return Int(7)\n"
    ),
    "list_subclass_always_equal": (
        "class L(list):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return L([0])\n"
    ),
    "patched_compile": (
        "import builtins\n"
        "_compile = builtins.compile\n"
        "builtins.compile = lambda src, name, mode, *a, **k: _compile('pass', name, mode)\n"
        "def add(a, b):\n"
        "    return 0\n"
    ),
    "patched_exec": ("import builtins\nbuiltins.exec = lambda *a, **k: None\ndef add(a, b):\n    return 0\n"),
    "patched_print": (
        "import builtins, sys\n"
        "_print = builtins.print\n"
        "def forged(*a, **k):\n"
        "    if len(a) == 3 and not k:\n"
        "        sys.__stdout__.write(f'{a[0]} {a[2]} {a[2]}\\n')\n"
        "    else:\n"
        "        _print(*a, **k)\n"
        "builtins.print = forged\n"
        "def add(a, b):\n"
        "    return 0\n"
    ),
    "patched_len": "import builtins\nbuiltins.len = lambda x: 0\ndef add(a, b):\n    return 0\n",
    "nonce_from_main": FIND_NONCE + "import os\nprint(NONCE, TOTAL, TOTAL, flush=True)\nos._exit(0)\n",
    "nonce_from_frame": (
        "import os, sys\n"
        "_f = sys._getframe(1)\n"
        "_strs = [c for c in _f.f_code.co_consts if isinstance(c, str)]\n"
        "_nonce = [c for c in _strs if len(c) == 32 and all(x in '0123456789abcdef' for x in c)][0]\n"
        "_tuples = [c for c in _f.f_code.co_consts if isinstance(c, tuple)]\n"
        "_n = len(_tuples[0]) if _tuples else sum('assert' in c or 'check' in c for c in _strs)\n"
        "print(_nonce, _n, _n, flush=True)\n"
        "os._exit(0)\n"
    ),
    "atexit_report": FIND_NONCE
    + (
        "import atexit\n"
        "atexit.register(lambda: print(NONCE, TOTAL, TOTAL, flush=True))\n"
        "def add(a, b):\n"
        "    return 0\n"
    ),
    "del_report": FIND_NONCE
    + (
        "import os, sys\n"
        "class Ghost:\n"
        "    def __del__(self, w=os.write, line=f'{NONCE} {TOTAL} {TOTAL}\\n'.encode()):\n"
        "        w(1, line)\n"
        "sys.ghost = Ghost()\n"
        "def add(a, b):\n"
        "    return 0\n"
    ),
    "rewrite_tests_and_tally": (
        "import sys\n"
        "def add(a, b):\n"
        "    f = sys._getframe(1)\n"
        "    while f is not None and not {'tests', 'passed'} <= set(f.f_globals):\n"
        "        f = f.f_back\n"
        "    if f is not None and not getattr(sys, 'done', False):\n"
        "        sys.done = True\n"
        "        g = f.f_globals\n"
        "        i = next(k for k, t in enumerate(g['tests']) if f.f_locals.get('t') is t)\n"
        "        g['tests'][i + 1 :] = ['pass'] * (len(g['tests']) - i - 1)\n"
        "        g['passed'] = i + 1\n"
        "    return 0\n"
    ),
    "answers_from_harness": (
        "import ast, sys\n"
        "def add(*args):\n"
        "    f = sys._getframe(1)\n"
        "    if 'y' in f.f_locals:\n"
        "        return f.f_locals['y']\n"
        "    while f is not None and 'tests' not in f.f_globals:\n"
        "        f = f.f_back\n"
        "    for src in (f.f_globals['tests'] if f is not None else []):\n"
        "        for node in ast.walk(ast.parse(src)):\n"
        "            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):\n"
        "                if [ast.literal_eval(a) for a in node.left.args] == list(args):\n"
        "                    return ast.literal_eval(node.comparators[0])\n"
        "    return 0\n"
    ),
}
"""Wrong programs (none computes ``a + b``), one per hack class; each scored 1.0 (all_pass) on the
harness that ran program and tests in one process and trusted its report line."""

HELD = {
    "sys_exit_at_load": "import sys\nsys.exit(0)\n",
    "os_exit_at_load": "import os\nos._exit(0)\n",
    "system_exit_in_a_test": "def add(a, b):\n    raise SystemExit(0)\n",
    "patched_assertion_error": (
        "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
        "def add(a, b):\n    return 0\n"
    ),
    "redefined_isinstance": (
        "import builtins\nbuiltins.isinstance = lambda *a: True\ndef add(a, b):\n    return 0\n"
    ),
}
"""Hacks the old harness already held (kept as regressions)."""

NEW_HARNESS_HACKS = {
    "forged_result_lines": (
        "import os, json\n"
        "for fd in range(3, 12):\n"
        "    try:\n"
        "        os.write(fd, b''.join(json.dumps({'i': i, 'v': 0}).encode() + b'\\n' for i in range(200)))\n"
        '        os.write(fd, b\'{"test": 0, "status": "pass", "why": null}\\n{"pending": []}\\n\')\n'
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    ),
    "patched_result_encoder": (
        "import builtins, json\n"
        "def forged(obj, *a, **k):\n"
        "    return '{\"i\": %d, \"v\": {\"eq_any\": True}}' % obj['i'] if isinstance(obj, dict) else ''\n"
        "json.dumps = builtins.repr = forged\n"
        "def add(a, b):\n"
        "    return 0\n"
    ),
}
"""Hacks aimed at the new judge: forging its result channel and the check run's report, a patched
result encoder (``json.dumps`` and ``repr``) writing a value that is no plain data (the old harness
held these trivially)."""


@pytest.fixture(autouse=True)
def bwrap_or_skip():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


def scores(program: str, spec: CodeSpec, score: str = "all_pass") -> float:
    sample = Sample(f"```python\n{program}```", spec.to_answer(), 10, 64)
    (got,) = CodeTests(CodeTestsParams(score=score, timeout_s=5)).score([sample], [False])
    return got


@pytest.mark.parametrize("shape", SPECS)
def test_a_correct_program_passes_and_a_plainly_wrong_one_does_not(shape):
    assert scores(RIGHT, SPECS[shape]) == 1.0
    assert scores("def add(a, b):\n    return a - b\n", SPECS[shape]) == 0.0


@pytest.mark.parametrize("shape", SPECS)
@pytest.mark.parametrize("hack", HACKS)
def test_each_hack_class_scores_zero(hack, shape):
    assert scores(HACKS[hack], SPECS[shape]) == 0.0
    assert scores(HACKS[hack], SPECS[shape], "pass_fraction") == 0.0


@pytest.mark.parametrize("shape", SPECS)
@pytest.mark.parametrize("hack", [*HELD, *NEW_HARNESS_HACKS])
def test_hacks_the_old_harness_held_and_hacks_on_the_judges_channel_score_zero(hack, shape):
    program = {**HELD, **NEW_HARNESS_HACKS}[hack]
    assert scores(program, SPECS[shape]) == 0.0
    assert scores(program, SPECS[shape], "pass_fraction") == 0.0


class Nothing:
    def verify_batch(self, texts, golds):
        return [Verdict(False, None) for _ in texts]


def test_a_result_that_is_not_plain_data_is_an_error_counted_by_reason():
    cfg = load_config(["reward.components=[{name: math_verify, weight: 0}, {name: code_tests}]"])
    reward = Reward.of(Nothing(), cfg.reward)
    texts = [HACKS["always_equal"], RIGHT, NEW_HARNESS_HACKS["patched_result_encoder"]]
    got = reward.score([Sample(f"```python\n{t}```", PAIRS.to_answer(), 10, 64) for t in texts])
    assert got.terms["code_tests"] == (0.0, 1.0, 0.0)
    assert got.failed["code_tests"] == (True, False, True)
    assert got.errors["code_tests/not_plain"] == 1 and got.errors["code_tests/bad_result"] == 1
    means = got.means()
    assert means["reward_errors/code_tests"] == 2.0 and means["reward_errors/code_tests/not_plain"] == 1.0


HOG = "_hog = bytearray(300 * 1024 * 1024)\n" + RIGHT
"""A correct program that needs 300 MB to load: it passes under the default 512 MB limit only."""


def test_the_configured_sandbox_reaches_code_tests_built_from_config():
    items = "{name: math_verify, weight: 0}, {name: code_tests, score: all_pass}"
    tight = load_config([f"reward.components=[{items}]", "sandbox.limits.memory_mb=128"])
    loose = load_config([f"reward.components=[{items}]"])
    sample = Sample(f"```python\n{HOG}```", PAIRS.to_answer(), 10, 64)
    assert Reward.of(Nothing(), loose.reward, sandbox=loose.sandbox).score([sample]).terms["code_tests"] == (
        1.0,
    )
    got = Reward.of(Nothing(), tight.reward, sandbox=tight.sandbox).score([sample])
    assert got.terms["code_tests"] == (0.0,)


def test_the_configured_sandbox_reaches_tools_and_evaluations_code_verdicts():
    from types import SimpleNamespace

    from conf.schema import SandboxConfig, SandboxLimits
    from environments.registry import make_environment
    from evaluation.benchmarks import BenchmarkItem
    from evaluation.evaluate import _verdicts
    from generation.model import build_char_tokenizer

    tight = SandboxConfig(limits=SandboxLimits(memory_mb=128))
    cfg = load_config(["env=calculator", "env.target=calculator_sandbox"]).env
    env = make_environment(cfg, build_char_tokenizer(), tight)
    assert env.tools["calc"].config == tight
    assert make_environment(cfg, build_char_tokenizer()).tools["calc"].config == SandboxConfig()
    item = BenchmarkItem("humaneval", "add", "add", PAIRS.to_answer())
    traj = SimpleNamespace(text=f"```python\n{HOG}```", prompt=SimpleNamespace(answer=PAIRS.to_answer()))
    assert _verdicts([item], [traj], None)[0].correct
    assert not _verdicts([item], [traj], None, tight)[0].correct


def test_reasons_are_counted_when_a_bad_answer_sends_the_batch_to_per_sample_scoring():
    cfg = load_config(["reward.components=[{name: math_verify, weight: 0}, {name: code_tests}]"])
    texts = [f"```python\n{HACKS['always_equal']}```", f"```python\n{RIGHT}```", "x"]
    samples = [Sample(t, a, 10, 64) for t, a in zip(texts, [PAIRS.to_answer(), PAIRS.to_answer(), "42"])]
    got = Reward.of(Nothing(), cfg.reward).score(samples)
    assert got.terms["code_tests"] == (0.0, 1.0, 0.0) and got.failed["code_tests"] == (True, False, True)
    assert got.errors["code_tests/not_plain"] == 1


def test_the_programs_run_never_holds_an_expected_output_and_the_check_run_never_holds_the_program(
    monkeypatch,
):
    from environments import sandbox

    seen: list[tuple[str, dict]] = []
    real = sandbox.run

    def recording(code, **kw):
        seen.append((code, dict(kw.get("files") or {})))
        return real(code, **kw)

    monkeypatch.setattr(sandbox, "run", recording)
    spec = CodeSpec(
        (
            "assert add('a', 'b') == 'EXPECTED-ONE'",
            "def check(c):\n    for x, y in [('c', 'EXPECTED-TWO')]:\n"
            "        assert c(x, 'd') == y\ncheck(add)\n",
        ),
        "add",
    )
    program = "# PROGRAM-MARKER\ndef add(a, b):\n    return a + b\n"
    assert scores(program, spec, "pass_fraction") == 0.0
    runs = [
        (code.encode() + b"".join(v if isinstance(v, bytes) else v.encode() for v in files.values()), files)
        for code, files in seen
    ]
    program_runs = [blob for blob, files in runs if "solution.py" in files]
    check_runs = [blob for blob, files in runs if "solution.py" not in files]
    assert program_runs and check_runs
    assert all(b"EXPECTED" not in blob for blob in program_runs)
    assert all(b"PROGRAM-MARKER" not in blob for blob in check_runs)
