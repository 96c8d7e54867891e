"""``agent_return``: the reward an agent program returned (``environments.agents``), as a reward
component that can be the run's verdict::

    reward.components=[{target: 'rewards.agent:agent_return', verdict: true}]

An agent episode's final state holds what ``solve`` returned: ``reward`` (a number or a bool), or a
dict under ``result`` with ``reward`` or ``correct``. An episode whose agent returned neither (an
answer, None, a fault) is judged on its text: the final answer (``#### X``) against the gold one.
"""

from __future__ import annotations

from rewards.components import Sample
from rewards.verifier import Verdict, extract_answer, normalize_answer


def returned(state) -> float | None:
    """The reward in an agent episode's state, or None when its agent returned none."""
    if not isinstance(state, dict):
        return None
    result = state.get("result") if isinstance(state.get("result"), dict) else state
    for key in ("reward", "correct"):
        v = result.get(key)
        if isinstance(v, (bool, int, float)):
            return float(v)
    return None


def agent_return(sample: Sample) -> Verdict | float:
    """The agent's reward (correct when it reaches the verdict's threshold, 1.0 by default), else the
    final answer's match with the gold one."""
    value = returned(sample.state)
    if value is not None:
        return value
    raw = extract_answer(sample.text)
    ok = raw is not None and normalize_answer(raw) == normalize_answer(sample.answer)
    return Verdict(ok, "" if raw is None else f"answer {raw}")
