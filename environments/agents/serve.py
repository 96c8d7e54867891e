"""The agent endpoint over a checkpoint, outside training (``laminar serve-policy CKPT``): the same
routes, checks, token and loopback binding as under training (``environments.agents.server``), but
every request is answered on its own, at once, by sampling from the model with the request's own
``temperature`` (0: greedy), ``top_p`` (nucleus), ``max_tokens`` (up to ``max_tokens`` of the server
and the model's context), ``stop`` (decoding ends at the first stop string, which is cut from the
text) and ``n`` (that many independent samples, each its own choice). No sessions: a request goes to
the root URL (``http://127.0.0.1:PORT/v1``) or any session URL, and nothing is recorded or trained.
Log-probs are those of the distribution each token was sampled from (after temperature and
``top_p``; 0 for a greedy token), as under training. One request decodes at a time."""

from __future__ import annotations

import secrets
import threading

import torch

from environments.agents.chat import RequestError, message_format
from environments.agents.server import Endpoint


class PolicyServer:
    """``model`` and ``tokenizer`` behind an ``Endpoint`` on ``127.0.0.1:port`` (0: a free port);
    ``max_tokens``: the longest completion a request may ask for (and the default); ``seed``: the
    sampler's noise (one generator for the server's life)."""

    sessionless = True

    def __init__(self, model, tokenizer, *, port: int = 0, max_tokens: int = 256, seed: int = 0,
                 model_name: str = "laminar-policy", request_timeout_s: float = 300.0,
                 max_request_bytes: int = 4 << 20, tool_format: str = "auto"):  # fmt: skip
        self.model, self.tokenizer, self.max_tokens = model.eval(), tokenizer, max_tokens
        self.format = message_format(tokenizer, tool_format)
        self.token = secrets.token_urlsafe(32)
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.lock = threading.Lock()
        self.endpoint = Endpoint(self, model_name, request_timeout_s, max_request_bytes, port=port)

    @property
    def base_url(self) -> str:
        return self.endpoint.base_url()

    def get(self, sid):
        """The endpoint's session lookup: every request is served here (no sessions)."""
        return self

    def post(self, call) -> None:
        try:
            call.answer(self.answer(call.request))
        except RequestError as e:
            call.answer(error=(e.status, str(e)))

    def abandon(self, call) -> None:
        pass

    def close(self) -> None:
        self.endpoint.close()

    # ------------------------------------------------------------------------------------ answer
    def answer(self, req: dict) -> dict:
        """The reply to one checked request (``server.parse_request``): ``n`` choices."""
        if req["kind"] == "chat":
            ids = list(self.format.first(req["messages"], req["tools"]))
        else:
            ids = list(self.tokenizer(req["prompt"])["input_ids"])
        room = self.context - len(ids)
        if room < 1:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {self.context}")
        cap = min(req["max_tokens"] or self.max_tokens, self.max_tokens, room)
        temperature = 1.0 if req["temperature"] is None else float(req["temperature"])
        top_p = 1.0 if req["top_p"] is None else float(req["top_p"])
        with self.lock:
            choices = [self._choice(req, ids, cap, temperature, top_p) for _ in range(req["n"])]
        return {"prompt_tokens": len(ids), "choices": choices}

    def _choice(self, req: dict, ids: list[int], cap: int, temperature: float, top_p: float) -> dict:
        tokens, lps, hit = self.sample(ids, cap, temperature, top_p, req["stop"])
        eos = self.tokenizer.eos_token_id
        text = self.tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=True)
        for s in req["stop"]:
            at = text.find(s)
            if at >= 0:
                text, hit = text[:at], True
        content, calls = self.format.parse(text, req["call_tools"]) if req["kind"] == "chat" else (text, [])
        ended = hit or (tokens and tokens[-1] == eos)
        finish = "tool_calls" if calls else ("stop" if ended else "length")
        out = {"content": content, "tool_calls": calls, "finish_reason": finish,
               "completion_tokens": len(tokens), "want_logprobs": req["logprobs"]}  # fmt: skip
        if req["logprobs"]:
            out["token_texts"] = [self.tokenizer.decode([t]) for t in tokens]
            out["logprobs"] = lps
        return out

    @torch.no_grad()
    def sample(self, ids, cap: int, temperature: float, top_p: float, stop) -> tuple[list, list, bool]:
        """Up to ``cap`` tokens after ``ids`` (ending at EOS or a ``stop`` string), their log-probs under
        the distribution sampled from, and whether a stop string ended it."""
        eos = self.tokenizer.eos_token_id
        out = self.model(torch.tensor([ids]), use_cache=True)
        tokens, lps = [], []
        for _ in range(cap):
            logp = _sampling_logprobs(out.logits[0, -1].float(), temperature, top_p)
            if temperature == 0:
                tok = int(torch.argmax(logp))
            else:
                tok = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
            tokens.append(tok)
            lps.append(float(logp[tok]))
            if tok == eos:
                return tokens, lps, False
            if stop and any(s in self.tokenizer.decode(tokens, skip_special_tokens=True) for s in stop):
                return tokens, lps, True
            out = self.model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        return tokens, lps, False


def _sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution a token is drawn from: greedy (0 on the argmax, -inf elsewhere)
    at temperature 0, else softmax(logits / temperature) cut to its ``top_p`` nucleus (the most
    likely tokens whose mass reaches ``top_p``, at least one) and renormalized."""
    if temperature == 0:
        out = torch.full_like(logits, float("-inf"))
        out[int(torch.argmax(logits))] = 0.0
        return out
    logp = torch.log_softmax(logits / temperature, -1)
    if top_p < 1.0:
        order = torch.argsort(logp, descending=True)
        mass = torch.cumsum(logp[order].exp(), 0)
        drop = order[1:][mass[:-1] >= top_p]  # every token after the nucleus reached top_p
        logp = logp.clone()
        logp[drop] = float("-inf")
        logp = torch.log_softmax(logp, -1)
    return logp
