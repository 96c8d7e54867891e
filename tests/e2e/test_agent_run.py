"""`laminar run env.target=examples.agents.react_calc:solve` through the real CLI: the example agent,
written only against `openai`, runs its episodes through the endpoint in the whole pipeline (warm-up,
curation, RL, evaluation) in sync mode, and its RL stage in one_step, partial and laminar (Ray)
modes; every RL step's agent episodes finish without an agent fault or a history mismatch."""

from __future__ import annotations

import pytest

from tests.configs import TINY_CURATED
from tests.e2e.test_operate import laminar

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
AGENT = ("env.target=examples.agents.react_calc:solve", "env.max_turns=4")


def _episode_metrics(ws) -> dict[str, list[float]]:
    import duckdb

    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "select name, value from metrics where stage = 'rl' "
            "and (name like 'episode/%' or name = 'reward') order by step"
        ).fetchall()
    finally:
        con.close()
    out: dict[str, list[float]] = {}
    for name, value in rows:
        out.setdefault(name, []).append(value)
    return out


@pytest.mark.parametrize("mode", ["sync", "one_step", "partial", "laminar"])
def test_the_example_agent_trains_through_the_endpoint(tmp_path, mode):
    ws = tmp_path / "ws"
    until = () if mode == "sync" else ("--until", "rl")
    laminar("run", *TINY_CURATED, *AGENT, f"rl.mode={mode}", *until, ws=ws, timeout=1200)
    m = _episode_metrics(ws)
    assert len(m["reward"]) == 2  # rl.steps=2 in TINY_CURATED: both steps trained
    assert m["episode/agent_failed"] == [0.0, 0.0]
    assert m["episode/agent_mismatch"] == [0.0, 0.0]
    assert all(t >= 1.0 for t in m["episode/turns"])
