"""Held-out evaluation beside the Ray driver's loop, on a thread of the driver."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

from generation.adapter import load_published
from training.rl.records import StepMetrics


class BackgroundEval:
    """Evaluates a version on a thread of the driver, on its own copy of the policy, so the trainer and
    rollouts keep being fed meanwhile (the in-process sync loop waits for it). ``evaluate`` maps a
    model to metrics, which join the step's history entry. One evaluation at a time: ``join`` waits
    for it (at the end of the run and before a checkpoint) and re-raises its error."""

    def __init__(self, evaluate: Callable[[object], dict[str, float]]):
        self.evaluate = evaluate
        self.model = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, m: StepMetrics, policy, state: dict) -> None:
        """Evaluate ``state`` (published weights, loaded into a copy of ``policy`` made once) into
        ``m.extra``, after the evaluation before it finished."""
        self.join()
        if self.model is None:
            self.model = copy.deepcopy(policy)
        load_published(self.model, state)

        def work() -> None:
            try:
                m.extra.update(self.evaluate(self.model))
            except BaseException as e:  # noqa: BLE001 - handed to the loop's thread by join
                self._error = e

        self._error = None
        self._thread = threading.Thread(target=work, name="laminar-eval", daemon=True)
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
            if self._error is not None:
                raise self._error
