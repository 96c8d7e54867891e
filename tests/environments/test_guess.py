"""The ``guess`` built-in: a game whose feedback depends on the episode's earlier guesses (its state)."""

import json

import pytest

from conf.loader import load_config
from core.plugins import PluginError
from environments.base import Turn, plain_state
from environments.guess import Guess, Params, feedback, guess_of, secret_of
from environments.registry import make_environment
from generation.model import build_char_tokenizer
from generation.records import PromptItem


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def prompt(answer="42"):
    return PromptItem("g1", "Guess my number.", answer, (1, 5, 6))


def play(env, tok, texts, answer="42"):
    """Every step's (decoded observation, result) over ``texts``, each from the state the last left."""
    _, state = env.reset(prompt(answer))
    out = []
    for text in texts:
        res = env.step(state, Turn(text, ()))
        out.append((tok.decode(list(res.observation)), res))
        state = res.state
    return out


def test_reset_takes_the_secret_from_the_prompt_and_starts_with_no_guesses(tok):
    tokens, state = Guess(tok).reset(prompt("#### 42"))
    assert tokens == (1, 5, 6) and state == {"secret": 42, "guesses": []}
    assert plain_state("guess", state) == json.loads(json.dumps(state))  # plain data
    _, none = Guess(tok).reset(prompt("forty-two"))  # no integer: the first turn ends the episode
    assert none == {"secret": None, "guesses": []}
    assert Guess(tok).step(none, Turn("#### 42", ())).done


def test_the_feedback_depends_on_the_earlier_guesses(tok):
    """The same turn text (``#### 50``) gets another answer once earlier guesses are in the state:
    first the direction and the window it leaves, then, repeated, ``again`` as a tool error."""
    steps = play(Guess(tok), tok, ["#### 10", "#### 50", "#### 50", "#### 30", "#### 42"])
    assert [o for o, _ in steps[:4]] == [
        "\n= higher, above 10\n",
        "\n= lower, above 10, below 50\n",
        "\n= again 50, lower, above 10, below 50\n",
        "\n= higher, above 30, below 50\n",
    ]
    assert [r.tool_error for _, r in steps] == [False, False, True, False, False]
    last = steps[-1][1]
    assert last.done and last.reason == "answer" and last.observation == ()
    assert last.state == {"secret": 42, "guesses": [10, 50, 50, 30, 42]}
    # the second turn alone, from a fresh state, is answered without the first guess's bound
    fresh = play(Guess(tok), tok, ["#### 50"])
    assert fresh[0][0] == "\n= lower, below 50\n"


def test_a_guess_an_earlier_one_ruled_out_is_told_so():
    assert feedback(42, [50, 60]) == "already out, lower, below 50"
    assert feedback(42, [30, 20]) == "already out, higher, above 30"
    assert feedback(42, [30, 45]) == "lower, above 30, below 45"
    assert feedback(42, [60], low=1, high=100) == "lower, above 0, below 60"


def test_step_never_changes_the_state_it_was_given(tok):
    env = Guess(tok)
    _, state = env.reset(prompt())
    before = json.loads(json.dumps(state))
    env.step(state, Turn("#### 7", ()))
    assert state == before


def test_a_turn_without_a_number_ends_the_episode():
    assert guess_of("I give up") is None and guess_of("calc: 1+2") == 2 and guess_of("#### -3") == -3
    res = Guess(None).step({"secret": 3, "guesses": [1]}, Turn("no idea", ()))
    assert res.done and res.state == {"secret": 3, "guesses": [1]}
    assert secret_of(prompt("#### -7")) == -7


def test_guess_composes_and_its_params_are_validated_by_its_own_model(tok):
    cfg = load_config(["env=guess", "env.params.low=1", "env.params.high=100"]).env
    assert cfg.target == "guess" and cfg.max_turns >= 2
    env = make_environment(cfg, tok)
    assert isinstance(env, Guess) and env.params == Params(1, 100)
    with pytest.raises(PluginError, match=r"environments.guess:Guess.*unknown params \['hi'\]"):
        make_environment(load_config(["env=guess", "env.params.hi=3"]).env, tok)
    with pytest.raises(PluginError, match="low=5 is above high=2"):
        make_environment(load_config(["env=guess", "env.params.low=5", "env.params.high=2"]).env, tok)
