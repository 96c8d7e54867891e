"""``laminar`` with the sampling and update paths the project had before issue 30, for before/after
runs of the same pipeline on the same code, config and machine (``default_run.py --paths before-issue-30``).

Switched back: every ``Engine.generate`` call samples through the reference loop the engine's tests
compare against (``tests.generation.oracle``: a ``DynamicCache`` grown by concatenation, every row
decoded to the end of the batch: no static cache, fused decode step, shared prefill or host decode
threads), and the RL trainer runs the padded forward
(``REFERENCE_FORWARD``) in one host thread. Both produce what the new paths produce up to float
rounding (``tests/generation/test_engine_static.py``, ``tests/training/test_packed_forward.py``,
``tests/training/test_update_threads.py``).

    .venv/bin/python benchmarks/before_issue30.py run --workspace WS [overrides...]   # laminar's arguments
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def switch_back() -> None:
    from generation.engine import Engine
    from tests.generation.oracle import oracle_generate
    from training.rl import trainer

    Engine.generate = oracle_generate
    trainer.REFERENCE_FORWARD = True
    trainer.MIN_THREAD_ROWS = 1 << 62


if __name__ == "__main__":
    switch_back()
    from flows.cli import main

    sys.exit(main(sys.argv[1:]))
