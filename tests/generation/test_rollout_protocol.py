"""Rollout protocol conformance: one suite run against every engine that speaks it.

- ``torch``: the built-in ``Engine`` in process;
- ``torch-static``: the static-slot variant (fixed-shape decode for CUDA graphs), in process;
- ``torch-process``: the same engine in a worker process, over the msgpack wire format;
- ``vllm-fake``: the vLLM worker (``VllmEngine``'s admission, abort, hand-over and weight-load
  bookkeeping, the wire) over ``tests/generation/fake_vllm``, a stand-in for vLLM's offline interfaces;
- ``vllm``: real vLLM's worker in its own environment (``make vllm-env``: the CPU build here, the CUDA
  build on a GPU), in the slow suite; skipped, with the reason, where vLLM is absent.

The model has heads of 32 dimensions, the smallest vLLM's CPU build runs.
"""

import importlib.util
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from conf.schema import EngineOptions, ModelConfig, RolloutConfig
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, save_model
from generation.adapter import sequence_logprobs
from generation.engine import Engine
from generation.engines import make_engine, vllm_python
from generation.protocol import REPO_ROOT, ProtocolError, RolloutEngine, SamplingSpec, request_id
from generation.records import GenRequest, PromptItem

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ModelConfig(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, max_seq_len=128
)
MAX_NEW = 12
CAP = 4
KINDS = ["torch", "torch-static", "torch-process", "vllm-fake", pytest.param("vllm", marks=pytest.mark.slow)]


def _model(tok, seed):
    """A random tiny model whose EOS row is scaled up, so responses end at varied lengths."""
    model = build_tiny_model(SMALL, tok, seed=seed)
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] *= 40
    return model.eval()


def _state(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _requests(tok, n=6, offset=0):
    items = [
        PromptItem(
            f"p{i}", f"What is {i}+2?", str(i + 2), encode_prompt(tok, f"What is {i}+2?" + "y" * (i % 5))
        )
        for i in range(offset, offset + n)
    ]
    return [GenRequest(p, s, group_uid=7 + i) for i, p in enumerate(items) for s in range(2)]


def _drain(engine, max_steps=3):
    out = []
    for _ in range(500):
        st = engine.status()
        if st["active"] == 0 and (st["queued"] == 0 or not st["admitting"]):
            return out
        out.extend(engine.step(max_steps))
    raise AssertionError("engine did not drain")


def _local(assets, state=None):
    eng = Engine(_model(assets["tok"], 0), assets["tok"], EngineOptions(capacity=CAP, max_new_tokens=MAX_NEW))
    if state is not None:
        eng.load_weights(0, state=state)
    return eng


@pytest.fixture(scope="module")
def assets(tmp_path_factory, one_thread):
    tok = build_char_tokenizer()
    a, b = _model(tok, 0), _model(tok, 1)
    model_dir = tmp_path_factory.mktemp("rollout-model")
    save_model(a, tok, model_dir)
    # the worker processes start in the background while the in-process engines are tested
    fake = str(Path(__file__).resolve().parent / "fake_vllm")
    pool = ThreadPoolExecutor(2)
    workers = {
        "torch-process": pool.submit(
            make_engine,
            str(model_dir),
            EngineOptions(
                capacity=CAP, max_new_tokens=MAX_NEW, rollout=RolloutConfig(engine="torch-process")
            ),
            env={"OMP_NUM_THREADS": "1"},
        ),
        "vllm-fake": pool.submit(
            make_engine,
            str(model_dir),
            EngineOptions(
                capacity=CAP,
                max_new_tokens=MAX_NEW,
                rollout=RolloutConfig(engine="vllm", vllm_python=sys.executable),
            ),
            env={"PYTHONPATH": os.pathsep.join([fake, str(REPO_ROOT)]), "OMP_NUM_THREADS": "1"},
        ),
    }
    reqs = _requests(tok)
    ref = Engine(_model(tok, 0), tok, EngineOptions(capacity=CAP, max_new_tokens=MAX_NEW))
    ref.submit(reqs)
    expected = {request_id(GenRequest(t.prompt, t.sample_idx, t.group_uid)): t for t in _drain(ref)}
    yield {
        "tok": tok,
        "A": _state(a),
        "B": _state(b),
        "dir": str(model_dir),
        "reqs": reqs,
        "expected": expected,
        "workers": workers,
    }
    for f in workers.values():
        f.result().close()  # idempotent: the engine fixture may have closed it already
    pool.shutdown()


def _vllm_interpreter():
    """A Python that can import vllm, or None."""
    py = vllm_python()
    if py is not None:
        ok = subprocess.run([py, "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0
        return py if ok else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@pytest.fixture(scope="module", params=KINDS)
def shared_engine(request, assets):
    kind = request.param
    if kind == "torch":
        eng = _local(assets)
    elif kind == "torch-static":  # the static-slot engine (CUDA-graph decode on a GPU), eager here
        eng = Engine(
            _model(assets["tok"], 0),
            assets["tok"],
            EngineOptions(capacity=CAP, max_new_tokens=MAX_NEW, rollout=RolloutConfig(static_cache=True)),
            static_width=24,
        )
    elif kind in ("vllm-fake", "torch-process"):
        eng = assets["workers"][kind].result()
        assert eng.info["engine"] == ("vllm" if kind == "vllm-fake" else "torch")
    else:
        py = _vllm_interpreter()
        if py is None:
            pytest.skip(
                "vLLM is not importable here: neither .venv-vllm/bin/python nor $LAMINAR_VLLM_PYTHON can "
                "import vllm, and this interpreter has no vllm module (run `make vllm-env` to test it)"
            )
        cuda = torch.cuda.is_available()
        rollout = RolloutConfig(
            engine="vllm",
            vllm_python=py,
            dtype="float32",  # the trainer's precision: its recompute must agree (bf16 differs by ~5e-3)
            vllm_gpu_memory_utilization=0.3,
            vllm_enforce_eager=not cuda,
        )
        eng = make_engine(
            assets["dir"],
            EngineOptions(capacity=CAP, max_new_tokens=MAX_NEW, rollout=rollout),
            device="cuda" if cuda else "cpu",
        )
    yield kind, eng
    eng.close()


@pytest.fixture
def engine(shared_engine, assets):
    """The module's engine of this kind, reset: nothing in flight, admitting, weights A as version 0."""
    kind, eng = shared_engine
    eng.abort(None)
    eng.admitting = True
    eng.load_weights(0, state=assets["A"])
    return kind, eng


def _deterministic(kind):
    return kind in ("torch", "torch-static", "torch-process")


def _key(t):
    return (t.prompt.prompt_id, t.group_uid, t.sample_idx)


def test_trajectories_are_version_tagged_with_behaviour_logprobs(engine, assets):
    kind, eng = engine
    assert isinstance(eng, RolloutEngine)
    tok = assets["tok"]
    eng.load_weights(3, state=assets["A"])
    assert eng.version == 3 and eng.status()["version"] == 3
    eng.submit(assets["reqs"])
    out = _drain(eng)
    assert sorted(_key(t) for t in out) == sorted(request_id(r) for r in assets["reqs"])
    for t in out:
        assert t.version == 3 and t.last_version in (3, -1)
        assert 1 <= len(t.response_tokens) == len(t.behaviour_logprobs) <= MAX_NEW
        assert all(math.isfinite(x) and x <= 1e-6 for x in t.behaviour_logprobs)
        assert t.finished == (t.response_tokens[-1] == tok.eos_token_id)
        assert t.prompt.answer != ""  # the caller's own records come back (answers stay client-side)
    if _deterministic(kind):  # the same sampler noise: the same tokens in process and across the pipe
        for t in out:
            ref = assets["expected"][_key(t)]
            assert t.response_tokens == ref.response_tokens and t.text == ref.text
            np.testing.assert_allclose(t.behaviour_logprobs, ref.behaviour_logprobs, atol=1e-5)


def test_status_counts_and_admission_switch(engine, assets):
    kind, eng = engine
    st = eng.status()
    assert (st["active"], st["queued"], st["capacity"], st["version"], st["admitting"]) == (
        0,
        0,
        CAP,
        0,
        True,
    )
    reqs = assets["reqs"][:6]
    eng.submit(reqs)
    assert eng.status()["queued"] == 6 and eng.status()["active"] == 0
    done = eng.step(1)
    st = eng.status()
    assert 1 <= st["active"] <= CAP and st["active"] + st["queued"] + len(done) == 6
    # a step makes progress, but not necessarily one token for every live request: real vLLM's first
    # step after an admission may sample for only some of them
    assert st["kv_tokens"] >= st["active"] * min(len(r.prompt.prompt_tokens) for r in reqs) + 1
    eng.admitting = False
    more = assets["reqs"][6:8]
    eng.submit(more)
    done += _drain(eng)
    st = eng.status()
    assert st["active"] == 0 and st["queued"] >= 2 and not st["admitting"]
    eng.admitting = True
    done += _drain(eng)
    assert sorted(_key(t) for t in done) == sorted(request_id(r) for r in reqs + more)
    assert eng.status()["queued"] == 0


def test_abort_hands_over_prefixes_that_continue_elsewhere(engine, assets):
    kind, eng = engine
    reqs, expected = assets["reqs"], assets["expected"]
    eng.submit(reqs)
    done = eng.step(3)
    running = eng.status()["active"]
    assert running >= 2
    # selective abort: one request only; the rest keep running
    first = next(iter({request_id(r) for r in reqs} - {_key(t) for t in done}))
    p1, q1 = eng.abort([first])
    assert len(p1) + len(q1) == 1
    partials, queued = eng.abort(None)
    partials, queued = p1 + partials, q1 + queued
    assert eng.status()["active"] == 0 and eng.status()["queued"] == 0 and eng.step(2) == []
    assert len(done) + len(partials) + len(queued) == len(reqs)
    for p in partials:
        assert p.version == 0 and len(p.tokens) == len(p.logprobs)
        assert all(math.isfinite(x) for x in p.logprobs)
        if _deterministic(kind):
            ref = expected[request_id(p.request)]
            assert ref.response_tokens[: len(p.tokens)] == p.tokens  # a prefix of the uninterrupted run
            np.testing.assert_allclose(p.logprobs, ref.behaviour_logprobs[: len(p.tokens)], atol=1e-5)
    assert any(p.tokens for p in partials)
    # continue them on another engine: the uninterrupted trajectories (counter-hash sampler)
    other = _local(assets, assets["A"])
    other.inject(partials)
    other.submit(queued)
    got = {_key(t): t for t in done + _drain(other)}
    assert got.keys() == expected.keys()
    for k, t in got.items():
        if _deterministic(kind):
            assert t.response_tokens == expected[k].response_tokens
        assert t.version == 0
    # and the other way round: another engine's partials continue on this one
    donor = _local(assets, assets["A"])
    donor.submit(reqs)
    done2 = donor.step(4)
    partials2, queued2 = donor.extract()
    eng.inject(partials2)
    eng.submit(queued2)
    cont = {_key(t): t for t in done2 + _drain(eng)}
    assert cont.keys() == expected.keys()
    for p in partials2:
        t = cont[request_id(p.request)]
        assert t.response_tokens[: len(p.tokens)] == p.tokens and t.version == 0
        if _deterministic(kind):
            assert t.response_tokens == expected[request_id(p.request)].response_tokens


def _recomputed_logprobs(tok, seed, t) -> np.ndarray:
    """The trainer's view: log-probs of ``t``'s response tokens under model ``seed`` (teacher-forced)."""
    tokens = list(t.prompt.prompt_tokens) + list(t.response_tokens)
    return np.array(sequence_logprobs(_model(tok, seed), tokens)[len(t.prompt.prompt_tokens) - 1 :])


def test_load_weights_moves_the_version_and_the_outputs(engine, assets):
    kind, eng = engine
    reqs, expected = assets["reqs"], assets["expected"]
    eng.load_weights(1, state=assets["B"])
    assert eng.version == 1
    eng.submit(reqs)
    new = {_key(t): t for t in _drain(eng)}
    assert all(t.version == 1 for t in new.values())
    if kind != "vllm-fake":  # the engine runs the loaded weights: the trainer's recompute agrees.
        # The fake computes no logits, so a worker that loads same-shape tensors wrongly (a transposed
        # square projection) passes against it and fails here against real vLLM (docs/scale-out.md).
        for t in new.values():
            np.testing.assert_allclose(
                t.behaviour_logprobs, _recomputed_logprobs(assets["tok"], 1, t), atol=2e-4, rtol=0
            )
    assert sum(new[k].response_tokens != expected[k].response_tokens for k in expected) >= len(expected) // 2
    eng.load_weights(2, state=assets["A"])
    eng.submit(reqs)
    back = {_key(t): t for t in _drain(eng)}
    assert all(t.version == 2 for t in back.values()) and back.keys() == expected.keys()
    if _deterministic(kind):
        assert all(back[k].response_tokens == expected[k].response_tokens for k in expected)
    # a load under sequences in flight: they finish, continued under the new weights
    eng.submit(reqs[:4])
    eng.step(2)
    eng.load_weights(5, state=assets["B"])
    rest = _drain(eng)
    assert {_key(t) for t in rest} <= {request_id(r) for r in reqs[:4]}
    assert any(t.last_version == 5 for t in rest) and all(t.version in (2, 5) for t in rest)


def test_bad_messages_give_clear_errors(engine, assets):
    kind, eng = engine
    tok = assets["tok"]
    with pytest.raises(ProtocolError, match="samples with"):
        eng.submit(assets["reqs"][:1], SamplingSpec(temperature=0.5, max_new_tokens=MAX_NEW, seed=0))
    bad_state = dict(assets["A"])
    bad_state.pop(next(iter(bad_state)))
    with pytest.raises((KeyError, ProtocolError), match="missing"):
        eng.load_weights(9, state=bad_state)
    assert eng.version == 0
    transposed = {k: (v.T.copy() if v.ndim == 2 else v) for k, v in assets["A"].items()}
    with pytest.raises((ValueError, ProtocolError), match="shape"):
        eng.load_weights(9, state=transposed)
    assert eng.version == 0
    with pytest.raises((ProtocolError, ValueError)):
        eng.submit([GenRequest(PromptItem("empty", "", "", ()), 0)])
    if hasattr(eng, "call_raw"):  # the wire: malformed frames and calls
        with pytest.raises(ProtocolError, match="undecodable"):
            eng.call_raw(b"\xc1\xc1 not msgpack")
        with pytest.raises(ProtocolError, match="must be a map"):
            eng.call_raw(b"\x93\x01\x02\x03")  # a msgpack list
        with pytest.raises(ProtocolError, match="unknown op 'frobnicate'"):
            eng.call("frobnicate")
        with pytest.raises(ProtocolError, match="missing field 'max_steps'"):
            eng.call("step")
        with pytest.raises(ProtocolError, match="field 'max_steps' must be int"):
            eng.call("step", max_steps="many")
        with pytest.raises(ProtocolError, match="missing field 'prompt_tokens'"):
            eng.call("submit", requests=[{"prompt_id": "x", "sample_idx": 0, "group_uid": 0}])
        with pytest.raises(ProtocolError, match="no weights file"):
            eng.call("load_weights", version=4, path="/nonexistent/weights.safetensors")
    # the engine still serves after every error
    st = eng.status()
    assert (st["active"], st["queued"], st["version"]) == (0, 0, 0)
    eng.submit(assets["reqs"][:2])
    assert len(_drain(eng)) == 2 and tok is not None


def test_protocol_and_worker_modules_import_without_torch_ray_or_prefect():
    code = (
        "import sys, generation.protocol, generation.vllm_worker\n"
        "bad = sorted(m for m in ('torch', 'ray', 'prefect', 'vllm') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_engine_options_map_the_rollout_section_to_the_worker_flags():
    from generation.engines import engine_kind, worker_command

    def flags(**rollout) -> list[str]:
        opts = EngineOptions(
            capacity=3, max_new_tokens=5, temperature=0.5, seed=7, rollout=RolloutConfig(**rollout)
        )
        return worker_command("/m", opts, python="py", device="cpu")

    torch_process = flags(engine="torch-process")
    assert torch_process[:5] == ["py", "-m", "generation.vllm_worker", "--engine", "torch"]
    assert torch_process[7:] == [
        "--device", "cpu", "--capacity", "3", "--max-new-tokens", "5", "--temperature", "0.5", "--seed", "7",
        "--dtype", "auto", "--sync-every", "0",
    ]  # fmt: skip
    assert flags(engine="vllm", vllm_gpu_memory_utilization=0.5, vllm_enforce_eager=True)[-3:] == [
        "--vllm-gpu-memory-utilization",
        "0.5",
        "--vllm-enforce-eager",
    ]
    assert flags(engine="torch-process", static_cache=True, vllm_enforce_eager=True)[-1] == "--static-cache"
    with pytest.raises(ValueError, match="rollout.engine='tpu'"):
        engine_kind(RolloutConfig.model_construct(engine="tpu"))  # past the schema, as a caller in code could
    if vllm_python() is None:  # no vLLM environment: a clear message, not a failed subprocess
        with pytest.raises(RuntimeError, match="make vllm-env"):
            make_engine(
                "/nonexistent",
                EngineOptions(rollout=RolloutConfig(engine="vllm", vllm_python="/nonexistent/python")),
            )
