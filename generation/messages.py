"""The rollout protocol's messages (``generation.protocol``), one typed model each, and their codecs.

A call is one of ``Call``'s kinds, told apart by ``op``; the worker answers each with a ``Reply``
whose ``result`` is the op's result model (``Queued``, ``StepResult``, ``AbortResult``, ``Loaded``) or
a plain status map. Token ids travel as raw ``int32`` bytes and log-probs as raw ``float64`` bytes
(``core.codec.Array``: exact, and decoded without per-element work).

A request on the wire carries only its prompt's id and tokens (``WireRequest``): the client keeps the
full ``PromptItem`` (text, answer) and re-attaches it to what comes back (``to_request``'s ``known``).
Each model states its invariant; decoding checks it (``core.codec.CodecError``, one line).

Standard library, numpy, msgpack, pydantic and the plain records only (vLLM's environment imports it).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal
from collections.abc import Mapping

from pydantic import Field, model_validator

from core.codec import Array, Codec, StrictModel
from generation.records import GenRequest, Partial, PromptItem, Trajectory

Tokens = Annotated[tuple[int, ...], Array("<i4")]
LogProbs = Annotated[tuple[float, ...], Array("<f8")]
Scalar = bool | int | float | str | None
RequestKey = tuple[str, int, int]
"""(prompt_id, group_uid, sample_idx): a request's identity on both sides."""


# ---------------------------------------------------------------------------------------- records
class WireRequest(StrictModel):
    """A ``GenRequest`` on the wire. Invariant: ``prompt_tokens`` is not empty."""

    prompt_id: str
    prompt_tokens: Tokens
    sample_idx: int
    group_uid: int

    @model_validator(mode="after")
    def _has_tokens(self) -> WireRequest:
        if not self.prompt_tokens:
            raise ValueError(f"request {self.prompt_id!r}: empty prompt_tokens")
        return self


class WirePartial(StrictModel):
    """A ``Partial`` on the wire. Invariant: ``len(tokens) == len(logprobs)``."""

    request: WireRequest
    tokens: Tokens
    logprobs: LogProbs
    version: int
    entropy_sum: float = 0.0

    @model_validator(mode="after")
    def _aligned(self) -> WirePartial:
        return _check_aligned(self, "partial")


class WireTrajectory(StrictModel):
    """A ``Trajectory`` of a single-turn response on the wire. Invariant: ``len(tokens) ==
    len(logprobs)``."""

    request: WireRequest
    tokens: Tokens
    logprobs: LogProbs
    version: int
    last_version: int = -1
    finished: bool
    text: str = ""
    mean_entropy: float = math.nan

    @model_validator(mode="after")
    def _aligned(self) -> WireTrajectory:
        return _check_aligned(self, "trajectory")


def _check_aligned(m: WirePartial | WireTrajectory, what: str):
    if len(m.tokens) != len(m.logprobs):
        r = m.request
        raise ValueError(
            f"{what} {(r.prompt_id, r.group_uid, r.sample_idx)}: "
            f"{len(m.tokens)} tokens but {len(m.logprobs)} logprobs"
        )
    return m


class Sampling(StrictModel):
    """A ``SamplingSpec`` on the wire."""

    temperature: float
    max_new_tokens: int
    seed: int


# ------------------------------------------------------------------------------ record <-> wire
def wire_request(r: GenRequest) -> WireRequest:
    return WireRequest.model_construct(
        prompt_id=r.prompt.prompt_id,
        prompt_tokens=r.prompt.prompt_tokens,
        sample_idx=int(r.sample_idx),
        group_uid=int(r.group_uid),
    )


def to_request(w: WireRequest, known: Mapping[RequestKey, GenRequest] | None = None) -> GenRequest:
    """The request ``w`` names: the caller's own record when ``known`` holds it, else one built from
    the wire fields (a prompt without text or answer)."""
    key = (w.prompt_id, w.group_uid, w.sample_idx)
    if known is not None and key in known:
        return known[key]
    return GenRequest(PromptItem(w.prompt_id, "", "", w.prompt_tokens), w.sample_idx, group_uid=w.group_uid)


def wire_partial(p: Partial) -> WirePartial:
    return WirePartial.model_construct(
        request=wire_request(p.request),
        tokens=p.tokens,
        logprobs=p.logprobs,
        version=int(p.version),
        entropy_sum=float(p.entropy_sum),
    )


def to_partial(w: WirePartial, known: Mapping[RequestKey, GenRequest] | None = None) -> Partial:
    return Partial(to_request(w.request, known), w.tokens, w.logprobs, w.version, w.entropy_sum)


def wire_trajectory(t: Trajectory) -> WireTrajectory:
    return WireTrajectory.model_construct(
        request=wire_request(GenRequest(t.prompt, t.sample_idx, t.group_uid)),
        tokens=t.response_tokens,
        logprobs=t.behaviour_logprobs,
        version=int(t.version),
        last_version=int(t.last_version),
        finished=bool(t.finished),
        text=t.text,
        mean_entropy=float(t.mean_entropy),
    )


def to_trajectory(w: WireTrajectory, known: Mapping[RequestKey, GenRequest] | None = None) -> Trajectory:
    req = to_request(w.request, known)
    return Trajectory(
        kind="trajectory",
        prompt=req.prompt,
        sample_idx=req.sample_idx,
        response_tokens=w.tokens,
        behaviour_logprobs=w.logprobs,
        version=w.version,
        finished=w.finished,
        text=w.text,
        mean_entropy=w.mean_entropy,
        group_uid=req.group_uid,
        last_version=w.last_version,
    )


# ------------------------------------------------------------------------------------------ calls
class Call(StrictModel):
    """One call to the worker; ``id`` is echoed in its reply."""

    id: int | None = None


class Hello(Call):
    op: Literal["hello"] = "hello"


class Submit(Call):
    op: Literal["submit"] = "submit"
    requests: tuple[WireRequest, ...]
    sampling: Sampling | None = None


class Inject(Call):
    op: Literal["inject"] = "inject"
    partials: tuple[WirePartial, ...]


class Step(Call):
    op: Literal["step"] = "step"
    max_steps: Annotated[int, Field(ge=0)]


class Abort(Call):
    """Abort ``request_ids`` (None: every in-flight sequence), and the queued requests too unless
    ``include_queued`` is False."""

    op: Literal["abort"] = "abort"
    request_ids: tuple[RequestKey, ...] | None = None
    include_queued: bool = True


class LoadWeights(Call):
    """Load the safetensors file at ``path`` (written by the client) as weight ``version``."""

    op: Literal["load_weights"] = "load_weights"
    version: int
    path: str


class Configure(Call):
    """Set what is given (None: leave as is)."""

    op: Literal["configure"] = "configure"
    admitting: bool | None = None
    version: int | None = None


class Status(Call):
    op: Literal["status"] = "status"


class Shutdown(Call):
    op: Literal["shutdown"] = "shutdown"


AnyCall = Annotated[
    Hello | Submit | Inject | Step | Abort | LoadWeights | Configure | Status | Shutdown,
    Field(discriminator="op"),
]


# ---------------------------------------------------------------------------------------- replies
class ErrorInfo(StrictModel):
    type: str
    message: str


class Reply(StrictModel):
    """The answer to call ``id``: ``ok`` with ``result`` (the op's result, plain data until its
    codec decodes it), else ``error``."""

    id: int | None = None
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None


class Queued(StrictModel):
    queued: int


class Loaded(StrictModel):
    version: int


class StepResult(StrictModel):
    finished: tuple[WireTrajectory, ...]
    status: dict[str, Scalar]


class AbortResult(StrictModel):
    partials: tuple[WirePartial, ...]
    requests: tuple[WireRequest, ...]


CALL: Codec = Codec(AnyCall, name="call", tagged=True)
REPLY: Codec[Reply] = Codec(Reply, name="reply")
QUEUED: Codec[Queued] = Codec(Queued, name="queued")
LOADED: Codec[Loaded] = Codec(Loaded, name="load_weights result")
STEP_RESULT: Codec[StepResult] = Codec(StepResult, name="step result")
ABORT_RESULT: Codec[AbortResult] = Codec(AbortResult, name="abort result")
