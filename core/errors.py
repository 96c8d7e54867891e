"""Errors a user acts on without a traceback.

A :class:`StageError` stops a stage for a reason its message states whole, on one line: which stage,
step or file, the offending value, and what to change. Raised inside a stage's body it fails the
stage like any exception (the pending artifact is dropped, nothing is published or cached, the
run's status is ``failed``, a rerun recomputes the stage); a front end may print ``str(err)``
alone instead of the traceback.
"""

from __future__ import annotations


class StageError(RuntimeError):
    """A stage cannot go on; the message (one line) names where, the value and what to change."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # one line, whatever the parts held
