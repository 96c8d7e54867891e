"""The agent endpoint over a checkpoint, outside training (``laminar serve-policy CKPT``): the same
routes, checks, token and loopback binding as under training (``environments.agents.server``), but
every request is sampled from the model with the request's own ``temperature`` (0: greedy),
``top_p`` (nucleus), ``max_tokens`` (up to ``max_tokens`` of the server and the model's context),
``stop`` (decoding ends at the first stop string, which is cut from the text) and ``n`` (that many
independent samples, each its own choice). No sessions: a request goes to the root URL
(``http://127.0.0.1:PORT/v1``) or any session URL, and nothing is recorded or trained. Log-probs are
those of the distribution each token was sampled from (after temperature and ``top_p``; 0 for a
greedy token), as under training.

Continuous batching: one decode thread owns the model. A request becomes ``n`` rows (one per choice);
rows decode together, one token per row per step, each sampled with its own request's settings, and
between two steps rows that finished leave (their request is answered once all its rows have) and
waiting rows join (one prefill, then every row decodes in the same step), so a request never waits
for the batch to drain. At most ``max_batch`` rows decode at once (1: one row at a time, the
unbatched path); the rest wait in arrival order. The HTTP threads only queue a request and wait for
its answer; a request the endpoint gives up on (``request_timeout_s``: 504) leaves the queue or the
batch at the next step."""

from __future__ import annotations

import collections
import secrets
import sys
import threading
import traceback
from dataclasses import dataclass, field

import torch

from environments.agents.chat import RequestError, message_format
from environments.agents.server import Endpoint
from generation.rows import merge_rows, select_rows


@dataclass(eq=False)
class _Job:
    """One request (``call``) in the decoder: its prompt ``ids``, its settings, its choices by index
    (None until that row finished)."""

    call: object
    ids: list[int]
    cap: int
    temperature: float
    top_p: float
    choices: list = field(default_factory=list)


@dataclass(eq=False)
class _Row:
    """One choice of a job being decoded: the tokens sampled so far, their log-probs, whether a stop
    string ended it (``hit``) and whether it has ended (EOS, stop string or its cap)."""

    job: _Job
    index: int
    tokens: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    hit: bool = False
    ended: bool = False


class _Batch:
    """The running rows' KV cache: one ``DynamicCache`` whose columns are left-padded so that every
    row's newest cached token sits in the last column (``attn`` [B, T] marks the real columns,
    ``pos`` [B] is each pending token's position id), as in ``generation.rows.DynamicRows``. The cache
    holds each row's prompt and every sampled token but the last, which is pending in ``next`` [B].
    Rows join and leave through the engine's own ``merge_rows`` and ``select_rows``."""

    def __init__(self, model, pad_id: int, device):
        self.model, self.pad_id, self.device = model, pad_id, device
        self.reset()

    def reset(self) -> None:
        self.rows: list[_Row] = []
        self.cache = None
        self.attn = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.next = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)

    def join(self, rows: list[_Row]) -> torch.Tensor:
        """Prefill ``rows`` (identical prompts once) and append them; the logits [b, V] of their next
        token (the caller samples it and sets ``next[-b:]``)."""
        from generation.model_calls import prefill

        seqs = [tuple(r.job.ids) for r in rows]
        unique = list(dict.fromkeys(seqs))
        cache, attn, logits = prefill(self.model, [list(s) for s in unique], self.pad_id, self.device)
        if len(unique) < len(seqs):
            at = {s: i for i, s in enumerate(unique)}
            pick = torch.tensor([at[s] for s in seqs], dtype=torch.long, device=self.device)
            attn, logits = select_rows(cache, attn, pick), logits.index_select(0, pick)
        pos = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=self.device)
        self._merge(cache, attn)
        self.rows.extend(rows)
        self.next = torch.cat([self.next, torch.zeros(len(rows), dtype=torch.long, device=self.device)])
        self.pos = torch.cat([self.pos, pos])
        return logits

    def _merge(self, cache, attn: torch.Tensor) -> None:
        if self.cache is None:
            self.cache, self.attn = cache, attn
        else:
            self.attn = merge_rows(self.cache, self.attn, cache, attn)

    def step(self) -> torch.Tensor:
        """Feed every row's pending token: the logits [B, V] of the next one."""
        ones = torch.ones((len(self.rows), 1), dtype=torch.long, device=self.device)
        attn = torch.cat([self.attn, ones], 1)
        out = self.model(input_ids=self.next[:, None], attention_mask=attn, position_ids=self.pos[:, None],
                         past_key_values=self.cache, use_cache=True)  # fmt: skip
        self.attn = attn
        self.pos = self.pos + 1
        return out.logits[:, -1, :]

    def keep(self, keep: list[int]) -> None:
        """Only rows ``keep`` (indices) stay; leading columns no remaining row attends to are cut."""
        if not keep:
            self.reset()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.attn = select_rows(self.cache, self.attn, idx)
        self.next, self.pos = self.next.index_select(0, idx), self.pos.index_select(0, idx)
        self.rows = [self.rows[i] for i in keep]


class PolicyServer:
    """``model`` and ``tokenizer`` behind an ``Endpoint`` on ``127.0.0.1:port`` (0: a free port);
    ``max_tokens``: the longest completion a request may ask for (and the default); ``seed``: the
    sampler's noise (one generator for the server's life); ``max_batch``: the most rows (choices)
    decoding at once. ``steps``, ``peak_rows`` and ``dropped_rows`` count decode steps, the most rows
    one step decoded, and rows of abandoned requests dropped before they ended."""

    sessionless = True

    def __init__(self, model, tokenizer, *, port: int = 0, max_tokens: int = 256, seed: int = 0,
                 model_name: str = "laminar-policy", request_timeout_s: float = 300.0,
                 max_request_bytes: int = 4 << 20, tool_format: str = "auto",
                 max_batch: int = 32):  # fmt: skip
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.tokenizer, self.max_tokens = model.eval(), tokenizer, max_tokens
        self.format = message_format(tokenizer, tool_format)
        self.token = secrets.token_urlsafe(32)
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.max_batch, self.eos = max_batch, tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.batch = _Batch(self.model, pad if pad is not None else 0, next(model.parameters()).device)
        self.waiting: collections.deque[_Row] = collections.deque()
        self.joining: list[_Row] = []  # rows between the queue and the batch (their prefill)
        self.steps = self.peak_rows = self.dropped_rows = 0
        self.cond = threading.Condition()
        self.inbox: list = []  # calls posted, not yet in the decoder
        self.gone: list = []  # calls abandoned, not yet dropped by the decoder
        self.open: dict[int, object] = {}  # id -> every call posted and not answered
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="laminar-serve-decode", daemon=True)
        self.thread.start()
        self.endpoint = Endpoint(self, model_name, request_timeout_s, max_request_bytes, port=port)

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url()

    def active(self) -> int:
        """Rows decoding now."""
        return len(self.batch.rows)

    def get(self, sid):
        """The endpoint's session lookup: every request is served here (no sessions)."""
        return self

    def post(self, call) -> None:
        """Queue a request for the decoder (the HTTP thread; returns at once)."""
        with self.cond:
            if self.closed:
                call.answer(error=(503, "the server is closing"))
                return
            self.open[id(call)] = call
            self.inbox.append(call)
            self.cond.notify()

    def abandon(self, call) -> None:
        """The endpoint gave up on ``call``: its rows leave the queue or the batch at the next step."""
        with self.cond:
            if self.open.pop(id(call), None) is call:
                self.gone.append(call)
                self.cond.notify()

    def close(self) -> None:
        self.endpoint.close()
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=60)
        with self.cond:
            calls, self.open = list(self.open.values()), {}
        for call in calls:
            call.answer(error=(503, "the server closed"))

    def _reply(self, call, reply: dict | None = None, error: tuple[int, str] | None = None) -> None:
        with self.cond:
            if self.open.pop(id(call), None) is not call:
                return  # abandoned meanwhile: the endpoint answered it
        call.answer(reply, error)

    # ------------------------------------------------------------------------------- the decoder
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self.cond:
                    while not (self.closed or self.inbox or self.gone or self.waiting or self.batch.rows):
                        self.cond.wait()
                    if self.closed:
                        return
                    inbox, self.inbox = self.inbox, []
                    gone, self.gone = self.gone, []
                try:
                    self._iteration(inbox, gone)
                except Exception as e:  # a failed forward fails what was decoding, not the server
                    traceback.print_exc(file=sys.stderr)
                    self._fail(f"decoding failed: {type(e).__name__}: {e}")

    def _iteration(self, inbox: list, gone: list) -> None:
        """Drop abandoned requests, queue new ones, admit waiting rows, then one decode step."""
        gone_ids = {id(c) for c in gone}
        self._drop(gone_ids)
        for call in inbox:
            if id(call) not in gone_ids:
                self._prepare(call)
        free = self.max_batch - len(self.batch.rows)
        if free > 0 and self.waiting:
            self.joining = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            rows, logits = self.joining, self.batch.join(self.joining)
            self.joining = []
            self.batch.next[-len(rows) :] = self._sample(rows, logits)
            self._retire()
        if self.batch.rows:
            rows = self.batch.rows
            self.batch.next = self._sample(rows, self.batch.step())
            self.steps += 1
            self.peak_rows = max(self.peak_rows, len(rows))
            self._retire()

    def _prepare(self, call) -> None:
        """A request's prompt ids and settings, as ``n`` waiting rows (or its 400: a prompt past the
        context, or one the chat template refuses to render, ends only its own request)."""
        req = call.request
        try:
            if req["kind"] == "chat":
                ids = list(self.format.first(req["messages"], req["tools"]))
            else:
                ids = list(self.tokenizer(req["prompt"])["input_ids"])
            room = self.context - len(ids)
            if room < 1:
                raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {self.context}")
        except RequestError as e:
            self._reply(call, error=(e.status, str(e)))
            return
        except Exception as e:  # e.g. a chat template that raises on this conversation
            self._reply(call, error=(400, f"the prompt could not be rendered: {type(e).__name__}: {e}"))
            return
        cap = min(req["max_tokens"] or self.max_tokens, self.max_tokens, room)
        temperature = 1.0 if req["temperature"] is None else float(req["temperature"])
        top_p = 1.0 if req["top_p"] is None else float(req["top_p"])
        job = _Job(call, ids, cap, temperature, top_p, [None] * req["n"])
        self.waiting.extend(_Row(job, i) for i in range(req["n"]))

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token from its logits [B, V], under its own request's settings (greedy rows
        by one argmax, sampled rows by one tempered softmax and one draw, each cut to its own nucleus);
        records the token, its log-prob and whether the row ended. The tokens [B], on the model's device."""
        logits = logits.float().cpu()
        toks, lps = logits.argmax(-1), torch.zeros(len(rows))
        hot = [i for i, r in enumerate(rows) if r.job.temperature != 0]
        if hot:
            at = torch.tensor(hot, dtype=torch.long)
            temps = torch.tensor([rows[i].job.temperature for i in hot], dtype=torch.float32)
            logp = torch.log_softmax(logits[at] / temps[:, None], -1)
            for j, i in enumerate(hot):
                if rows[i].job.top_p < 1.0:
                    logp[j] = _nucleus(logp[j], rows[i].job.top_p)
            drawn = torch.multinomial(logp.exp(), 1, generator=self.generator)
            toks[at], lps[at] = drawn[:, 0], logp.gather(1, drawn)[:, 0]
        for row, tok, lp in zip(rows, toks.tolist(), lps.tolist()):
            row.tokens.append(tok)
            row.lps.append(lp)
            self._end(row, tok)
        return toks.to(self.batch.device)

    def _end(self, row: _Row, tok: int) -> None:
        """Whether ``row`` ended with ``tok``: EOS, a stop string in its text (``hit``), or its cap."""
        stop = row.job.call.request["stop"]
        if tok == self.eos:
            row.ended = True
        elif stop and any(s in self.tokenizer.decode(row.tokens, skip_special_tokens=True) for s in stop):
            row.ended = row.hit = True
        else:
            row.ended = len(row.tokens) >= row.job.cap

    def _retire(self) -> None:
        """Ended rows leave the batch; a request whose rows all ended is answered."""
        rows = self.batch.rows
        if not any(r.ended for r in rows):
            return
        self.batch.keep([i for i, r in enumerate(rows) if not r.ended])
        for row in rows:
            if row.ended:
                job = row.job
                try:
                    job.choices[row.index] = self._choice(row)
                except Exception as e:  # a reply that cannot be parsed fails its own request only
                    self._reply(job.call, error=(500, f"no reply could be built: {type(e).__name__}: {e}"))
                    continue
                if all(c is not None for c in job.choices):
                    self._reply(job.call, {"prompt_tokens": len(job.ids), "choices": job.choices})

    def _drop(self, ids: set[int]) -> None:
        """The rows of the abandoned calls ``ids`` leave the queue and the batch."""
        if not ids:
            return
        before = len(self.waiting) + len(self.batch.rows)
        self.waiting = collections.deque(r for r in self.waiting if id(r.job.call) not in ids)
        self.batch.keep([i for i, r in enumerate(self.batch.rows) if id(r.job.call) not in ids])
        self.dropped_rows += before - len(self.waiting) - len(self.batch.rows)

    def _fail(self, message: str) -> None:
        """Every request in the batch, joining it or in the queue is answered with a 500 ``message``."""
        jobs = {id(r.job): r.job for r in [*self.batch.rows, *self.joining, *self.waiting]}
        self.batch.reset()
        self.waiting.clear()
        self.joining = []
        for job in jobs.values():
            self._reply(job.call, error=(500, message))

    def _choice(self, row: _Row) -> dict:
        """A finished row's choice: its text (cut at the first stop string), tool calls, finish reason."""
        req, tokens = row.job.call.request, row.tokens
        text = self.tokenizer.decode([t for t in tokens if t != self.eos], skip_special_tokens=True)
        hit = row.hit
        for s in req["stop"]:
            at = text.find(s)
            if at >= 0:
                text, hit = text[:at], True
        content, calls = self.format.parse(text, req["call_tools"]) if req["kind"] == "chat" else (text, [])
        ended = hit or (tokens and tokens[-1] == self.eos)
        finish = "tool_calls" if calls else ("stop" if ended else "length")
        out = {"content": content, "tool_calls": calls, "finish_reason": finish,
               "completion_tokens": len(tokens), "want_logprobs": req["logprobs"]}  # fmt: skip
        if req["logprobs"]:
            out["token_texts"] = [self.tokenizer.decode([t]) for t in tokens]
            out["logprobs"] = row.lps
        return out


def _sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution a token is drawn from: greedy (0 on the argmax, -inf elsewhere)
    at temperature 0, else softmax(logits / temperature) cut to its ``top_p`` nucleus (the most
    likely tokens whose mass reaches ``top_p``, at least one) and renormalized."""
    if temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        out[int(torch.argmax(logits))] = 0.0
        return out
    return _nucleus(torch.log_softmax(logits / temperature, -1), top_p)


def _nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """``logp`` [V] cut to its ``top_p`` nucleus and renormalized (itself when ``top_p`` is 1)."""
    if top_p >= 1.0:
        return logp
    order = torch.argsort(logp, descending=True)
    mass = torch.cumsum(logp[order].exp(), 0)
    drop = order[1:][mass[:-1] >= top_p]  # every token after the nucleus reached top_p
    logp = logp.clone()
    logp[drop] = float("-inf")
    return torch.log_softmax(logp, -1)
