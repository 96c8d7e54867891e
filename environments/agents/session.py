"""Agent sessions: one per episode, shared by the HTTP handler threads (which post the agent's
requests and wait for their answers), the episode's ``reset``/``step`` (which take a request, answer
it with the policy's turn and wait for the next) and the agent's coroutine (which ends the session
when it returns, raises or runs out of time). ``Hub`` holds a run's sessions and runs the agents on
its own thread (its own event loop, so an agent that blocks blocks only itself)."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """One request waiting on the policy. ``request``: the parsed request
    (``environments.agents.server.parse_request``); ``reply``: what answers it (the assistant
    message, finish reason, log-probs, usage) or ``error``: ``(status, message)``; ``done`` is set
    when either is."""

    request: dict
    done: threading.Event = field(default_factory=threading.Event)
    reply: dict | None = None
    error: tuple[int, str] | None = None

    def answer(self, reply: dict | None = None, error: tuple[int, str] | None = None) -> None:
        self.reply, self.error = reply, error
        self.done.set()


class Session:
    """One episode's conversation (see the module docstring). ``known``: the canonical messages the
    session's tokens stand for, the last reply included; ``n_tokens``: the session's token count;
    ``end``: ``(reason, detail)`` once the agent returned (``answer``) or failed."""

    def __init__(self, sid: str, task: dict, deadline: float):
        self.sid, self.task, self.deadline = sid, task, deadline
        self.cond = threading.Condition()
        self.call: Call | None = None
        self.serving: Call | None = None
        self.end: tuple[str, Any] | None = None
        self.ended_at = 0.0
        self.kind = ""
        self.known: list[dict] = []
        self.text = ""
        self.tools: list[dict] = []
        self.n_tokens = 0
        self.requests = 0
        self.mismatches = 0
        self.overridden = 0
        """Requests served at the run's sampling settings instead of their own (``sampling=run``)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.agent_task: asyncio.Task | None = None

    def post(self, call: Call) -> None:
        """Queue the agent's request (the HTTP thread); one at a time per session (409)."""
        with self.cond:
            if self.end is not None:
                raise LookupError("this session's episode has ended")
            if self.call is not None or self.serving is not None:
                raise BlockingIOError("one request at a time per session: this one has a request open")
            self.call = call
            self.cond.notify_all()

    def abandon(self, call: Call) -> None:
        """The client stopped waiting for ``call`` (its request timed out)."""
        with self.cond:
            if self.call is call:
                self.call = None

    def next_event(self, timeout: float) -> Call | tuple[str, Any] | None:
        """The agent's next request (now being served), its end ``(reason, detail)``, or None after
        ``timeout`` seconds (at most until the episode's deadline)."""
        until = min(time.monotonic() + max(0.0, timeout), self.deadline)
        with self.cond:
            while self.call is None and self.end is None:
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            if self.call is not None:
                self.serving, self.call = self.call, None
                return self.serving
            return self.end

    def finish(self, reason: str, detail: Any) -> None:
        """The agent ended: a request still open is refused (its episode is over)."""
        with self.cond:
            if self.end is None:
                self.end, self.ended_at = (reason, detail), time.monotonic()
            for c in (self.call, self.serving):
                if c is not None and not c.done.is_set():
                    c.answer(error=(409, f"the episode ended ({detail or reason})"))
            self.call = self.serving = None
            self.cond.notify_all()

    def reply(self, call: Call, reply: dict | None = None, error: tuple[int, str] | None = None) -> None:
        with self.cond:
            if self.serving is call:
                self.serving = None
        call.answer(reply, error)


class Hub:
    """A run's agent sessions (one per episode); each agent runs on its own thread and event loop.
    ``solve(client, task)``: the agent; ``client_factory(session)``: its ``openai.AsyncOpenAI``;
    ``token``: the run's bearer token (random); at most ``max_sessions`` live sessions."""

    def __init__(self, solve, client_factory, max_sessions: int, episode_timeout_s: float):
        self.solve, self.client_factory = solve, client_factory
        self.max_sessions, self.episode_timeout_s = max_sessions, episode_timeout_s
        self.token = secrets.token_urlsafe(32)
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.started = self.ended = 0

    def open(self, task: dict) -> Session | None:
        """A new session with its agent started; None when ``max_sessions`` are live."""
        now = time.monotonic()
        with self.lock:
            stale = now - max(300.0, 2 * self.episode_timeout_s)
            for sid in [k for k, s in self.sessions.items() if s.end is not None and s.ended_at < stale]:
                del self.sessions[sid]  # long ended: its episode ended without reading it
            if len(self.sessions) >= self.max_sessions:
                return None
            s = Session(uuid.uuid4().hex, task, now + self.episode_timeout_s)
            self.sessions[s.sid] = s
            self.started += 1
        threading.Thread(target=self._thread, args=(s,), name=f"agent-{s.sid[:8]}", daemon=True).start()
        return s

    def _thread(self, s: Session) -> None:
        """The agent's thread: its own event loop. A cancellation that lands after the agent ended
        (while its client closes) ends the thread quietly; the session already has its reason."""
        try:
            asyncio.run(self._run(s))
        except (asyncio.CancelledError, RuntimeError):
            s.finish("agent_cancelled", "")

    def get(self, sid: str) -> Session | None:
        with self.lock:
            return self.sessions.get(sid)

    def close(self, sid: str, why: str = "") -> None:
        """Drop the session; an agent still running is cancelled (its open request is refused, naming
        ``why`` the episode ended)."""
        with self.lock:
            s = self.sessions.pop(sid, None)
        if s is not None and s.end is None:
            s.finish("agent_cancelled", why)
            if s.loop is not None and s.agent_task is not None:
                try:
                    s.loop.call_soon_threadsafe(s.agent_task.cancel)
                except RuntimeError:  # its loop has just closed: the agent ended on its own
                    pass

    def live(self) -> int:
        with self.lock:
            return sum(s.end is None for s in self.sessions.values())

    async def _run(self, s: Session) -> None:
        s.loop, s.agent_task = asyncio.get_running_loop(), asyncio.current_task()
        client = self.client_factory(s)
        try:
            left = s.deadline - time.monotonic()
            out = await asyncio.wait_for(self.solve(client, dict(s.task)), timeout=max(0.001, left))
            s.finish("answer", out)
        except TimeoutError:
            s.finish("agent_timeout", f"the agent ran past {self.episode_timeout_s:g} s")
        except asyncio.CancelledError:
            s.finish("agent_cancelled", "")
        except Exception as e:  # noqa: BLE001 - an agent that raises ends its own episode
            s.finish("agent_error", f"{type(e).__name__}: {e}"[:500])
        finally:
            self.ended += 1
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - closing a client never fails an episode
                pass

    def shutdown(self) -> None:
        with self.lock:
            sids = list(self.sessions)
        for sid in sids:
            self.close(sid)
