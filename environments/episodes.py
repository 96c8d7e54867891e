"""Multi-turn episodes on a generation engine, token-exact.

``EpisodeEngine`` wraps any engine with the continuous API (``submit``, ``inject``, ``step``,
``extract``, ``load_state``, ``status``) and speaks the same API, so every RL driver runs episodes
through ``training.rl.rollout.run_order`` unchanged. A policy turn ends at the end-of-turn token
(EOS); the environment's ``step`` runs in a bounded thread pool while the engine keeps decoding the
other rows; its observation tokens are appended to the episode's tokens and the episode continues as
an injected row whose context is the episode's exact token sequence (prompt + every turn and
observation so far): nothing is re-rendered from text. The environment's per-episode state
(``reset``'s, then each ``step``'s; plain data, checked) rides in the ``Episode`` beside its tokens,
so extract, inject and every hand-over move it too; each ``step`` gets a copy of it. The finished
``Trajectory`` carries every token with ``loss_mask`` (1 policy, 0 observation), the behaviour
log-probs of the policy's tokens and the final state (``env_state``).

The version rule (laminar mode; docs/environments.md). ``turn`` (the default): every policy turn is
sampled by one weight version, and an episode between turns (its tool running, or answered) is
*parked*: it pins no weights. ``status()['parked']`` counts those episodes, so a rollout draining
towards a newer version pulls as soon as its *decoding* turns end, and an episode answered while its
rollout drains waits for the pull and runs its next turn under the new weights. The trajectory keeps
each token's behaviour log-prob from the version that sampled it, ``version`` (the first turn's: the
staleness the buffer bounds) and ``last_version``; a parked episode moves to a rollout of any version
(its hand-over ``Partial`` has version -1). ``episode``: the whole episode under one version (parked
is 0, so a rollout pulls only when every episode it holds has ended): a slow tool pins its rollout's
old weights until it answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from environments.base import (
    Environment,
    InterfaceError,
    StateError,
    StepResult,
    Turn,
    plain_state,
    reset_result,
    step_result,
)
from environments.latency import LatencySampler
from generation.records import GenRequest, Partial, PromptItem, Trajectory
from generation.sampler import request_key


@dataclass(frozen=True)
class Episode:
    """An episode's state after its completed turns. Invariant: ``tokens``, ``logprobs`` and ``mask``
    share one length (observation tokens: log-prob 0.0, mask 0). ``request``: the episode's original
    request (its prompt as the driver knows it); ``context``: the tokens the first turn conditioned on
    (``Environment.reset``). ``state``: the environment's state after the completed turns (plain data:
    ``reset``'s, then each ``step``'s), which moves with the episode as its tokens do. ``version``:
    the weight version that sampled the first token (-1: none yet). ``pending``: a finished turn whose
    ``step`` had not answered when the episode was handed over (the receiver steps it again from
    ``state``); ``pending_delay_s``: the tool latency that turn had left to wait
    (``environments.latency``), which the receiver waits instead of a fresh draw."""

    request: GenRequest
    context: tuple[int, ...]
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    mask: tuple[int, ...] = ()
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    version: int = -1
    last_version: int = -1
    entropy_sum: float = 0.0
    retries: int = 0
    pending: Turn | None = None
    pending_delay_s: float | None = None
    state: Any = None

    def turn_request(self) -> GenRequest:
        """The engine request of the next turn: the episode's tokens so far as its prompt (turn 0:
        the original request, so a first turn samples what a single-turn run samples). The prompt id
        names the turn, which gives every turn its own sampling noise."""
        p = self.request.prompt
        if self.turns == 0 and self.retries == 0 and self.context == p.prompt_tokens:
            return dataclasses.replace(self.request, episode=None)
        item = PromptItem(
            prompt_id=f"{p.prompt_id}|r{self.retries}t{self.turns}",
            text="",
            answer=p.answer,
            prompt_tokens=self.context + self.tokens,
            level=p.level,
        )
        return GenRequest(item, self.request.sample_idx, self.request.group_uid)

    def with_turn(self, t: Trajectory) -> Episode:
        n = len(t.response_tokens)
        return dataclasses.replace(
            self,
            tokens=self.tokens + t.response_tokens,
            logprobs=self.logprobs + t.behaviour_logprobs,
            mask=self.mask + (1,) * n,
            turns=self.turns + 1,
            version=t.version if self.version < 0 else self.version,
            last_version=max(self.last_version, t.last_version if t.last_version >= 0 else t.version),
            entropy_sum=self.entropy_sum + (t.mean_entropy * n if n else 0.0),
        )

    def with_observation(self, result: StepResult) -> Episode:
        obs = tuple(int(i) for i in result.observation)
        return dataclasses.replace(
            self,
            state=result.state,
            tokens=self.tokens + obs,
            logprobs=self.logprobs + (0.0,) * len(obs),
            mask=self.mask + (0,) * len(obs),
            pending=None,
            pending_delay_s=None,
        )


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` policy turns; ``max_tokens`` episode tokens (policy + observation, checked after
    each turn; 0: no limit beyond the turns); ``tool_timeout_s`` per ``step``; ``tool_workers``
    threads; ``on_error``: ``fail`` or ``retry`` (once, from the prompt); ``latency``: seconds added to
    each tool call (``environments.latency.LatencySampler``; None: none); ``version_rule``: what one
    weight version spans in laminar mode, a ``turn`` or the whole ``episode`` (``EpisodeEngine``)."""

    max_turns: int = 4
    max_tokens: int = 0
    tool_timeout_s: float = 10.0
    tool_workers: int = 4
    on_error: str = "fail"
    latency: LatencySampler | None = None
    version_rule: str = "turn"

    @classmethod
    def from_config(cls, env) -> EpisodeLimits:
        lat = None if env.tool_latency.is_off() else LatencySampler(env.tool_latency)
        return cls(
            env.max_turns,
            env.max_tokens,
            env.tool_timeout_s,
            env.tool_workers,
            env.on_error,
            lat,
            env.version_rule,
        )


@dataclass
class _Wait:
    """An episode whose finished turn is with the environment: its step (which returns the result and
    the monotonic time it finished), the episode, when it was asked, and the tool latency to add."""

    fut: Future
    ep: Episode
    t0: float
    delay: float

    def ready_at(self) -> float | None:
        """When the answer reaches the episode (None: the step is still running)."""
        if not self.fut.done() or self.fut.cancelled():
            return None
        try:
            res, done_at = self.fut.result()
        except Exception:  # noqa: BLE001 - a crashed step is answered at once
            return self.t0
        return done_at + (self.delay if res.tool_call else 0.0)

    def left(self, now: float) -> float:
        """The latency still to wait, for a hand-over (all of it while the step runs)."""
        ready = self.ready_at()
        return self.delay if ready is None else max(0.0, ready - now)


def settle(waiting: list[_Wait], timeout: float) -> None:
    """Wait until every step in ``waiting`` has answered, its tool latency included, or timed out."""
    for w in waiting:
        with contextlib.suppress(Exception):  # a crashed or cancelled step is answered as such
            w.fut.result(timeout=max(0.0, w.t0 + timeout - time.monotonic()))
    due = [min(w.ready_at() or math.inf, w.t0 + timeout) for w in waiting]
    if due:
        time.sleep(max(0.0, max(due) - time.monotonic()))


class EpisodeEngine:
    """Episodes of ``env`` on ``engine`` (see the module docstring). ``status()['active']`` counts the
    episodes waiting on their environment too, so a rollout holding them is not idle. Not
    thread-safe: one caller drives it (the pool runs only ``env.step``)."""

    def __init__(self, engine, env: Environment, tokenizer, limits: EpisodeLimits):
        self.inner, self.env, self.tokenizer, self.limits = engine, env, tokenizer, limits
        self.env_name = str(getattr(env, "name", type(env).__name__))
        self._episodes: dict[tuple, Episode] = {}
        """Engine request key -> the episode whose turn it is."""
        self._waiting: list[_Wait] = []
        """Episodes whose finished turn is with the environment."""
        self._held: list[Episode] = []
        """Answered episodes whose next turn waits for the rollout's pull (turn rule, while it drains)."""
        self._lockstep = False
        """``generate``: each step waits for every environment answer, so which turns decode together
        (and so their floats) never depends on thread timing (curation and evaluation reproduce)."""
        self._pool = ThreadPoolExecutor(max_workers=limits.tool_workers, thread_name_prefix="laminar-env")
        self._news = threading.Event()
        """Set when an environment step returns or on a ``wake``: a step call waiting on tools looks again."""
        self._woken = False
        """A ``wake`` came during this step call: it does not wait on tools."""
        self.env_errors = 0
        """Environment crashes (exceptions out of ``step``) so far."""
        self._ended: list[Trajectory] = []
        """Episodes that ended at ``reset`` (its state ``{"ended": REASON}``), returned by the next step."""

    # -------------------------------------------------------------------------- the engine's API
    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, v: int) -> None:
        self.inner.version = v

    @property
    def admitting(self) -> bool:
        return self.inner.admitting

    @admitting.setter
    def admitting(self, v: bool) -> None:
        self.inner.admitting = v

    def __getattr__(self, name):  # model, tokenizer, capacity, engine_name, ...: the engine's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def submit(self, requests, sampling=None) -> None:
        """Start an episode per request (a request's own ``episode`` is ignored: it starts fresh)."""
        many = getattr(self.env, "reset_many", None)  # an environment whose resets wait (an agent's)
        first = many([r.prompt for r in requests]) if many is not None and len(requests) > 1 else None
        started = [self._start(r, reset=None if first is None else first[i]) for i, r in enumerate(requests)]
        self.inner.submit([ep.turn_request() for ep in started if ep is not None], sampling)

    def inject(self, partials) -> None:
        """Continue handed-over episodes (a ``Partial`` whose request carries its ``Episode``; one
        without is a first turn in flight)."""
        rows = []
        for p in partials:
            ep = p.request.episode
            if ep is None:
                ep = self._start(p.request)
                if ep is None:
                    continue
            if ep.pending is not None:
                self._ask(ep, ep.pending, ep.pending_delay_s)
                continue
            req = ep.turn_request()
            self._episodes[request_key(req)] = ep
            version = p.version if p.version >= 0 else ep.version
            rows.append(Partial(req, p.tokens, p.logprobs, version, p.entropy_sum))
        if rows:
            self.inner.inject(rows)

    def wake(self) -> None:
        """Cut a step call's wait on the environment short (thread-safe; the Ray driver's ``poke``): the
        caller has news for this rollout (a newer version to pull, work to take), so the call returns
        with what it has instead of waiting on a slow tool."""
        self._woken = True
        self._news.set()

    def step(self, max_steps: int) -> list[Trajectory]:
        """Collect the environment's answers, decode up to ``max_steps`` steps, hand finished turns to
        the environment; returns the episodes that ended. With nothing to decode it waits for the
        first answer (at most the tool timeout) or a ``wake``, instead of returning empty-handed at once."""
        self._woken = False  # a wake before this call is in the order that started it
        out, self._ended = self._ended, []
        if self._lockstep:
            settle(self._waiting, self.limits.tool_timeout_s)
        self._collect(out)
        if self._held and self.admitting:  # pulled (or told to admit again): their next turns start
            held, self._held = self._held, []
            for ep in held:
                self._continue(ep)
        st = self.inner.status()
        if st["active"] or st["queued"]:
            for t in self.inner.step(max_steps):
                self._turn_done(t, out)
        elif self._waiting and not out:
            self._collect(out, block=True)
        if not self._lockstep:
            self._collect(out)
        return out

    def extract(self, include_queued: bool = True, only=None) -> tuple[list[Partial], list[GenRequest]]:
        """Every in-flight episode as a ``Partial`` carrying its ``Episode`` (an episode waiting on its
        environment: no tokens, the unanswered turn in ``pending``), and the not yet started ones
        as their requests; ``only``: just the episodes of those request keys."""
        partials, queued = self.inner.extract(include_queued=include_queued, only=self._inner_keys(only))
        out_p, out_r = [], []
        for p in partials:
            ep = self._episodes.pop(request_key(p.request))
            out_p.append(Partial(self._carrier(ep), p.tokens, p.logprobs, p.version, p.entropy_sum))
        for r in queued:
            out_r.append(self._episodes.pop(request_key(r)).request)
        if include_queued:
            keep, now = [], time.monotonic()
            chosen = lambda ep: only is None or request_key(getattr(ep, "request", ep)) in only  # noqa: E731
            for w in self._waiting:
                if chosen(w.ep):
                    w.fut.cancel()
                    out_p.append(self._parked(dataclasses.replace(w.ep, pending_delay_s=w.left(now))))
                else:
                    keep.append(w)
            self._waiting = keep
            out_p += [self._parked(ep) for ep in self._held if chosen(ep)]
            self._held = [ep for ep in self._held if not chosen(ep)]
            gone = [t for t in self._ended if chosen(GenRequest(t.prompt, t.sample_idx, t.group_uid))]
            out_r += [GenRequest(t.prompt, t.sample_idx, t.group_uid) for t in gone]  # they start again
            self._ended = [t for t in self._ended if t not in gone]
        return out_p, out_r

    def abort(self, request_ids=None, include_queued: bool = True):
        only = None if request_ids is None else {tuple(i) for i in request_ids}
        return self.extract(include_queued=include_queued, only=only)

    def load_state(self, state, version: int) -> None:
        self.inner.load_state(state, version)

    def load_weights(self, *args, **kw) -> None:
        self.inner.load_weights(*args, **kw)

    def status(self) -> dict:
        st = dict(self.inner.status())
        between = len(self._waiting) + len(self._held)
        st["active"] = int(st["active"]) + between + len(self._ended)
        st["parked"] = between if self._turn_rule else 0
        return st

    def generate(self, requests, max_new_tokens: int | None = None, **_ignored) -> list[Trajectory]:
        """One episode per request, run to its end; output order = input order (the evaluation's
        batch call). The engine must be idle; its own length cap holds per turn."""
        if max_new_tokens is not None and max_new_tokens != self.inner.max_new_tokens:
            raise ValueError("EpisodeEngine.generate uses the engine's max_new_tokens per turn")
        slots = {request_key(r): i for i, r in enumerate(requests)}
        if len(slots) != len(requests):
            raise ValueError("EpisodeEngine.generate needs distinct (prompt_id, group_uid, sample_idx)")
        results: list[Trajectory | None] = [None] * len(requests)
        # an environment with a bound on live episodes (an agent's ``max_sessions``) gets new episodes
        # as old ones end, in input order, never more at once than it holds
        cap = max(1, int(getattr(self.env, "max_live", None) or len(requests) or 1))
        started = done = 0

        def admit() -> int:
            n = min(cap - (started - done), len(requests) - started)
            if n > 0:
                self.submit(list(requests[started : started + n]))
            return max(n, 0)

        started += admit()
        # every answer joins before the next decode, so each run decodes the same rows together (an
        # environment may opt out: agents, which answer on their own clocks)
        self._lockstep = bool(getattr(self.env, "lockstep", True))
        try:
            while self._episodes or self._waiting or self._held or self._ended:
                for t in self.step(self.inner.max_new_tokens):
                    results[slots[request_key(GenRequest(t.prompt, t.sample_idx, t.group_uid))]] = t
                    done += 1
                started += admit()
        finally:
            self._lockstep = False
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.env.close()

    # ---------------------------------------------------------------------------------- episodes
    def _start(self, request: GenRequest, retries: int = 0, reset=None) -> Episode | None:
        """The episode's start (``reset``: its ``env.reset`` result when already had, from the
        environment's ``reset_many`` over a batch), or None when it ended at ``reset`` (an agent that
        failed before its first request: its state names the reason as ``ended``; the next ``step``
        returns it)."""
        plain = dataclasses.replace(request, episode=None)
        reset = self.env.reset(plain.prompt) if reset is None else reset
        context, state = reset_result(self.env_name, reset)
        ep = Episode(plain, context, retries=retries, state=state)
        if isinstance(state, dict) and isinstance(state.get("ended"), str):
            self._ended.append(self._finish(ep, state["ended"]))
            self._news.set()
            return None
        self._episodes[request_key(ep.turn_request())] = ep
        return ep

    @property
    def _turn_rule(self) -> bool:
        return self.limits.version_rule == "turn"

    def _carrier(self, ep: Episode) -> GenRequest:
        return dataclasses.replace(ep.request, episode=ep)

    def _parked(self, ep: Episode) -> Partial:
        """A parked episode's hand-over: no tokens of a turn in flight; under the turn rule bound to no
        version (-1), else to its episode's."""
        return Partial(self._carrier(ep), (), (), -1 if self._turn_rule else ep.version, 0.0)

    def _inner_keys(self, only):
        if only is None:
            return None
        return {k for k, ep in self._episodes.items() if request_key(ep.request) in only}

    def _turn_done(self, t: Trajectory, out: list[Trajectory]) -> None:
        ep = self._episodes.pop(request_key(GenRequest(t.prompt, t.sample_idx, t.group_uid)))
        ep = ep.with_turn(t)
        if not t.finished:
            out.append(self._finish(ep, "length"))
        else:
            self._ask(ep, Turn(t.text, tuple(t.response_tokens), tuple(t.behaviour_logprobs)))

    def _ask(self, ep: Episode, turn: Turn, delay: float | None = None) -> None:
        """Hand a finished turn to the environment, with a copy of the episode's state (a step that
        changes the copy it got never changes the episode's); a tool call's answer waits ``delay``
        seconds more (None: this call's draw from ``limits.latency``)."""
        ep = dataclasses.replace(ep, pending=turn, pending_delay_s=None)
        if delay is None:
            lat = self.limits.latency
            key = "|".join(map(str, request_key(ep.request))) + f"|r{ep.retries}t{ep.turns}"
            delay = 0.0 if lat is None else lat.sample(key)
        fut = self._pool.submit(
            _timed, self.env_name, self.env.step, plain_state(self.env_name, ep.state), turn
        )
        fut.add_done_callback(lambda _: self._news.set())
        self._waiting.append(_Wait(fut, ep, time.monotonic(), delay))

    def _collect(self, out: list[Trajectory], block: bool = False) -> None:
        """Act on every answered (or timed-out) environment step; ``block``: wait for the first, a
        step returning (its latency may still be due) or a ``wake``, whichever comes first."""
        timeout = self.limits.tool_timeout_s
        if block and self._waiting and not self._woken:
            self._news.clear()  # steps that returned before this are in ``ready_at`` below
            due = min(
                min(w.t0 + timeout, w.ready_at() or math.inf) for w in self._waiting
            )  # the first answer or timeout
            self._news.wait(max(0.0, due - time.monotonic()))
        keep, now = [], time.monotonic()
        for w in self._waiting:
            ready = w.ready_at()
            if ready is not None and ready <= now and (ready - w.t0 < timeout or not w.delay):
                self._answered(w.ep, w.fut, out)
            elif now - w.t0 >= timeout:
                w.fut.cancel()  # a running step cannot be stopped: its thread finishes on its own
                ep = dataclasses.replace(w.ep, tool_errors=w.ep.tool_errors + 1)
                out.append(self._finish(ep, "tool_timeout"))
            else:
                keep.append(w)
        self._waiting = keep

    def _answered(self, ep: Episode, fut: Future, out: list[Trajectory]) -> None:
        try:
            res: StepResult = fut.result()[0]
        except (StateError, InterfaceError):
            raise  # a broken environment (a state that is no plain data): every episode would fail
        except Exception:  # noqa: BLE001 - any environment crash ends (or restarts) the episode
            self.env_errors += 1
            if self.limits.on_error == "retry" and ep.retries == 0:
                self._restart(ep)
            else:
                out.append(self._finish(ep, "env_error"))
            return
        ep = dataclasses.replace(
            ep,
            pending=None,
            state=res.state,
            tool_calls=ep.tool_calls + int(res.tool_call),
            tool_errors=ep.tool_errors + int(res.tool_error),
        )
        lim = self.limits
        if res.done:
            out.append(self._finish(ep, res.reason or "answer"))
        elif ep.turns >= lim.max_turns:
            out.append(self._finish(ep, "max_turns"))
        elif lim.max_tokens and len(ep.tokens) + len(res.observation) >= lim.max_tokens:
            out.append(self._finish(ep, "max_tokens"))
        else:
            ep = ep.with_observation(res)
            if self._turn_rule and not self.admitting:
                self._held.append(ep)  # the rollout drains towards newer weights: the next turn runs on them
            else:
                self._continue(ep)

    def _continue(self, ep: Episode) -> None:
        """The episode's next turn, injected (so a rollout that stopped admitting still finishes it)."""
        req = ep.turn_request()
        self._episodes[request_key(req)] = ep
        self.inner.inject([Partial(req, (), (), ep.version, 0.0)])

    def _restart(self, ep: Episode) -> None:
        fresh = self._start(ep.request, retries=ep.retries + 1)
        if fresh is None:
            return
        self.inner.inject([Partial(fresh.turn_request(), (), (), -1, 0.0)])

    def _finish(self, ep: Episode, reason: str) -> Trajectory:
        policy = sum(ep.mask)
        prompt = ep.request.prompt
        if ep.context != prompt.prompt_tokens:  # the environment rendered its own first context
            prompt = dataclasses.replace(prompt, prompt_tokens=ep.context)
        finished = reason == "answer"
        ended = getattr(self.env, "episode_ended", None)
        if ended is not None:  # an environment holding live resources per episode (an agent's session)
            ended(ep.state, reason)
        mask = (0,) * len(ep.mask) if untrained(ep.state) else ep.mask
        return Trajectory(
            kind="trajectory",
            prompt=prompt,
            sample_idx=ep.request.sample_idx,
            response_tokens=ep.tokens,
            behaviour_logprobs=ep.logprobs,
            version=ep.version if ep.version >= 0 else self.inner.version,
            finished=finished,
            text=self.tokenizer.decode(list(ep.tokens), skip_special_tokens=True),
            mean_entropy=ep.entropy_sum / max(1, policy),
            group_uid=ep.request.group_uid,
            last_version=ep.last_version,
            loss_mask=mask,
            turns=ep.turns,
            tool_calls=ep.tool_calls,
            tool_errors=ep.tool_errors,
            end_reason=reason,
            env_state=ep.state,
        )


def untrained(state) -> bool:
    """Whether an episode's final state marks it as not to be trained on (``{"untrained": true}``: an
    agent session whose client rewrote its history); its trajectory keeps every token with loss mask
    0, so it is counted and scored but moves no weight."""
    return isinstance(state, dict) and state.get("untrained") is True


def _timed(env_name: str, step, state, turn: Turn) -> tuple[StepResult, float]:
    """``step(state, turn)``, its result checked (``environments.base.step_result``: the new state as
    plain data, copied here in the pool), and the monotonic time it returned (the tool latency counts
    from there)."""
    res = step_result(env_name, step(state, turn))
    return res, time.monotonic()
