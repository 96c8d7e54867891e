"""The rollout engines as cost models: a continuous batch of at most ``capacity`` sequences whose
calls jump from one completion (or chunk end) to the next on the simulated clock. With tools under
the turn rule (``workload.version_rule=turn``) an episode's tool call ends its policy turn: it leaves
the batch, *parked* until a wall-clock ``ready`` event, and comes back as a new turn."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from conf.simulate import SimulateConfig
from generation.records import GenRequest, Partial, Trajectory
from training.rl.drivers.sim.clock import Clock
from training.rl.drivers.sim.costs import CostModel
from training.rl.drivers.sim.lengths import PromptSource
from training.rl.drivers.sim.segments import Segments
from training.rl.drivers.sim.tools import ToolCalls
from training.rl.records import PullResult, RolloutStatus


@dataclass
class Row:
    """One sequence in an engine's batch: it finishes when the engine's step count reaches
    ``s_admit + target - pre`` (``pre``: tokens it had when admitted, from a hand-over)."""

    key: tuple[int, int]
    req: GenRequest
    target: int
    pre: int
    s_admit: float
    version: int
    pause: int = 0
    """Of ``target``, the decode steps its tool calls wait (``ToolCalls.pause_steps``), no tokens."""
    first: int = -1
    """The version of the episode's first turn (the trajectory's ``version``; -1: ``version``)."""


@dataclass
class Episode:
    """Turn rule: an episode's progress, kept by the engine model across turns and hand-overs."""

    turn: int = 0
    """Policy turns completed (each but the last ends in a tool call)."""
    tokens: int = 0
    """Response tokens generated so far."""
    first: int = -1
    """The weight version that sampled its first turn."""
    wait_left: float | None = None
    """Handed over between turns: the tool latency it still waits (0: answered); None otherwise."""


@dataclass
class Parked:
    """Turn rule: an episode between turns whose tool call runs until ``ready_at``; ``token``
    matches its ``ready`` event (a hand-over voids it)."""

    req: GenRequest
    ready_at: float
    token: int


@dataclass
class SimRollout:
    """A simulated rollout engine (the manager keeps its scheduling state: ``RolloutManager.rollouts``).
    ``op``: what its current segment does (``pull``, ``reprefill``, ``step``, ``extract``); a segment
    is ``seg_work`` seconds at full speed, ``seg_steps`` of them decode steps (0: a prefill or pull)."""

    name: str
    index: int
    capacity: int
    busy: bool = False
    op: str = ""
    epoch: int = 0
    rows: list = field(default_factory=list)  # heap of (finish_at, seq, Row)
    row_seq: int = 0
    S: float = 0.0  # decode steps performed (the engine's clock)
    sum_c0: float = 0.0
    queue: deque = field(default_factory=deque)  # submitted GenRequests not yet admitted
    partials: deque = field(default_factory=deque)  # injected Partials not yet admitted
    admitting: bool = True
    eversion: int = -1  # the engine's loaded weights
    finished: list = field(default_factory=list)  # (Trajectory, length)
    parked: dict = field(default_factory=dict)  # turn rule: key -> Parked, waiting on a tool call
    ready: deque = field(default_factory=deque)  # turn rule: answered episodes waiting to rejoin
    turn_ended: bool = False  # a turn ended in a tool call during this call
    seg_start: float = 0.0
    seg_work: float = 0.0
    seg_speed: float = 1.0
    seg_steps: float = 0.0
    chunk_left: float = 0.0
    pull_version: int = -1
    pulled: bool = False  # this call pulled weights
    cut_req: bool = False
    busy_active_s: float = 0.0
    last_t: float = 0.0
    occ_s: float = 0.0

    def status(self) -> RolloutStatus:
        """Episodes between turns (turn rule) hold no row but count in ``active``, as ``parked``."""
        between = len(self.parked) + len(self.ready)
        return RolloutStatus(
            self.eversion,
            len(self.rows) + between,
            len(self.queue) + len(self.partials),
            self.capacity,
            parked=between,
        )


class EngineModel:
    """Every rollout engine's batch and segments. A call returns through ``on_return`` (its finished
    trajectories go to the manager); a finished hand-over through ``on_extract``."""

    def __init__(
        self,
        cfg: SimulateConfig,
        names: list[str],
        capacity: int,
        cost: CostModel,
        source: PromptSource,
        clock: Clock,
        speed: Callable[[], float],
        interrupt: bool,
        on_return: Callable[[SimRollout], None],
        on_extract: Callable[[SimRollout], None],
        on_idle: Callable[[SimRollout], None] | None = None,
    ):
        self.rollouts = {name: SimRollout(name, i, capacity) for i, name in enumerate(names)}
        self.rlist = list(self.rollouts.values())
        self.prompt_len = cfg.workload.prompt_len
        self.chunk_steps = cfg.sched.chunk_steps
        self.call_overhead_s = cfg.sched.call_overhead_s
        self.extract_s = cfg.cost.extract_s
        self.cost = cost
        self.source = source
        self.clock = clock
        self.speed = speed
        self.interrupt = interrupt
        self.on_return = on_return
        self.on_extract = on_extract
        self.on_idle = on_idle
        """Turn rule: an episode became ready on a rollout with no call in flight (dispatch it)."""
        self.n_busy = 0
        self.pre: dict[tuple[int, int], int] = {}
        """Tokens generated so far of each handed-over response (its Partial carries no tokens here)."""
        self.tools = ToolCalls(cfg, cost, capacity)
        self.turn_rule = self.tools.turn_rule
        """Tool waits on the wall clock, out of the batch (else the episode rule: tool waits as decode
        steps, ``ToolCalls.pause_steps``)."""
        self.segments = Segments(clock, speed)
        self.eps: dict[tuple[int, int], Episode] = {}
        """Turn rule: each episode's progress."""
        self.park_seq = 0

    # ---------------------------------------------------------------------------- accounting, speed
    def account(self, r: SimRollout) -> None:
        self.segments.account(r)

    def set_busy(self, r: SimRollout, busy: bool) -> None:
        if r.busy != busy:
            r.busy = busy
            self.n_busy += 1 if busy else -1

    def retime(self, sp: float) -> None:
        """Shared cores: every running segment continues at speed ``sp`` from now."""
        self.segments.retime(self.rlist, sp)

    # ---------------------------------------------------------------------------- starting a call
    def start_extract(self, r: SimRollout) -> None:
        r.op = "extract"
        self.segments.start(r, self.extract_s, 0)

    def start_step(self, r: SimRollout) -> None:
        r.op = "step"
        r.turn_ended = False
        self._begin_step(r)

    def start_pull(self, r: SimRollout, version: int, wait: float, cost: float) -> None:
        """Load ``version``: wait for the relay to hold it (idle time, it does not slow shared cores),
        then ``cost`` seconds of copy."""
        r.op, r.pulled = "pull", True
        r.pull_version = version
        self.segments.start_after_wait(r, wait, cost)

    def _begin_step(self, r: SimRollout) -> None:
        """After an optional pull: admit (prefill) then decode."""
        r.chunk_left = float(self.chunk_steps) if self.chunk_steps > 0 else math.inf
        tokens = self._admit(r)
        self._retire(r)
        self._decode_or_return(r, self.cost.prefill_s(tokens) + self.call_overhead_s)

    # ---------------------------------------------------------------------------- the batch
    def _admit(self, r: SimRollout) -> int:
        """Fill free slots (partials first, then, when admitting, episodes back from their tools and
        queued requests); returns prefill tokens."""
        tokens = 0
        while len(r.rows) < r.capacity and (r.partials or (r.admitting and (r.ready or r.queue))):
            if r.partials:
                p = r.partials.popleft()
                req, version = p.request, p.version
                key = (req.group_uid, req.sample_idx)
                pre = self.pre.pop(key, 0)
                if self.turn_rule:
                    ep = self.eps[key]
                    if ep.wait_left is not None:  # handed over between turns
                        wait, ep.wait_left = ep.wait_left, None
                        if wait > 0:  # its tool call goes on here
                            self._park(r, req, wait)
                            continue
                        version = r.eversion  # answered: its next turn runs on this rollout's weights
            elif r.admitting and r.ready:  # its next turn, under the current weights
                req = r.ready.popleft()
                version = r.eversion
                pre = self.eps[(req.group_uid, req.sample_idx)].tokens
            else:
                req, pre, version = r.queue.popleft(), 0, r.eversion
                if self.turn_rule:  # a fresh start (also of a request re-queued after a lost hand-over)
                    self.eps[(req.group_uid, req.sample_idx)] = Episode(first=version)
            row = self._row(r, req, pre, version)
            if pre >= row.target:  # already complete
                self._row_done(r, row)
                continue
            r.row_seq += 1
            heapq.heappush(r.rows, (r.S + (row.target - pre), r.row_seq, row))
            r.sum_c0 += self.prompt_len + pre - r.S
            tokens += self.prompt_len + pre
        return tokens

    def _row(self, r: SimRollout, req: GenRequest, pre: int, version: int) -> Row:
        """The row of ``req``'s response (episode rule: its tool waits as decode steps) or, under the
        turn rule, of its current turn (``target``: the episode's tokens at the turn's end)."""
        key = (req.group_uid, req.sample_idx)
        length = self.source.lengths[req.prompt.prompt_id][req.sample_idx]
        if self.turn_rule:
            ep = self.eps[key]
            return Row(key, req, self.tools.turn_end(length, ep.turn), pre, r.S, version, 0, ep.first)
        pause = self.tools.pause_steps(req)
        return Row(key, req, length + pause, pre, r.S, version, pause)

    def _row_done(self, r: SimRollout, row: Row) -> None:
        """A row reached its target: the response is finished, or (turn rule) its turn ends in a tool
        call and the episode parks until the call is answered."""
        if not self.turn_rule:
            self._finish(r, row)
            return
        ep = self.eps[row.key]
        if ep.turn >= len(self.tools):
            del self.eps[row.key]
            self._finish(r, row)
            return
        wait = self.tools.latency(row.req, ep.turn)
        ep.turn += 1
        ep.tokens = row.target
        r.turn_ended = True
        self._park(r, row.req, wait)

    def _park(self, r: SimRollout, req: GenRequest, wait: float) -> None:
        self.park_seq += 1
        ready_at = self.clock.now + wait
        r.parked[(req.group_uid, req.sample_idx)] = Parked(req, ready_at, self.park_seq)
        self.clock.push(ready_at, "ready", (r, (req.group_uid, req.sample_idx)), self.park_seq)

    def ready(self, r: SimRollout, key: tuple[int, int], token: int) -> None:
        """A parked episode's tool call is answered (a ``ready`` event; void if it was handed over).
        A call decoding while admitting takes it into its batch now (``_rejoin_now``); one in a
        prefill, a pull or a hand-over admits it when that ends; a call waiting only on tools returns
        (as the runtime's wait on the environment does) and the next call admits it; a draining
        rollout holds it until its pull."""
        p = r.parked.get(key)
        if p is None or p.token != token:
            return
        del r.parked[key]
        r.ready.append(p.req)
        if not r.busy:
            if self.on_idle is not None:
                self.on_idle(r)
        elif r.op == "wait":
            self._end_wait(r)
        elif r.op == "step" and r.admitting and r.seg_steps and self.chunk_steps <= 0:
            self._rejoin_now(r)

    def _stop_segment(self, r: SimRollout) -> None:
        """End a decode segment now (``Segments.stop``) and retire the rows that finished."""
        self.segments.stop(r)
        self._retire(r)

    def _rejoin_now(self, r: SimRollout) -> None:
        """Stop the decode segment here, admit the answered episodes (a prefill of their context so far,
        as for handed-over rows) and go on decoding, in the same call; a row that ended meanwhile ends
        the call instead (the next call admits them)."""
        self._stop_segment(r)
        if r.finished or r.turn_ended:
            self.on_return(r)
            return
        self._decode_or_return(r, self._rejoin(r))

    def _rejoin(self, r: SimRollout) -> float:
        """Admit answered episodes into free rows of a running call (when admitting); returns the
        seconds of their prefill."""
        if not (r.ready and r.admitting and len(r.rows) < r.capacity):
            return 0.0
        tokens = self._admit(r)
        self._retire(r)
        return self.cost.prefill_s(tokens)

    def _end_wait(self, r: SimRollout) -> None:
        self.account(r)
        r.op = "step"
        self.on_return(r)

    def _finish(self, r: SimRollout, row: Row) -> None:
        traj = Trajectory(
            "trajectory",
            row.req.prompt,
            row.req.sample_idx,
            (),
            (),
            row.version if row.first < 0 else row.first,
            True,
            "",
            group_uid=row.req.group_uid,
            last_version=r.eversion,
        )
        r.finished.append((traj, row.target - row.pause))

    def _retire(self, r: SimRollout) -> None:
        while r.rows and r.rows[0][0] <= r.S + 1e-6:
            _, _, row = heapq.heappop(r.rows)
            r.sum_c0 -= self.prompt_len + row.pre - row.s_admit
            self._row_done(r, row)

    def _decode_or_return(self, r: SimRollout, extra_s: float = 0.0) -> None:
        """Continue the current call: decode to the next completion (or the chunk's end), else return.
        ``extra_s``: a prefill (and call overhead) that precedes the decode steps in the same segment."""
        chunked = self.chunk_steps > 0
        if not r.rows and (r.parked or r.ready) and not (r.finished or r.turn_ended or r.cut_req):
            # turn rule: nothing to decode, only episodes between turns: wait for an answer or a poke
            r.op = "wait"
            r.epoch += 1
            return
        if not r.rows or (chunked and r.chunk_left <= 1e-9) or r.eversion < 0:
            if extra_s > 0:
                self.segments.start(r, extra_s, 0)
                r.cut_req = True  # return once the prefill is done
                return
            self.on_return(r)
            return
        nxt = r.rows[0][0] - r.S
        k = min(nxt, r.chunk_left) if chunked else nxt
        k = max(k, 1e-9)
        n = len(r.rows)
        ctx = r.sum_c0 / n + r.S + k / 2
        self.segments.start(r, extra_s + k * self.cost.decode_step_s(n, ctx), k)

    def segment_end(self, r: SimRollout) -> None:
        """``r``'s current segment is done: go on with its call (or end it)."""
        self.account(r)
        if r.seg_steps:
            r.S += r.seg_steps
            r.chunk_left -= r.seg_steps
            r.seg_steps = 0
        if r.op == "pull":
            r.eversion = r.pull_version
            if self.interrupt and r.rows:  # continue under the new weights: re-prefill every row
                tokens = sum(self.prompt_len + row.pre + int(r.S - row.s_admit) for _, _, row in r.rows)
                r.op = "reprefill"
                self.segments.start(r, self.cost.prefill_s(tokens), 0)
                return
            self.start_step(r)
            return
        if r.op == "reprefill":
            self.start_step(r)
            return
        if r.op == "extract":
            self.on_extract(r)
            return
        self._after_decode(r)

    def _after_decode(self, r: SimRollout) -> None:
        """A decode segment (or a prefill) ended."""
        self._retire(r)
        if r.cut_req:
            r.cut_req = False
            self.on_return(r)
            return
        if self.chunk_steps > 0:
            tokens = self._admit(r)
            self._retire(r)
            self._decode_or_return(r, self.cost.prefill_s(tokens))
            return
        if r.finished or r.turn_ended:  # the manager hears of finished responses and parked episodes
            self.on_return(r)
            return
        self._decode_or_return(r, self._rejoin(r))

    def cut(self, r: SimRollout) -> None:
        """Event mode: end a busy decode call now (the manager needs the rollout before its next
        completion); a call waiting only on tools returns (the runtime's ``wake``)."""
        if r.busy and r.op == "wait":
            self._end_wait(r)
            return
        if not r.busy or r.op != "step" or self.chunk_steps > 0:
            return
        if not r.seg_steps:  # a prefill: the call returns when it is done
            r.cut_req = True
            return
        self._stop_segment(r)
        self.on_return(r)

    # ---------------------------------------------------------------------------- ending a call
    def collect(self, r: SimRollout) -> tuple[list[tuple[Trajectory, int]], PullResult | None]:
        """A call returns: its finished ``(trajectory, length)`` pairs and the pull it made, if any."""
        self.set_busy(r, False)
        pulled = PullResult(True, r.eversion) if r.pulled and r.eversion >= 0 else None
        r.pulled = False
        r.turn_ended = False
        finished, r.finished = r.finished, []
        return finished, pulled

    def hand_over(self, r: SimRollout) -> tuple[list[Partial], list[GenRequest]]:
        """A repack source gives up its in-flight rows (as partials, tokens so far in ``pre``) and queue;
        under the turn rule also its episodes between turns, as partials of version -1 (any receiver
        continues them) with the latency they still wait (0: answered)."""
        partials = list(r.partials)
        r.partials.clear()
        for _, _, row in r.rows:
            self.pre[row.key] = row.pre + int(r.S - row.s_admit)
            partials.append(Partial(row.req, (), (), row.version))
        r.rows, r.sum_c0 = [], 0.0
        now = self.clock.now
        between = [(p.req, max(0.0, p.ready_at - now)) for _, p in sorted(r.parked.items())]
        for req, wait in between + [(req, 0.0) for req in r.ready]:
            key = (req.group_uid, req.sample_idx)
            self.eps[key].wait_left = wait
            self.pre[key] = self.eps[key].tokens
            partials.append(Partial(req, (), (), -1))
        r.parked.clear()
        r.ready.clear()
        queued = list(r.queue)
        r.queue.clear()
        self.set_busy(r, False)
        return partials, queued
