"""The Laminar control plane (plain Python): prompt queue, experience buffer, repack planner, relay chain."""

from __future__ import annotations

import pytest

from conf.schema import RL_MODES
from training.rl import control
from training.rl.control import ExperienceBuffer, PromptQueue, RelayChain, RolloutView, plan_repack
from training.rl.loop import PromptCursor
from generation.records import PromptItem, ScoredGroup, Trajectory


def _prompts(n=10):
    return [PromptItem(f"p{i}", f"{i}+1", str(i + 1), (1, 2, 3), level=1) for i in range(n)]


def _traj(req, version=0, correct=True):
    text = req.prompt.answer if correct else "x"
    return Trajectory(
        "trajectory",
        req.prompt,
        req.sample_idx,
        (5, 6),
        (-0.1, -0.2),
        version,
        True,
        text,
        group_uid=req.group_uid,
    )


def _score(trajs):
    ok = tuple(t.text == t.prompt.answer for t in trajs)
    return ScoredGroup(
        "scored_group", trajs[0].prompt.prompt_id, tuple(trajs), tuple(float(c) for c in ok), ok
    )


def test_prompt_queue_issues_whole_groups_and_retries_first():
    q = PromptQueue(PromptCursor(_prompts(), seed=0), group_size=4)
    first = q.take(6)  # two whole groups (never a split group)
    assert len(first) == 8 and [r.group_uid for r in first] == [0] * 4 + [1] * 4
    q.requeue(first[5:7])
    again = q.take(3)
    assert [(r.group_uid, r.sample_idx) for r in again[:2]] == [(1, 1), (1, 2)]
    assert again[2].group_uid == 2
    # state round-trips through JSON: the same requests come next
    state = q.state()
    q2 = PromptQueue(PromptCursor(_prompts(), seed=0), group_size=4)
    q2.source.position = q.source.position
    q2.load_state(state)
    assert [(r.prompt.prompt_id, r.group_uid) for r in q2.take(4)] == [
        (r.prompt.prompt_id, r.group_uid) for r in q.take(4)
    ]


def test_buffer_trains_whole_groups_at_most_once_and_bounds_staleness():
    q = PromptQueue(PromptCursor(_prompts(), seed=0), group_size=2)
    buf = ExperienceBuffer(2, _score, keep=lambda g: len(set(g.correct)) > 1, max_staleness=1)
    reqs = q.take(6)  # 3 groups
    # group 0: mixed (kept); group 1: all correct (filtered); group 2: mixed but generated at version 0
    outcomes = {(0, 0): True, (0, 1): False, (1, 0): True, (1, 1): True, (2, 0): True, (2, 1): False}
    assert buf.add(_traj(reqs[0], correct=outcomes[(0, 0)])) is None  # incomplete group: not ready
    assert buf.n_ready() == 0
    for r in reqs[1:]:
        buf.add(_traj(r, version=0, correct=outcomes[(r.group_uid, r.sample_idx)]))
    assert buf.n_ready() == 2 and buf.stats.filtered == 1
    buf.add(_traj(reqs[0]))  # a duplicate of a held index is ignored
    assert buf.stats.duplicates == 1
    taken, stale = buf.take(1, trainer_version=1)
    assert [u for u, _ in taken] == [0] and not stale
    taken, stale = buf.take(5, trainer_version=3)  # group 2 is 3 versions behind: too stale
    assert not taken and [u for u, _ in stale] == [2]
    for r in reqs[:2]:  # a trained group never comes back
        assert buf.add(_traj(r)) is None
    assert buf.stats.staleness == {1: 1}


def test_buffer_state_round_trip():
    q = PromptQueue(PromptCursor(_prompts(), seed=0), group_size=2)
    buf = ExperienceBuffer(2, _score)
    reqs = q.take(4)
    buf.add(_traj(reqs[0]))
    buf.add(_traj(reqs[2]))
    buf.add(_traj(reqs[3], correct=False))
    buf2 = ExperienceBuffer(2, _score)
    buf2.load_state(buf.state())
    assert buf2.n_ready() == 1 and list(buf2.partial) == [0]
    assert buf2.ready[1].correct == (True, False)


def test_repack_best_fit_within_a_version():
    v = lambda name, version, active, prev, queued=0: RolloutView(name, version, queued, active, prev, 64)  # noqa: E731
    views = [
        v("a", 1, 3, 10),
        v("b", 1, 20, 30),
        v("c", 1, 40, 50),
        v("d", 2, 2, 9),
        v("e", 1, 60, 60, queued=4),
    ]
    moves = plan_repack(views, b_threshold=64)
    # a (3 active, fewest) goes where it ends fullest while fitting 64: c (40 + 3); then b (20) can
    # no longer join c (43 + 20 = 63 fits!) -> c ends at 63; d has no peer on version 2
    assert moves[0] == control.Move("a", "c", 3)
    assert control.Move("b", "c", 20) in moves
    assert all(m.src != "d" and m.dst != "d" for m in moves)
    assert all(m.src != "e" for m in moves)  # e still has queued prompts: not a source


def test_repack_respects_b_and_skips_rising_rollouts():
    views = [
        RolloutView("a", 0, 0, 10, 12, 64),
        RolloutView("b", 0, 0, 30, 31, 64),
        RolloutView("c", 0, 0, 5, 4, 64),
    ]
    # a (10) fits onto c (5 -> 15 <= 32) but not onto b (40 > 32); b (30) then fits nowhere;
    # c is rising (5 > 4), so it is a destination, never a source
    assert plan_repack(views, b_threshold=32) == [control.Move("a", "c", 10)]
    assert plan_repack(views, b_threshold=64)[0] == control.Move("a", "b", 10)  # best fit: ends fullest


def test_repack_never_hands_work_to_a_rollout_whose_pull_is_in_flight():
    # b's call in flight loads new weights: its version 1 is about to change, so partials of version 1
    # handed to it would arrive at a newer version and restart from their prompts
    views = [
        RolloutView("a", 1, 0, 3, 10, 64),
        RolloutView("b", 1, 0, 0, 0, 64, pulling=True),
        RolloutView("c", 1, 0, 20, 20, 64),
    ]
    assert plan_repack(views, b_threshold=64) == [control.Move("a", "c", 3)]
    assert plan_repack([views[0], views[1]], b_threshold=64) == []


def test_relay_chain_cut_out_and_rebuild():
    chain = RelayChain([("r0", "n0"), ("r1", "n1"), ("r2", "n2")])
    assert chain.links() == [("r0", "r1"), ("r1", "r2"), ("r2", None)]
    assert chain.remove("r1") == ("r0", "r2")
    assert chain.links() == [("r0", "r2"), ("r2", None)]
    assert chain.relay_for("n1") == "r0"  # bypass to the master while n1 has no relay
    assert chain.add("r3", "n1") == "r2"
    assert chain.relay_for("n1") == "r3" and chain.links()[-1] == ("r3", None)
    chain.remove("r0")
    assert chain.master == "r2"
    with pytest.raises(RuntimeError):
        for name in list(chain.order):
            chain.remove(name)


def test_retained_versions():
    assert control.retained_versions(10, [7, 10], keep_recent=2) == {7, 9, 10}


def test_modes_table():
    assert set(control.MODES) == set(RL_MODES)  # every mode the config accepts
    assert control.MODES["laminar"].repack and control.MODES["laminar"].drain
    assert control.MODES["partial"].interrupt and not control.MODES["partial"].batched
    assert control.MODES["one_step"].max_ahead == 1 and control.MODES["sync"].max_ahead == 0


def test_admission_room_keeps_outstanding_work_trainable_within_the_staleness_bound():
    from training.rl.control import admission_room

    kw = dict(batch_groups=16, group_size=8)
    assert admission_room(None, latest=5, version=5, outstanding=10_000, **kw) is None  # unbounded
    # at the latest version, max_staleness 1: two updates can still train it, 2 x 128 responses
    assert admission_room(1, latest=5, version=5, outstanding=0, **kw) == 256
    assert admission_room(1, latest=5, version=5, outstanding=200, **kw) == 56
    assert admission_room(1, latest=5, version=5, outstanding=300, **kw) == 0
    # a rollout one version behind has one update left; two behind, none
    assert admission_room(1, latest=6, version=5, outstanding=0, **kw) == 128
    assert admission_room(1, latest=7, version=5, outstanding=0, **kw) == 0
    assert admission_room(0, latest=5, version=5, outstanding=64, **kw) == 64


def test_outstanding_counts_trainer_buffer_rollouts_and_new_work_and_retries_always_go():
    from types import SimpleNamespace

    from training.rl.control import ExperienceBuffer, admission_room, outstanding_responses

    buf = ExperienceBuffer(2, score=lambda ts: None)
    buf.partial[7] = {0: object()}  # one response of an incomplete group
    rollouts = [
        SimpleNamespace(assigned={(1, 0): 0, (1, 1): 0}, pending_inject=[0]),
        SimpleNamespace(assigned={}, pending_inject=[]),
    ]
    assert outstanding_responses(rollouts, buf) == 1 + 2 + 1
    assert outstanding_responses(rollouts, buf, training=16, new=3) == 16 + 1 + 2 + 1 + 3
    kw = dict(batch_groups=16, group_size=8)
    assert admission_room(1, latest=7, version=5, outstanding=0, retry=5, **kw) == 5  # no room, retries go
    assert admission_room(1, latest=5, version=5, outstanding=200, retry=5, **kw) == 56
