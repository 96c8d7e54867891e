"""A rollout's side of the manager's orders, once for every driver: an engine with the continuous
API (``submit``, ``inject``, ``step``, ``extract``, ``load_state``, ``status``) runs a ``StepOrder`` or
an ``ExtractOrder`` and replies. The local driver calls :func:`run_order` in process; the Ray driver's
rollout actor (``training.rl.actors.RolloutWorker``) calls it behind ``ray.remote``. Only the weight
pull differs (the local trainer's weights, a relay's), so it is passed in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from training.rl.records import ExtractOrder, ExtractReply, PullResult, RolloutStatus, StepOrder, StepReply

Pull = Callable[[int], PullResult]
"""Load the latest weights (at least the given version) into the engine; how it went."""


def run_order(engine, order: StepOrder | ExtractOrder, chunk: int, pull: Pull | None = None):
    """Run ``order`` on ``engine``: an ``ExtractOrder`` hands every in-flight response and queued
    request back (``ExtractReply``); a ``StepOrder`` pulls first when told (through ``pull``), sets
    admission, takes the handed-over partials and new requests, then decodes up to ``chunk`` steps
    and returns what finished (``StepReply``). An engine without published weights (version < 0: a
    fresh or restarted rollout) holds its work until a pull."""
    if isinstance(order, ExtractOrder):
        partials, queued = engine.extract(include_queued=True)
        return ExtractReply(
            tuple(partials),
            tuple(queued),
            RolloutStatus.of(engine.status()),
            os.getpid(),
            time.process_time(),
        )
    if order.pull and pull is None:
        raise ValueError("a StepOrder with pull=True needs a pull function")
    pulled = pull(order.min_version) if order.pull else None
    engine.admitting = order.admitting
    if order.inject:
        engine.inject(list(order.inject))
    if order.submit:
        engine.submit(list(order.submit))
    t0 = time.perf_counter()
    st = engine.status()
    ready = engine.version >= 0 and (st["active"] or st["queued"])
    finished = engine.step(chunk) if ready else []
    return StepReply(
        tuple(finished),
        RolloutStatus.of(engine.status()),
        pulled,
        time.perf_counter() - t0,
        os.getpid(),
        time.process_time(),
    )
