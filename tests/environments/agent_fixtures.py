"""Agents (written only against ``openai``) and a scripted engine for the agent tests."""

from __future__ import annotations

import asyncio
import time

import openai

from generation.records import Trajectory
from generation.sampler import request_key

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "integer arithmetic",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
    },
}


def _dump(message) -> dict:
    return message.model_dump(exclude_none=True)


async def three_turns(client, task):
    """Three requests with ``tools=``; a tool call is answered with ``16``, a turn without one with a
    user message; returns the last turn's text."""
    msgs = [{"role": "system", "content": "Use calc."}, {"role": "user", "content": task["prompt"]}]
    text = ""
    for _ in range(3):
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC], logprobs=True)
        m = r.choices[0].message
        msgs.append(_dump(m))
        for c in m.tool_calls or []:
            msgs.append({"role": "tool", "tool_call_id": c.id, "content": "16"})
        if not m.tool_calls:
            msgs.append({"role": "user", "content": "Go on."})
        text = m.content or ""
    return {"answer": text, "reward": 1.0}


async def rewrites_history(client, task):
    """The negative control: its second request edits the first user message."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC])
    msgs.append(_dump(r.choices[0].message))
    msgs.append({"role": "user", "content": "Go on."})
    msgs[0] = {"role": "user", "content": task["prompt"] + " (edited)"}
    await client.chat.completions.create(model="m", messages=msgs, tools=[CALC])
    return 0.5


async def raises(client, task):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    raise RuntimeError("the agent broke")


async def hangs(client, task):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}])
    await asyncio.sleep(3600)


async def silent(client, task):
    await asyncio.sleep(3600)  # never asks


async def exits(client, task):
    return None


async def streams(client, task):
    """One streamed chat request and one completion: the text both return."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    chunks = await client.chat.completions.create(model="m", messages=msgs, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    return {"answer": text}


async def completes(client, task):
    """Two ``/v1/completions`` requests, the second extending the first's prompt and completion; the
    log-probs the endpoint returned, per request."""
    prompt, lps = task["prompt"], []
    for _ in range(2):
        r = await client.completions.create(model="m", prompt=prompt, logprobs=1)
        lps.append(r.choices[0].logprobs.token_logprobs)
        prompt = prompt + r.choices[0].text + " Next:"
    return {"logprobs": lps}


async def malformed_first(client, task):
    """A request the endpoint refuses (400), then a good one: the episode goes on."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    try:
        await client.chat.completions.create(model="m", messages=msgs, n=3)
    except Exception as e:  # noqa: BLE001
        status = getattr(e, "status_code", None)
    r = await client.chat.completions.create(model="m", messages=msgs, logprobs=True)
    lps = [x.logprob for x in r.choices[0].logprobs.content]
    return {"status": status, "logprobs": lps, "reward": 1.0}


async def mixed(client, task):
    """By prompt: q0 raises, q1 hangs, q2 returns before asking, q3 sends a malformed request and
    then runs ``three_turns``."""
    behave = {"q0": raises, "q1": hangs, "q2": exits, "q3": malformed_first}
    return await behave.get(task["prompt_id"], three_turns)(client, task)


async def stops(client, task):
    """One request with ``stop`` and ``tool_choice='none'``: what the endpoint returned."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(
        model="m", messages=msgs, tools=[CALC], tool_choice="none", stop="16"
    )
    m = r.choices[0]
    return {"content": m.message.content, "calls": len(m.message.tool_calls or []), "finish": m.finish_reason}


class Scripted:
    """A generation engine (the continuous API ``EpisodeEngine`` drives) whose turns are scripted
    texts, tokenized and ended with EOS, log-prob -0.5 each; it records every row's context (the
    prompt tokens it consumed) and what it sampled, like ``tests.environments.test_episodes.Recording``."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.version, self.admitting, self.max_new_tokens, self.capacity = 0, True, 64, 64
        self.rows: list = []
        self.contexts: dict[tuple, tuple[int, ...]] = {}
        self.sampled: dict[tuple, tuple[int, ...]] = {}
        self.turn_of: dict[tuple, int] = {}

    def submit(self, requests, sampling=None):
        for r in requests:
            self.contexts[request_key(r)] = r.prompt.prompt_tokens
            self.rows.append(r)

    def inject(self, partials):
        self.submit([p.request for p in partials])

    def status(self):
        return {"active": len(self.rows), "queued": 0}

    def step(self, max_steps):
        out, rows, self.rows = [], self.rows, []
        for r in rows:
            base = (r.prompt.prompt_id.split("|")[0], r.group_uid, r.sample_idx)
            i = self.turn_of.get(base, 0)
            self.turn_of[base] = i + 1
            toks, text = self.turn(i)
            self.sampled[request_key(r)] = toks
            lps = (-0.5,) * len(toks)
            args = (r.prompt, r.sample_idx, toks, lps, self.version, True, text, 0.1, r.group_uid)
            out.append(Trajectory("trajectory", *args))
        return out

    def turn(self, i: int) -> tuple[tuple[int, ...], str]:
        """The tokens and text of an episode's turn ``i``: the script's text (its last one repeated),
        tokenized, then EOS."""
        text = self.script[min(i, len(self.script) - 1)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return (*ids, self.tokenizer.eos_token_id), text

    def extract(self, include_queued=True, only=None):
        rows, self.rows = self.rows, []
        return [], rows


async def sampling_probe(client, task):
    """Requests off the run's sampling (``task["params"]["off"]``: keyword sets) until one is served,
    then (if none was) one with the run's own values (``task["params"]["run"]``); returns each
    request's status (200 or the 4xx), the refusals' messages and the served turn's log-probs."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    statuses, messages = [], []
    for kw in [*task["params"]["off"], task["params"]["run"]]:
        try:
            r = await client.chat.completions.create(model="m", messages=msgs, logprobs=True, **kw)
        except openai.BadRequestError as e:
            statuses.append(e.status_code)
            messages.append(e.message)
            continue
        statuses.append(200)
        return {
            "statuses": statuses,
            "messages": messages,
            "lps": [x.logprob for x in r.choices[0].logprobs.content],
        }
    return {"statuses": statuses, "messages": messages, "lps": []}


# ------------------------------------------------------------------------------------------- faults
FAULT_KINDS = ("raise", "hang", "block", "leak", "malformed", "noauth")
"""The faults ``faulty`` plays, by the prefix of a task's ``prompt_id`` (any other prefix: a good agent)."""
LEAKED_CLIENTS = 100
LEAKED: list = []
"""The clients ``leak`` opened, held (as a framework that caches its clients holds them): their
connections stay open until the endpoint closes them (the test clears it)."""
MALFORMED_BODIES = {
    "bad_json": b'{"messages": [',
    "not_utf8": b"\xff\xfe\x00",
    "wrong_types": b'{"messages": "hi", "temperature": "hot"}',
    "tool_calls_not_a_list": b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]}',
    "stream_options_a_string": b'{"messages": [{"role": "user", "content": "x"}], "stream_options": "x"}',
    "nested_too_deep": b"[" * 100_000 + b"]" * 100_000,
    "tool_schema_not_an_object": b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": '
    b'"function", "function": {"name": "calc", "parameters": 5}}]}',
}
"""Request bodies a broken client sends (each must get a 400 and change nothing)."""


def fault_of(prompt_id: str) -> str:
    """The fault a prompt id stands for (``FAULT_KINDS``), or ``good``."""
    kind = prompt_id.split("-")[0]
    return kind if kind in FAULT_KINDS else "good"


async def calc_twice(client, task, statuses=None):
    """A good agent: asks with the ``calc`` tool, runs the call the model makes (any call answers
    ``3``; no call: it asks for the answer), asks again and returns that turn's text (with the HTTP
    statuses the agent saw, ``statuses``)."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    r = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC])
    m = r.choices[0].message
    msgs.append(_dump(m))
    for c in m.tool_calls or []:
        msgs.append({"role": "tool", "tool_call_id": c.id, "content": "3"})
    if not m.tool_calls:
        msgs.append({"role": "user", "content": "Answer."})
    r = await client.chat.completions.create(model="m", messages=msgs, tools=[CALC])
    return {"answer": r.choices[0].message.content or "", "calls": len(m.tool_calls or []),
            "statuses": [*(statuses or []), 200, 200]}  # fmt: skip


async def _raw_status(client, body: bytes, token: bool) -> int:
    """The HTTP status of ``body`` posted raw to the session's chat route (with or without the token);
    0 when the server drops the connection without an answer."""
    import httpx

    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {client.api_key}"
    async with httpx.AsyncClient(verify=False, trust_env=False, timeout=30.0) as raw:
        try:
            r = await raw.post(f"{client.base_url}chat/completions", content=body, headers=headers)
        except httpx.TransportError:
            return 0
        return r.status_code


async def _leak(client) -> list[int]:
    """``LEAKED_CLIENTS`` new clients on the session's base URL, each listing the models over its own
    connection, none ever closed (and all kept in ``LEAKED``)."""
    import httpx

    clients = [
        openai.AsyncOpenAI(
            base_url=str(client.base_url),
            api_key=client.api_key,
            max_retries=0,
            http_client=httpx.AsyncClient(verify=False, trust_env=False, timeout=30.0),
        )
        for _ in range(LEAKED_CLIENTS)
    ]
    LEAKED.extend(clients)
    replies = await asyncio.gather(*(c.models.with_raw_response.list() for c in clients))
    return [r.status_code for r in replies]


async def faulty(client, task):
    """By ``fault_of(task["prompt_id"])``: ``raise`` raises after its first request; ``hang`` sleeps past any
    timeout after it; ``block`` blocks its thread (``time.sleep``, ``params["block_s"]``); ``leak`` opens
    ``LEAKED_CLIENTS`` clients it never closes; ``malformed`` posts ``MALFORMED_BODIES`` with the token;
    ``noauth`` posts without the token and with a wrong one. The last three then run ``calc_twice`` (with the
    statuses they saw), as ``good`` does."""
    kind = fault_of(task["prompt_id"])
    msgs = [{"role": "user", "content": task["prompt"]}]
    if kind == "raise":
        await client.chat.completions.create(model="m", messages=msgs)
        raise RuntimeError("fault: the agent broke")
    if kind == "hang":
        await client.chat.completions.create(model="m", messages=msgs)
        await asyncio.sleep(3600)
    if kind == "block":  # a synchronous call that blocks its thread (and its event loop) past the timeout
        await client.chat.completions.create(model="m", messages=msgs)
        time.sleep(task["params"].get("block_s", 3600))
    statuses: list[int] = []
    if kind == "leak":
        statuses = await _leak(client)
    elif kind == "malformed":
        statuses = [await _raw_status(client, body, token=True) for body in MALFORMED_BODIES.values()]
    elif kind == "noauth":
        statuses = [await _raw_status(client, b'{"messages": [{"role": "user", "content": "x"}]}', False)]
        wrong = client.with_options(api_key="wrong")
        try:
            await wrong.chat.completions.create(model="m", messages=msgs)
            statuses.append(200)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)
    return await calc_twice(client, task, statuses)


REFUSED = "FORBIDDEN"
"""A message text the raising chat template of ``test_agent_faults`` refuses (``raise_exception``)."""


async def template_refused(client, task):
    """Requests the model's chat template refuses (a message with ``REFUSED``) as the first request and
    as a later one, each followed by a good one: the statuses it saw."""
    statuses, user = [], {"role": "user", "content": task["prompt"]}
    for msgs in ([{"role": "user", "content": REFUSED}], [user]):
        try:
            r = await client.chat.completions.create(model="m", messages=msgs)
            statuses.append(200)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)
    history = [user, _dump(r.choices[0].message)]
    for text in (REFUSED, "Go on."):
        try:
            await client.chat.completions.create(
                model="m", messages=[*history, {"role": "user", "content": text}]
            )
            statuses.append(200)
        except openai.APIStatusError as e:
            statuses.append(e.status_code)
    return {"statuses": statuses}
