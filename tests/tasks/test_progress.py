"""The run's progress lines: quick stages share a line, slow ones get their own, and a long stage is
announced by the quick ones before it while it still runs."""

from __future__ import annotations

import time

from tasks.records import StageOutcome
from tasks.runner import _Progress


def _outcome(stage: str, status: str, seconds: float) -> StageOutcome:
    return StageOutcome(stage, status, seconds, "key", None, None)


def test_quick_stages_share_a_line_and_a_slow_one_has_its_own(capsys):
    progress = _Progress(quick_s=2.0)
    for name, status, secs in [
        ("data", "ran", 0.4),
        ("ingest", "ran", 0.9),
        ("decontaminate", "cached", 0.1),
    ]:
        progress.stage_started()
        progress(_outcome(name, status, secs))
    assert capsys.readouterr().out == ""  # held: nothing slow has happened yet
    progress.stage_started()
    progress(_outcome("base_model", "ran", 5.6))
    progress.stage_started()
    progress(_outcome("warmup", "cached", 0.2))
    progress.flush()
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "laminar: stages data (ran), ingest (ran), decontaminate (cached) ran or cached 1.4s",
        "laminar: stage base_model     ran       5.6s",
        "laminar: stage warmup         cached    0.2s",
    ]


def test_a_long_stage_is_announced_by_the_quick_ones_before_it(capsys):
    progress = _Progress(quick_s=0.2)
    progress(_outcome("data", "ran", 0.1))
    progress(_outcome("ingest", "cached", 0.1))
    progress.stage_started()  # a stage that runs past quick_s: the held line prints while it runs
    deadline = time.monotonic() + 10
    while "ingest" not in (out := capsys.readouterr().out) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out == "laminar: stages data (ran), ingest (cached) ran or cached 0.2s\n"
    progress(_outcome("warmup", "ran", 30.0))
    assert capsys.readouterr().out == "laminar: stage warmup         ran      30.0s\n"


def test_a_stage_that_finishes_quickly_keeps_the_line_held(capsys):
    progress = _Progress(quick_s=0.3)
    progress(_outcome("data", "ran", 0.1))
    progress.stage_started()
    progress(_outcome("ingest", "ran", 0.1))  # finished before the timer: one line for both
    time.sleep(0.5)
    assert capsys.readouterr().out == ""
    progress.flush()
    assert capsys.readouterr().out == "laminar: stages data, ingest ran 0.2s\n"
