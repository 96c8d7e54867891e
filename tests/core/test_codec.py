"""The one codec for records that cross processes (``core.codec``): the rollout protocol's messages
(``generation.messages``) and the RL checkpoint's records (``training.rl.control``)."""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest

from core.codec import CodecError, pack
from generation import messages as msg
from generation.protocol import ProtocolError, handle
from generation.records import GenRequest, Partial, PromptItem, Trajectory
from training.rl import control

# Written by the hand-written encoders of 81ce12b (the RL checkpoint's ``rl_state.json`` before the
# codec): a prompt, a request, a single-turn trajectory and a multi-turn one with its state.
CHECKPOINT_81CE12B = (Path(__file__).parent / "data" / "rl_state_records_81ce12b.json").read_text()

P7 = PromptItem("p7", "What is 2+3?", "5", (1, 40, 41, 42), level=3)
P8 = PromptItem("p8", "Use the calculator: 17*23", "391", (1, 50, 51), None)
T1 = Trajectory("trajectory", P7, 2, (7, 8, 9), (-0.125, -1.5e-08, -3.0), 4, True, "5", math.nan, 11, 5)
T2 = Trajectory(
    "trajectory", P8, 0, (60, 61, 62, 63, 64), (-0.5, 0.0, 0.0, -0.25, -2.0), 2, False, "calc(17*23) 391",
    0.75, 12, -1, loss_mask=(1, 0, 0, 1, 1), turns=2, tool_calls=1, end_reason="max_turns",
    env_state={"guesses": [3, 7], "history": [["calc", "17*23", 391]], "done": False},
)  # fmt: skip


def _same(a: Trajectory, b: Trajectory) -> bool:
    nan_ok = math.isnan(a.mean_entropy) and math.isnan(b.mean_entropy)
    return replace(a, mean_entropy=0.0) == replace(b, mean_entropy=0.0) if nan_ok else a == b


def test_checkpoints_written_before_the_codec_read_back_and_rewrite_byte_for_byte():
    saved = json.loads(CHECKPOINT_81CE12B)
    assert control.prompt_from_json(saved["prompt"]) == P7
    assert control.request_from_json(saved["request"]) == GenRequest(P8, 1, group_uid=12)
    t1, t2 = (control.trajectory_from_json(t) for t in saved["trajectories"])
    assert _same(t1, T1) and t2 == T2 and t2.env_state == T2.env_state
    assert isinstance(t2.response_tokens, tuple) and isinstance(t2.loss_mask, tuple)
    again = {
        "prompt": control.prompt_to_json(P7),
        "request": control.request_to_json(GenRequest(P8, 1, group_uid=12)),
        "trajectories": [control.trajectory_to_json(T1), control.trajectory_to_json(T2)],
    }
    assert json.dumps(again) == CHECKPOINT_81CE12B  # the same file, so a resume's hashes hold


def test_a_checkpoint_from_before_episodes_reads_with_the_fields_defaults():
    old = json.loads(CHECKPOINT_81CE12B)["trajectories"][0]
    for k in ("loss_mask", "turns", "tool_calls", "tool_errors", "end_reason", "env_state"):
        del old[k]
    assert _same(control.trajectory_from_json(old), T1)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"response_tokens": [7, "8", 9]}, "trajectory: response_tokens: item 1 must be int, got str"),
        ({"behaviour_logprobs": "fast"}, "trajectory: field 'behaviour_logprobs'"),
        ({"kind": "scored_group"}, "trajectory: field 'kind'"),
        ({"prompt": None}, "trajectory: field 'prompt' must be a map"),
        ({"version": None}, "trajectory: field 'version' must be int, got NoneType"),
    ],
)
def test_a_damaged_checkpoint_record_fails_with_one_line_naming_the_field(change, says):
    bad = {**json.loads(CHECKPOINT_81CE12B)["trajectories"][1], **change}
    with pytest.raises(CodecError) as e:
        control.trajectory_from_json(bad)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_messages_round_trip_exactly_with_arrays_as_raw_bytes():
    known = {("p8", 12, 0): GenRequest(P8, 0, group_uid=12)}
    wire = msg.wire_trajectory(T2)
    data = msg.STEP_RESULT.encode(msg.StepResult.model_construct(finished=(wire,), status={"version": 2}))
    plain = msgpack.unpackb(data, raw=False)
    sent = plain["finished"][0]
    assert sent["tokens"] == b"".join(x.to_bytes(4, "little") for x in T2.response_tokens)
    assert len(sent["logprobs"]) == 8 * len(T2.behaviour_logprobs)
    back = msg.STEP_RESULT.decode(data)
    t = msg.to_trajectory(back.finished[0], known)
    assert t.prompt is P8  # the caller's own record, text and answer included
    assert t.behaviour_logprobs == T2.behaviour_logprobs and t.response_tokens == T2.response_tokens
    p = Partial(GenRequest(P7, 2, group_uid=11), (7, 8), (-0.1, -1e-300), 4, 0.5)
    again = msg.to_partial(msg.ABORT_RESULT.decode(
        msg.ABORT_RESULT.encode(msg.AbortResult.model_construct(partials=(msg.wire_partial(p),), requests=()))
    ).partials[0])  # fmt: skip
    assert (again.tokens, again.logprobs, again.version, again.entropy_sum) == (p.tokens, p.logprobs, 4, 0.5)


def test_an_array_that_does_not_fit_its_dtype_is_refused_on_both_sides():
    with pytest.raises(CodecError, match="cannot encode call: .*<i4 array"):
        msg.CALL.encode(msg.Submit.model_construct(requests=(msg.wire_request(GenRequest(
            PromptItem("big", "", "", (1, 2**40)), 0)),), sampling=None))  # fmt: skip
    req = {"prompt_id": "x", "prompt_tokens": b"\x01\x00\x00", "sample_idx": 0, "group_uid": 0}
    with pytest.raises(CodecError, match="requests.0: field 'prompt_tokens' must be raw <i4 bytes"):
        msg.CALL.decode(pack({"op": "submit", "requests": [req]}))
    with pytest.raises(CodecError, match="must be raw <i4 bytes or a list of ints"):
        msg.CALL.decode(pack({"op": "submit", "requests": [{**req, "prompt_tokens": [1, True]}]}))


REQ = {"prompt_id": "x", "prompt_tokens": [1], "sample_idx": 0, "group_uid": 0}


class _Engine:
    version, admitting = 0, True

    def status(self):
        return {"version": 0, "active": 0, "queued": 0, "capacity": 4, "admitting": True}


@pytest.mark.parametrize(
    "call, says",
    [
        ((1, 2, 3), "call: must be a map, got tuple"),
        ({"op": "frobnicate"}, "call: unknown op 'frobnicate'; known: hello, submit"),
        ({"id": 3}, "call: needs a field 'op'"),
        ({"op": "step"}, "call step: missing field 'max_steps'"),
        ({"op": "step", "max_steps": True}, "call step: field 'max_steps' must be int, got bool"),
        ({"op": "step", "max_steps": -1}, "call step: field 'max_steps': input should be greater than"),
        ({"op": "abort", "request_ids": [["a", 1, "x"]]}, "call abort: request_ids.0: item 2 must be int"),
        (
            {"op": "inject", "partials": [{"request": REQ, "tokens": [1, 2], "logprobs": [-1.0], "version": 0}]},  # noqa: E501
            "call inject: partials.0: partial ('x', 0, 0): 2 tokens but 1 logprobs",
        ),
        (
            {"op": "submit", "requests": [{**REQ, "prompt_tokens": []}]},
            "call submit: requests.0: request 'x': empty prompt_tokens",
        ),
    ],
)  # fmt: skip
def test_a_bad_call_gets_one_line_naming_the_field(call, says):
    plain = msgpack.unpackb(pack(call), raw=False, use_list=False)  # as the worker reads it
    with pytest.raises(ProtocolError) as e:
        handle(_Engine(), plain, {})
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_a_pickle_on_the_wire_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(CodecError):
        msg.CALL.decode(pickle.dumps(Boom()))
    with pytest.raises(CodecError):  # a pickle inside a valid frame is only bytes
        msg.CALL.decode(pack({"op": "submit", "requests": pickle.dumps(Boom())}))
    assert not marker.exists()
