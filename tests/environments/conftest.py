"""Session fixtures of the episode tests: the tiny models taught to call the tool, each trained once
per pytest process (``episode_helpers``) and shared by every module that asks for it."""

from __future__ import annotations

import pytest

from generation.model import build_char_tokenizer, save_model
from tests.environments.episode_helpers import taught_to_call, taught_to_guess


@pytest.fixture(scope="session")
def caller_dir(tmp_path_factory):
    """A tiny model that answers every prompt with ``calc: 1+2`` (read-only: tests load it)."""
    d = tmp_path_factory.mktemp("caller-model")
    tok = build_char_tokenizer()
    save_model(taught_to_call(tok), tok, d)
    return d


@pytest.fixture(scope="session")
def guesser_dir(tmp_path_factory):
    """A tiny model that answers every turn with ``calc: 1+2`` (a guess of 2), also after the guessing
    game's feedback (read-only: tests load it)."""
    d = tmp_path_factory.mktemp("guesser-model")
    tok = build_char_tokenizer()
    save_model(taught_to_guess(tok), tok, d)
    return d
