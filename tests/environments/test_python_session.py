"""``python_session``: a sandboxed Python session whose variables live in the episode's state (the
cells that ran), replayed in a fresh sandbox run every call."""

import json

import pytest

from conf.loader import load_config
from environments.base import Turn, plain_state
from environments.python_session import Params, PythonSession
from environments.registry import make_environment
from environments.sandbox import BubblewrapBackend
from generation.model import build_char_tokenizer
from generation.records import PromptItem


@pytest.fixture(autouse=True)
def bwrap_or_skip():
    reason = BubblewrapBackend().unavailable()
    if reason is not None:
        pytest.skip(f"bubblewrap cannot run here: {reason}")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def session(tok, **params):
    return (
        make_environment(load_config(["env=python_session"]).env, tok)
        if not params
        else PythonSession(tok, Params(**params))
    )


def play(env, tok, calls, state=None):
    """Each call's decoded observation and result, from ``state`` (default: a fresh episode's)."""
    if state is None:
        _, state = env.reset(PromptItem("s", "q", "0", (1, 2)))
    out = []
    for text in calls:
        res = env.step(state, Turn(text, ()))
        out.append((tok.decode(list(res.observation)), res))
        state = res.state
    return out


def test_a_variable_defined_in_one_turn_is_there_in_the_next(tok):
    env = session(tok)
    assert env.format.name == "text"
    steps = play(env, tok, ["python: x = 21", "python: y = x * 2", "python: print(y)"])
    assert steps[-1][0] == "\n= 42\n" and not steps[-1][1].tool_error
    assert steps[-1][1].state == {"cells": ["x = 21", "y = x * 2", "print(y)"]}
    assert "no output" in steps[0][0]  # the character tokenizer has no brackets
    assert plain_state("python_session", steps[-1][1].state) == json.loads(json.dumps(steps[-1][1].state))


def test_the_same_call_depends_on_the_earlier_cells_in_the_state(tok):
    env = session(tok)
    with_x = play(env, tok, ["python: print(x + 1)"], state={"cells": ["x = 41"]})
    fresh = play(env, tok, ["python: print(x + 1)"])
    assert with_x[0][0] == "\n= 42\n"
    assert fresh[0][1].tool_error and "NameError: name" in fresh[0][0] and "is not defined" in fresh[0][0]


def test_earlier_output_is_not_shown_again_and_a_failed_cell_is_not_kept(tok):
    env = session(tok)
    steps = play(env, tok, ["python: print(1)", "python: z = 1 / 0", "python: print(2)"])
    assert [o for o, _ in steps][0] == "\n= 1\n" and steps[2][0] == "\n= 2\n"
    assert steps[1][1].tool_error and "ZeroDivisionError" in steps[1][0]
    assert steps[2][1].state == {"cells": ["print(1)", "print(2)"]}


def test_a_session_is_bounded_and_a_turn_without_a_call_ends_it(tok):
    env = session(tok, max_cells=1)
    steps = play(env, tok, ["python: a = 1", "python: print(a)", "#### 1"])
    assert steps[1][1].tool_error and "the session is full (1 cells)" in steps[1][0]
    assert steps[2][1].done and steps[2][1].state == {"cells": ["a = 1"]}
