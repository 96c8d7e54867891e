"""Code judged outside the program: the program only computes, in a sandbox run of its own, and
emits its results as plain data; a trusted checker (this process, or a fresh sandbox run the program
never touched) compares them with the expected outputs. Threat model: docs/rewards.md (code_tests).

- ``plain``: the codec of plain data across the sandbox's wall (also shipped into the sandbox).
- ``pairs``: tests read as input/output pairs, checked here without running test code.
- ``run_calls`` (stage 1) and ``run_checks`` (stage 2): the two sandbox programs.
- ``rounds``: the rounds between them and the verdict, ``judge(program, spec, ...) -> Judgement``."""

from environments.judge.rounds import ERRORS, Judgement, judge

__all__ = ["ERRORS", "Judgement", "judge"]
