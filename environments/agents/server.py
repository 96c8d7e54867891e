"""The OpenAI-compatible endpoint: ``/v1/chat/completions`` (plain and streaming), ``/v1/completions``
and ``/v1/models`` on loopback, one session per episode in the URL (``/s/<session>/v1/...``) or in
the ``X-Laminar-Session`` header.

Every request needs the run's bearer token (401 otherwise), is at most ``max_request_bytes`` (413)
and is checked here, in the handler thread, before it reaches whatever serves it: anything the
endpoint does not support is a 400 naming the field (``tool_choice`` that forces a call,
``top_logprobs``, images...). A checked request waits until it is answered (``request_timeout_s``:
504 after that). Under training a session answers it with the turn the rollout engine sampled, and
refuses what the run's sampling cannot honour (``n`` above 1; ``temperature``, ``top_p`` or
``max_tokens`` off the run's: ``environments.agents.adapter``); ``laminar serve-policy`` applies every
one of them per request (``environments.agents.serve``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from environments.agents.chat import RequestError, canonical, canonical_tools

SESSION_HEADER = "X-Laminar-Session"
"""The session of a request sent to the endpoint's root URL (``http://127.0.0.1:PORT/v1``) instead of
the session's own base URL: for a framework that fixes the base URL but lets headers be set."""
IGNORED = {
    "model",
    "user",
    "seed",
    "metadata",
    "store",
    "stream_options",
    "parallel_tool_calls",
    "service_tier",
}
"""Fields accepted and not acted on (they change nothing the endpoint does)."""
CHAT_FIELDS = {"messages", "tools", "tool_choice", "stop", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "n", "logprobs", "top_logprobs", "stream", "frequency_penalty",
               "presence_penalty", "response_format"}  # fmt: skip
IDLE_TIMEOUT_S = 60.0
"""A keep-alive connection that sends nothing this long is closed (a waiting request is not idle)."""
MAX_N = 16
"""Choices per request at most."""
COMPLETION_FIELDS = {"prompt", "stop", "max_tokens", "temperature", "top_p", "n", "logprobs", "stream",
                     "echo", "frequency_penalty", "presence_penalty"}  # fmt: skip


def _number(body: dict, key: str, low: float, high: float) -> None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high):
        raise RequestError(f"{key} must be a number in [{low:g}, {high:g}], got {v!r}")


def _common(body: dict, fields: set[str]) -> dict:
    unknown = sorted(set(body) - fields - IGNORED)
    if unknown:
        raise RequestError(f"unsupported field(s) {unknown}: this endpoint does not implement them")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
    for k in ("frequency_penalty", "presence_penalty"):
        if body.get(k) not in (None, 0, 0.0):
            raise RequestError(f"{k} is not supported (the run's sampler has no penalties)")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise RequestError(f"{k} must be a positive integer, got {v!r}")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of at most 4 non-empty strings")
    if not isinstance(body.get("stream", False), bool):
        raise RequestError("stream must be true or false")
    opts = body.get("stream_options") or {}
    cap = body.get("max_completion_tokens", body.get("max_tokens"))
    return {"stop": stop, "stream": bool(body.get("stream")), "usage": bool(opts.get("include_usage")),
            "n": n or 1, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "max_tokens": cap}  # fmt: skip


def parse_request(kind: str, body) -> dict:
    """A request checked and reduced to what a session needs, or a ``RequestError`` (400)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if kind == "completion":
        req = _common(body, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(
                "prompt must be one non-empty string (token lists and batches are not supported)"
            )
        if body.get("echo"):
            raise RequestError("echo is not supported")
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 1):
            raise RequestError("logprobs must be 0 or 1 (top alternatives are not supported)")
        return {**req, "kind": kind, "prompt": prompt, "logprobs": bool(lp)}
    req = _common(body, CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list")
    messages = [canonical(m, f"messages[{i}]") for i, m in enumerate(msgs)]
    choice = body.get("tool_choice", "auto")
    if choice not in (None, "auto", "none"):
        raise RequestError("tool_choice must be 'auto' or 'none' (forcing a call needs constrained decoding)")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not supported (the behaviour log-prob of each token is)")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("response_format other than {'type': 'text'} is not supported")
    tools = canonical_tools(body.get("tools"))
    for t in tools:  # what the tool-call parsers read of a schema: an object, its properties, its required
        schema = t["function"].get("parameters")
        if schema is not None and not (
            isinstance(schema, dict)
            and isinstance(schema.get("properties", {}), dict)
            and isinstance(schema.get("required", []), list)
        ):
            raise RequestError(f"tools: {t['function']['name']!r}: parameters must be a JSON schema object")
    if choice == "none":
        tools_for_calls = []
    else:
        tools_for_calls = tools
    return {**req, "kind": kind, "messages": messages, "tools": tools, "call_tools": tools_for_calls,
            "logprobs": bool(body.get("logprobs"))}  # fmt: skip


def _error(status: int, message: str) -> dict:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    return {"error": {"message": message, "type": kinds.get(status, "api_error"), "code": status}}


def _tool_calls(reply: dict, streaming: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(reply["tool_calls"]):
        call = {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        out.append({"index": i, **call} if streaming else call)
    return out


def _logprobs(reply: dict, kind: str):
    if not reply.get("want_logprobs"):
        return None
    toks, lps = reply["token_texts"], reply["logprobs"]
    if kind == "completion":
        offsets, at = [], 0
        for t in toks:
            offsets.append(at)
            at += len(t)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(toks, lps)
    ]
    return {"content": content, "refusal": None}


def _choices(reply: dict) -> list[dict]:
    """A reply's choices: ``reply["choices"]`` (``n`` of them, each with its own text, calls, finish
    reason and log-probs) or the reply itself (one)."""
    return reply.get("choices") or [reply]


def completion_body(reply: dict, kind: str, model: str) -> dict:
    """The non-streaming response to one request (``n`` choices)."""
    choices = _choices(reply)
    done = sum(c["completion_tokens"] for c in choices)
    usage = {
        "prompt_tokens": reply["prompt_tokens"],
        "completion_tokens": done,
        "total_tokens": reply["prompt_tokens"] + done,
    }
    base = {"created": int(time.time()), "model": model, "usage": usage}
    if kind == "completion":
        out = [{"index": i, "text": c["content"], "finish_reason": c["finish_reason"],
                "logprobs": _logprobs(c, kind)} for i, c in enumerate(choices)]  # fmt: skip
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "choices": out, **base}
    out = []
    for i, c in enumerate(choices):
        msg = {"role": "assistant", "content": c["content"] or None}
        if c["tool_calls"]:
            msg["tool_calls"] = _tool_calls(c)
        out.append({"index": i, "message": msg, "finish_reason": c["finish_reason"],
                    "logprobs": _logprobs(c, kind)})  # fmt: skip
    return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "choices": out, **base}


def stream_events(reply: dict, kind: str, model: str, usage: bool) -> list[dict]:
    """The server-sent events of one streamed response (before ``[DONE]``): per choice, its text
    (with its log-probs), its tool calls, then its finish reason."""
    whole = completion_body(reply, kind, model)
    head = {"id": whole["id"], "created": whole["created"], "model": model}
    events = []
    for i, c in enumerate(_choices(reply)):
        if kind == "completion":
            events.append({**head, "object": "text_completion", "choices": [whole["choices"][i]]})
            continue
        obj = {**head, "object": "chat.completion.chunk"}
        delta = {"role": "assistant", "content": c["content"] or ""}
        lp = whole["choices"][i]["logprobs"]
        events.append(
            {**obj, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}]}
        )
        if c["tool_calls"]:
            calls = {"tool_calls": _tool_calls(c, streaming=True)}
            events.append({**obj, "choices": [{"index": i, "delta": calls, "finish_reason": None}]})
        events.append({**obj, "choices": [{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}]})
    if usage:
        events.append({**events[-1], "choices": [], "usage": whole["usage"]})
    return events


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: a batch of agents connects at once (the default is 5)

    def handle_error(self, request, client_address) -> None:
        """A client that drops its connection (an agent cancelled or done) is no error of the server's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Endpoint:
    """The HTTP server on ``127.0.0.1`` (``port``; 0: a free one), in front of ``hub``'s sessions (or of
    a ``sessionless`` hub that serves every request itself: ``environments.agents.serve``)."""

    def __init__(self, hub, model: str, request_timeout_s: float, max_request_bytes: int, port: int = 0,
                 idle_timeout_s: float | None = IDLE_TIMEOUT_S):  # fmt: skip
        self.hub, self.model = hub, model
        self.request_timeout_s, self.max_request_bytes = request_timeout_s, max_request_bytes
        self.requests = self.refused = 0
        # a connection idle this long (no request line, headers or body arriving) is closed, so a client
        # that never closes its connections cannot hold the server's threads and sockets for good
        handler = type("Handler", (_Handler,), {"endpoint": self, "timeout": idle_timeout_s})
        self.server = _Server(("127.0.0.1", port), handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="laminar-endpoint", daemon=True)
        self.thread.start()

    def base_url(self, sid: str | None = None) -> str:
        """The session's base URL; without one, the root URL (the session then goes in ``SESSION_HEADER``)."""
        return f"http://127.0.0.1:{self.port}/s/{sid}/v1" if sid else f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out at once, not 40 ms apart (delayed ACK)
    endpoint: Endpoint

    def log_message(self, *args) -> None:  # no access log on stderr
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        if status >= 400:
            self.endpoint.refused += 1
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client has gone (it timed out or was cancelled)
            self.close_connection = True

    def _route(self) -> tuple[str | None, str] | None:
        """``(session id or None, route)`` of the path, or None after answering 401/404."""
        auth = self.headers.get("Authorization", "")
        if auth != f"Bearer {self.endpoint.hub.token}":
            self._send(401, _error(401, "missing or wrong bearer token"))
            return None
        parts = self.path.split("?")[0].strip("/").split("/")
        sid = self.headers.get(SESSION_HEADER) or None
        if len(parts) >= 2 and parts[0] == "s":
            sid, parts = parts[1], parts[2:]
        if not parts or parts[0] != "v1":
            self._send(404, _error(404, f"no route {self.path}"))
            return None
        return sid, "/".join(parts[1:])

    def do_GET(self) -> None:
        got = self._route()
        if got is None:
            return
        if got[1] != "models":
            self._send(404, _error(404, f"no route GET {self.path}"))
            return
        model = {"id": self.endpoint.model, "object": "model", "created": 0, "owned_by": "laminar"}
        self._send(200, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            self.close_connection = True
            self._send(400, _error(400, "malformed request: Content-Length must be an integer"))
            return
        if length < 0 or length > self.endpoint.max_request_bytes:
            self.close_connection = True
            if 0 < length <= 64 << 20:  # read it, so the client hears the 413 instead of a reset
                while length > 0:
                    length -= len(self.rfile.read(min(length, 1 << 20)) or b"x" * length)
            self._send(413, _error(413, f"the request body must have a length of at most "
                                        f"{self.endpoint.max_request_bytes} bytes"))  # fmt: skip
            return
        raw = self.rfile.read(length)
        got = self._route()
        if got is None:
            return
        sid, route = got
        kinds = {"chat/completions": "chat", "completions": "completion"}
        if route not in kinds or (sid is None and not getattr(self.endpoint.hub, "sessionless", False)):
            self._send(404, _error(404, f"no route POST {self.path} (use the session's base URL)"))
            return
        self.endpoint.requests += 1
        try:
            req = parse_request(kinds[route], json.loads(raw or b"null"))
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            # a field of the wrong type, or JSON nested too deep: a 400, never a dropped connection
            status = getattr(e, "status", 400)
            detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            self._send(status, _error(status, f"malformed request: {detail}" if status == 400 else detail))
            return
        self._serve(sid, req)

    def _serve(self, sid: str, req: dict) -> None:
        from environments.agents.session import Call

        session = self.endpoint.hub.get(sid)
        if session is None:
            self._send(404, _error(404, f"no session {sid!r}"))
            return
        call = Call(req)
        try:
            session.post(call)
        except LookupError as e:
            self._send(410, _error(410, str(e)))
            return
        except BlockingIOError as e:
            self._send(409, _error(409, str(e)))
            return
        if not call.done.wait(self.endpoint.request_timeout_s):
            session.abandon(call)
            self._send(504, _error(504, f"no answer within {self.endpoint.request_timeout_s:g} s"))
            return
        if call.error is not None:
            self._send(call.error[0], _error(*call.error))
        elif req["stream"]:
            self._stream(stream_events(call.reply, req["kind"], self.endpoint.model, req["usage"]))
        else:
            self._send(200, completion_body(call.reply, req["kind"], self.endpoint.model))

    def _stream(self, events: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for e in events:
                self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:  # the client has gone
            pass
