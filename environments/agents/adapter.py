"""An agent program as an environment: ``env.target=my_pkg.agents:solve`` naming
``async def solve(client, task) -> float | dict | str | None``.

``reset(prompt)`` opens a session, starts the agent with an ``openai.AsyncOpenAI`` client pointed at
the session's base URL on the loopback endpoint (``environments.agents.server``) and waits for its
first request, whose messages (and ``tools``) it renders with the model's chat template: those tokens
are the episode's first context; the state is ``{"session": ID, ...}``. The rollout engine samples the
turn with every other open session's (continuous batching is the engine's own). ``step(state, turn)``
answers the waiting request with the turn (its tool calls parsed in the model's format, its
behaviour log-probs when asked), then waits for the agent's next request, whose new messages'
tokens are the observation (appended to the tokens the policy produced, never re-rendered), or for
the agent's return, which ends the episode (reason ``answer``). A client that edits or reorders an
earlier message gets a fresh render appended instead, and the episode is marked ``untrained``: its
loss mask is all zeros and ``episode/agent_mismatch`` counts it. An agent that raises, runs past
``episode_timeout_s`` or returns before its first request ends its own episode with the reason
(``agent_error``, ``agent_timeout``, ``agent_exit``). An episode whose session is not in this
process (the run resumed from a checkpoint, or the episode moved to another rollout process)
raises ``AgentLost``, and the episode restarts once from its prompt (``env.on_error`` is ``retry``
for agents).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from environments.agents.chat import RequestError, message_format
from environments.agents.server import Endpoint
from environments.agents.session import Call, Hub, Session
from environments.base import StateError, StepResult, Turn, plain_state
from generation.records import PromptItem


class AgentParams(BaseModel):
    """``env.params`` of an agent environment (docs/agents.md)."""

    model_config = ConfigDict(extra="forbid")

    max_sessions: int = Field(512, ge=1, le=100_000)
    """Live sessions at most; an episode started beyond it ends at once (reason ``agent_capacity``)."""
    episode_timeout_s: float = Field(600.0, gt=0, le=86_400)
    """Wall-clock limit of one agent run, from its start."""
    request_timeout_s: float = Field(120.0, gt=0, le=3_600)
    """How long a request waits for the policy's turn (504 after), and ``reset`` for the first one."""
    max_request_bytes: int = Field(4 << 20, ge=1024, le=1 << 30)
    idle_timeout_s: float = Field(60.0, gt=0, le=86_400)
    """A connection on which a client sends nothing this long is closed (an agent that never closes
    its clients holds no server thread past it); a request waiting for its turn is not idle."""
    model_name: str = "laminar-policy"
    """The model id ``/v1/models`` lists."""
    agent_params: dict[str, Any] = Field(default_factory=dict)
    """Handed to the agent as ``task["params"]``."""
    sampling: Literal["refuse", "run"] = "refuse"
    """A request whose ``temperature``, ``top_p`` or ``max_tokens`` differs from the run's sampling
    (which decides every turn, so that the behaviour log-probs trained on are those of the distribution
    actually sampled): ``refuse`` answers it 400 naming the run's value; ``run`` serves it at the run's
    settings and counts it in the episode's state (``sampling_overridden``)."""


RESET_THREADS = 32
"""Agents started at once by ``reset_many``."""


class AgentLost(RuntimeError):
    """An episode whose session this process does not hold (resumed, or moved between processes)."""


def _client(hub: Hub, endpoint: Endpoint, timeout: float):
    import httpx
    import openai

    def make(session: Session | None):
        # plain HTTP on loopback: no TLS context to build (that alone costs tens of ms per client)
        http = httpx.AsyncClient(verify=False, trust_env=False, timeout=timeout)
        return openai.AsyncOpenAI(
            base_url=endpoint.base_url(session.sid if session else "none"),
            api_key=hub.token,
            max_retries=0,
            timeout=timeout,
            http_client=http,
        )

    return make


class AgentEnvironment:
    """The adapter (see the module docstring). Its episodes' live objects (agent threads, sessions)
    stay in this process; what the episode carries is the session id and counts (plain data)."""

    Params = AgentParams
    restarts_lost = True
    """``environments.registry.wrap_engine`` runs its episodes with ``on_error=retry``: only a lost
    session raises (``AgentLost``), and its episode restarts once from the prompt."""
    lockstep = False
    """``EpisodeEngine.generate`` does not wait for every agent before the next decode: agents answer on
    their own clocks (their timing is theirs to reproduce), and one that hangs must not hold the
    others' turns past their request timeouts."""

    def __init__(self, solve, tokenizer, params: AgentParams | None, env, name: str = "agent"):
        self.name = name
        self.params = params or AgentParams()
        self.tokenizer = tokenizer
        self.format = message_format(tokenizer, getattr(env, "tool_format", "auto"))
        self.hub = Hub(solve, None, self.params.max_sessions, self.params.episode_timeout_s)
        self.sampler = None
        """The engine that samples the turns (``environments.registry.wrap_engine`` sets it): its
        ``sampling`` (``generation.protocol.SamplingSpec``) is what a request is checked against."""
        self._endpoint: Endpoint | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> Endpoint:
        """The loopback server, started at the first episode (building the environment for a check or
        for warm-up starts nothing)."""
        with self._lock:
            if self._endpoint is None:
                p = self.params
                self._endpoint = Endpoint(self.hub, p.model_name, p.request_timeout_s, p.max_request_bytes,
                                          idle_timeout_s=p.idle_timeout_s)  # fmt: skip
                self.hub.client_factory = _client(self.hub, self._endpoint, p.request_timeout_s + 5.0)
                self.hub.client_factory(None)  # imports openai and httpx now, not in the first episode
            return self._endpoint

    @property
    def max_live(self) -> int:
        """Live episodes at most (``max_sessions``): ``EpisodeEngine.generate`` starts a batch larger than
        this as earlier episodes end, so curation and evaluation never refuse one (``agent_capacity``)."""
        return self.params.max_sessions

    # ------------------------------------------------------------------------------- interface
    def reset(self, prompt: PromptItem) -> tuple[tuple[int, ...], dict]:
        task = {"prompt_id": prompt.prompt_id, "prompt": prompt.text, "answer": prompt.answer,
                "level": prompt.level, "params": dict(self.params.agent_params)}  # fmt: skip
        self.endpoint  # noqa: B018 - started on first use
        s = self.hub.open(task)
        if s is None:
            return prompt.prompt_tokens, {"session": "", "ended": "agent_capacity"}
        while True:
            ev = s.next_event(self.params.request_timeout_s)
            if not isinstance(ev, Call):
                self.hub.close(s.sid)
                reason = "agent_timeout" if ev is None else ev[0]
                reason = "agent_exit" if reason == "answer" else reason  # returned before asking
                detail = "no first request in time" if ev is None else str(ev[1])[:500]
                return prompt.prompt_tokens, {"session": s.sid, "ended": reason, "error": detail}
            try:
                tokens = self._first(s, ev, prompt)
            except Exception as e:  # noqa: BLE001 - refused, or the template raised: the agent hears why
                s.reply(ev, error=_refusal(e))
                continue
            return tokens, self._state(s)

    def reset_many(self, prompts: list[PromptItem]) -> list[tuple[tuple[int, ...], dict]]:
        """``reset`` of every prompt, at once: each waits for its own agent's first request, so a batch
        costs the slowest agent's start, not their sum (``EpisodeEngine.submit`` calls it)."""
        self.endpoint  # noqa: B018 - started once, before the threads
        with ThreadPoolExecutor(min(len(prompts), RESET_THREADS), thread_name_prefix="agent-reset") as pool:
            return list(pool.map(self.reset, prompts))

    def step(self, state: dict, turn: Turn) -> StepResult:
        if state.get("ended"):
            return StepResult(done=True, reason=state["ended"], state=state)
        s = self.hub.get(state["session"])
        if s is None:
            raise AgentLost(f"agent session {state['session']!r} is not in this process")
        if s.serving is not None:
            s.reply(s.serving, self._reply(s, s.serving, turn))
        ev = s.next_event(max(0.0, s.deadline - time.monotonic()))
        if not isinstance(ev, Call):
            return self._ended(s, ev)
        tool_msgs = 0
        while True:
            try:
                obs, tool_msgs = self._next(s, ev)
                break
            except Exception as e:  # noqa: BLE001 - refused, or the template raised: the agent hears why
                s.reply(ev, error=_refusal(e))
                ev = s.next_event(max(0.0, s.deadline - time.monotonic()))
                if not isinstance(ev, Call):
                    return self._ended(s, ev)
        return StepResult(obs, tool_call=tool_msgs > 0, state=self._state(s))

    def demonstrate(self, prompt: PromptItem, call, answer: str):
        """The episode in which the policy calls ``call`` then answers ``answer``, run through this
        agent: ``(prompt_tokens, tokens, loss_mask)`` or None (``environments.agents.demos``)."""
        from environments.agents.demos import demonstrate

        return demonstrate(self, prompt, call, answer)

    def episode_ended(self, state, reason: str) -> None:
        """The episode ended outside ``step`` (a turn cut at the length limit, ``max_turns``, a step
        timeout): its agent is stopped and its open request refused (409), so no session outlives its
        episode."""
        sid = state.get("session") if isinstance(state, dict) else None
        if sid:
            self.hub.close(sid, reason)

    def close(self) -> None:
        with self._lock:
            if self._endpoint is not None:
                self._endpoint.close()
        self.hub.shutdown()

    # -------------------------------------------------------------------------------- sessions
    def _check_sampling(self, s: Session, req: dict) -> None:
        """Under training a turn is sampled once, from the run's distribution (the engine samples a
        whole batch at one temperature and length cap, and the behaviour log-probs trained on are that
        distribution's): ``n`` above 1 is refused (a session does not branch), and so is a
        ``temperature``, ``top_p`` or ``max_tokens`` the run does not sample with, unless
        ``params.sampling=run`` (served at the run's settings, counted). ``stop`` is applied to the
        text returned (the tokens trained on are the whole turn, as sampled)."""
        if req["n"] > 1:
            raise RequestError(
                f"n={req['n']}: under training each episode is one trajectory and a session does not "
                "branch; send n=1 (laminar serve-policy serves n>1 outside training)"
            )
        spec = getattr(self.sampler, "sampling", None)
        if spec is None:
            return
        off = []
        t, p, m = req["temperature"], req["top_p"], req["max_tokens"]
        if t is not None and not math.isclose(t, spec.temperature, rel_tol=1e-6):
            off.append(f"temperature={t:g} (the run samples at {spec.temperature:g})")
        if p is not None and p != 1.0:
            off.append(f"top_p={p:g} (the run samples the whole distribution, top_p=1)")
        if m is not None and m < spec.max_new_tokens:
            off.append(f"max_tokens={m} (the run's turns run to {spec.max_new_tokens} tokens)")
        if not off:
            return
        if self.params.sampling == "run":
            s.overridden += 1
            return
        raise RequestError(
            f"{'; '.join(off)}: under training every turn is sampled from the run's distribution, whose "
            "behaviour log-probs are what is trained; omit them or send the run's values (or set "
            "env.params.sampling=run to serve such requests at the run's settings, counted)"
        )

    def _state(self, s: Session) -> dict:
        out = {"session": s.sid, "requests": s.requests, "mismatches": s.mismatches}
        if s.overridden:
            out["sampling_overridden"] = s.overridden
        if s.mismatches:
            out["untrained"] = True
        return out

    def _ended(self, s: Session, ev) -> StepResult:
        self.hub.close(s.sid)
        state = self._state(s)
        reason, detail = ("agent_timeout", "no request or return before the deadline") if ev is None else ev
        if reason == "answer":
            state.update(_result(detail))
        else:
            state["error"] = str(detail)[:500]
        return StepResult(done=True, reason=reason, state=state)

    def _first(self, s: Session, call: Call, prompt: PromptItem) -> tuple[int, ...]:
        req = call.request
        self._check_sampling(s, req)
        s.kind = req["kind"]
        if s.kind == "chat":
            tokens = self.format.first(req["messages"], req["tools"], prompt)
            s.known, s.tools = list(req["messages"]), req["tools"]
        else:
            text = req["prompt"]
            same = text == prompt.text and prompt.prompt_tokens
            tokens = tuple(prompt.prompt_tokens) if same else tuple(self.tokenizer(text)["input_ids"])
            s.text = text
        s.requests, s.n_tokens = 1, len(tokens)
        return tuple(tokens)

    def _next(self, s: Session, call: Call) -> tuple[tuple[int, ...], int]:
        """The observation tokens of the agent's next request, and how many tool messages it added."""
        req = call.request
        self._check_sampling(s, req)
        if req["kind"] != s.kind:
            raise RequestError(f"this session is a {s.kind} session; use that endpoint for all its requests")
        if s.kind == "chat":
            msgs, n = req["messages"], len(s.known)
            new = msgs[n:]
            obs = None
            if msgs[:n] == s.known and new and req["tools"] == s.tools:
                obs = self.format.delta(s.known, new, s.tools)
            if obs is None:  # an earlier message edited or reordered, or tools changed: render afresh
                s.mismatches += 1
                obs, new = self.format.first(msgs, req["tools"]), msgs
            s.known, s.tools = list(msgs), req["tools"]
            tool_msgs = sum(m["role"] == "tool" for m in new)
        else:
            text = req["prompt"]
            if text.startswith(s.text) and len(text) > len(s.text):
                obs = tuple(self.tokenizer(text[len(s.text) :], add_special_tokens=False)["input_ids"])
            else:
                s.mismatches += 1
                obs = tuple(self.tokenizer(text)["input_ids"])
            s.text, tool_msgs = text, 0
        s.requests += 1
        s.n_tokens += len(obs)
        return tuple(obs), tool_msgs

    def _reply(self, s: Session, call: Call, turn: Turn) -> dict:
        """The answer to ``call``: the turn's text (cut at the first ``stop`` string) and tool calls."""
        req = call.request
        text = turn.text
        if s.kind == "chat":
            content, calls = self.format.parse(text, req["call_tools"])
        else:
            content, calls = text, []
        finish = "tool_calls" if calls else "stop"
        for stop in req["stop"]:
            at = content.find(stop)
            if at >= 0:
                content = content[:at]
        if s.kind == "chat":
            msg = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = calls
            s.known.append(msg)
        else:
            s.text += content
        reply = {"content": content, "tool_calls": calls, "finish_reason": finish,
                 "prompt_tokens": s.n_tokens, "completion_tokens": len(turn.tokens),
                 "want_logprobs": req["logprobs"]}  # fmt: skip
        s.n_tokens += len(turn.tokens)
        if req["logprobs"]:
            reply["token_texts"] = [self.tokenizer.decode([t]) for t in turn.tokens]
            lps = list(getattr(turn, "logprobs", ()) or ())
            reply["logprobs"] = (
                [float(x) for x in lps] if len(lps) == len(turn.tokens) else [0.0] * len(turn.tokens)
            )
        return reply


def _refusal(e: Exception) -> tuple[int, str]:
    """The 4xx a request gets: a ``RequestError``'s own; a 400 for anything else rendering it raised
    (a chat template's ``raise_exception``, say for roles out of order, is a jinja2 error, no
    ``ValueError``), which ends no episode and stops no rollout."""
    if isinstance(e, RequestError):
        return e.status, str(e)
    return 400, f"cannot render the messages: {e}"


def _result(out: Any) -> dict:
    """What an agent's return puts in the episode's state: a number is ``reward``; a string is
    ``answer``; a dict is kept as it is (plain data; ``reward``, ``answer`` and ``correct`` are read
    by the reward layer's ``agent_return`` component); None: nothing (the reward layer judges the
    episode's last turn)."""
    if out is None:
        return {}
    if isinstance(out, bool):
        return {"reward": float(out), "correct": out}
    if isinstance(out, (int, float)):
        v = float(out)
        return {"reward": v} if math.isfinite(v) else {"error": f"the agent returned {out!r}"}
    if isinstance(out, str):
        return {"answer": out[:10_000]}
    if isinstance(out, dict):
        try:
            return {"result": plain_state("agent", out)}
        except StateError as e:
            return {"error": str(e)}
    return {"error": f"the agent returned a {type(out).__name__}; return a number, a string, a dict or None"}


def agent_factory(target: str, solve):
    """The environment factory ``env.target`` stands for when it names an ``async def solve(client,
    task)``: ``factory(tokenizer, params, env)`` with the adapter's ``Params``."""

    def factory(tokenizer, params, env):
        return AgentEnvironment(solve, tokenizer, params, env, name=target)

    factory.Params = AgentParams
    factory.agent = True
    return factory
