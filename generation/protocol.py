"""The rollout protocol: what the runtime asks of a generation engine, in process or across a pipe.

Every rollout engine (the built-in ``generation.engine.Engine``, vLLM in its own Python environment) speaks
``RolloutEngine``:

- ``submit(requests, sampling=None)``: queue prompts (token ids, request ids = (prompt id, group_uid,
  sample_idx), optional ``SamplingSpec``);
- ``step(max_steps)``: decode; returns the ``Trajectory``s that finished, each tagged with the weight
  version that sampled it and carrying its behaviour log-probs (one per response token);
- ``abort(request_ids=None, include_queued=True)``: take in-flight sequences out as ``Partial``s
  (tokens so far, their log-probs, version) plus still-queued requests, for repack;
- ``inject(partials)``: continue handed-over partials (first in line, admitted even when not
  ``admitting``);
- ``load_weights(version, state=None, path=None)``: new weights, as named arrays or a safetensors
  file; the version moves with them;
- ``status()``: ``version``, ``active``, ``queued``, ``capacity``, ``kv_tokens``, ``admitting``.

``generation.engine.Engine``'s own names (``extract``, ``load_state``) are kept as aliases so the runtime can
drive any engine through one surface.

**Wire format** (``EngineProcess`` <-> ``serve``): frames on the worker's stdin/stdout, each a 4-byte
big-endian length then one msgpack map. A call is ``{"id": n, "op": name, ...fields}``; the reply is
``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false, "error": {"type", "message"}}``.
Every call, reply and result is a typed model of ``generation.messages`` encoded by the one codec
(``core.codec``: token ids and log-probs as raw bytes); each side validates what it decodes. A bad
message (undecodable, not a map, unknown op, missing or mistyped field) gets an error reply naming
the field, and the worker keeps serving. Weights never travel inline: the client writes one
safetensors file (in ``/dev/shm`` when it exists) and sends its path; nothing is pickled. Ops:
``hello``, ``submit``, ``inject``, ``step``, ``abort``, ``load_weights``, ``configure``
(``admitting``, ``version``), ``status``, ``shutdown``.

This module imports neither torch nor Ray nor Prefect (only the standard library, numpy, msgpack,
pydantic and the plain records), so vLLM's environment can import it; safetensors is imported when
weights move.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from core.codec import Codec, CodecError, pack, unpack
from generation import messages as msg
from generation.records import GenRequest, Partial, Trajectory

PROTOCOL_VERSION = 2  # 2: token ids and log-probs as raw bytes (generation.messages)
MAX_FRAME = 1 << 30
REPO_ROOT = Path(__file__).resolve().parents[1]


class ProtocolError(RuntimeError):
    """A malformed message, an unsupported request, or an engine-side failure reported over the
    protocol (``remote_type`` names the exception raised on the other side)."""

    def __init__(self, message: str, remote_type: str = "ProtocolError"):
        super().__init__(message)
        self.remote_type = remote_type


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: the temperature the behaviour log-probs refer to, the response length cap and
    the seed of the sampler's noise."""

    temperature: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0


RequestId = tuple  # (prompt_id: str, group_uid: int, sample_idx: int)


def request_id(req: GenRequest) -> RequestId:
    return (req.prompt.prompt_id, int(req.group_uid), int(req.sample_idx))


@runtime_checkable
class RolloutEngine(Protocol):
    """The engine surface the runtime drives (see the module docstring)."""

    version: int
    admitting: bool
    capacity: int

    def submit(self, requests: Sequence[GenRequest], sampling: SamplingSpec | None = None) -> None: ...

    def inject(self, partials: Sequence[Partial]) -> None: ...

    def step(self, max_steps: int) -> list[Trajectory]: ...

    def abort(
        self, request_ids: Iterable[RequestId] | None = None, include_queued: bool = True
    ) -> tuple[list[Partial], list[GenRequest]]: ...

    def load_weights(
        self, version: int, state: Mapping[str, np.ndarray] | None = None, path: str | None = None
    ) -> None: ...

    def status(self) -> dict: ...

    def close(self) -> None: ...


class EngineBase:
    """Shared conveniences for ``RolloutEngine`` implementations: the ``generation.engine.Engine`` aliases
    and the sampling check."""

    sampling: SamplingSpec

    def extract(self, include_queued: bool = True) -> tuple[list[Partial], list[GenRequest]]:
        return self.abort(None, include_queued)

    def load_state(self, state: Mapping[str, np.ndarray], version: int) -> None:
        self.load_weights(version, state=state)

    def check_sampling(self, sampling: SamplingSpec | None) -> None:
        """Engines sample at the temperature, cap and seed they were built with (the behaviour
        log-probs and the batch-independent noise depend on them): a different spec is an error."""
        if sampling is not None and sampling != self.sampling:
            raise ProtocolError(
                f"this engine samples with {self.sampling}, got {sampling}: start an engine "
                "with those sampling settings instead"
            )

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(path)


def weights_dir() -> str:
    """Where weight files for a worker go: shared memory when the OS has it."""
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


def write_weights(state: Mapping[str, np.ndarray], directory: str | None = None) -> str:
    """One safetensors file holding ``state``; returns its path (the caller deletes it)."""
    from safetensors.numpy import save_file

    fd, path = tempfile.mkstemp(
        prefix="laminar-weights-", suffix=".safetensors", dir=directory or weights_dir()
    )
    os.close(fd)
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, path)
    return path


# --------------------------------------------------------------------------------------- framing


def write_frame(stream: IO[bytes], obj: Any) -> None:
    """One frame holding ``obj`` (msgpack-ready data: a model's ``Codec.dump``)."""
    write_raw_frame(stream, pack(obj))


def write_raw_frame(stream: IO[bytes], data: bytes) -> None:
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame_bytes(stream: IO[bytes]) -> bytes | None:
    """The next frame's payload, or None at end of stream."""
    head = _read_exact(stream, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    data = _read_exact(stream, n)
    if data is None:
        raise ProtocolError("stream ended inside a frame")
    return data


# ------------------------------------------------------------------------------------ worker side


def _status_clean(st: Mapping) -> dict:
    return {k: (v if isinstance(v, (bool, int, float, str)) or v is None else str(v)) for k, v in st.items()}


def handle(engine, call: Any, info: Mapping) -> tuple[Any, bool]:
    """Run one call (a ``generation.messages`` call model, or its plain data, validated here) against
    ``engine``: (result as msgpack-ready data, keep_serving). Raises ProtocolError (or the engine's
    own error) for a bad call; ``serve`` turns it into an error reply."""
    if not isinstance(call, msg.Call):
        try:
            call = msg.CALL.from_plain(call)
        except CodecError as e:
            raise ProtocolError(str(e)) from None
    run = _OPS.get(type(call))
    if run is None:
        raise ProtocolError(f"unknown call {type(call).__name__}")
    return run(engine, call, info), not isinstance(call, msg.Shutdown)


def _hello(engine, call: msg.Hello, info: Mapping) -> dict:
    return {"protocol": PROTOCOL_VERSION, **info, "status": _status_clean(engine.status())}


def _submit(engine, call: msg.Submit, info: Mapping) -> dict:
    s = call.sampling
    spec = None if s is None else SamplingSpec(s.temperature, s.max_new_tokens, s.seed)
    engine.submit([msg.to_request(r) for r in call.requests], spec)
    return {"queued": engine.status()["queued"]}


def _inject(engine, call: msg.Inject, info: Mapping) -> dict:
    engine.inject([msg.to_partial(p) for p in call.partials])
    return {"queued": engine.status()["queued"]}


def _step(engine, call: msg.Step, info: Mapping) -> dict:
    done = engine.step(call.max_steps)
    return msg.STEP_RESULT.dump(
        msg.StepResult.model_construct(
            finished=tuple(msg.wire_trajectory(t) for t in done), status=_status_clean(engine.status())
        )
    )


def _abort(engine, call: msg.Abort, info: Mapping) -> dict:
    ids = None if call.request_ids is None else list(call.request_ids)
    parts, reqs = engine.abort(ids, call.include_queued)
    return msg.ABORT_RESULT.dump(
        msg.AbortResult.model_construct(
            partials=tuple(msg.wire_partial(p) for p in parts),
            requests=tuple(msg.wire_request(r) for r in reqs),
        )
    )


def _load_weights(engine, call: msg.LoadWeights, info: Mapping) -> dict:
    if not os.path.isfile(call.path):
        raise ProtocolError(f"load_weights: no weights file at {call.path}")
    engine.load_weights(call.version, path=call.path)
    return {"version": engine.version}


def _configure(engine, call: msg.Configure, info: Mapping) -> dict:
    if call.admitting is not None:
        engine.admitting = call.admitting
    if call.version is not None:
        engine.version = call.version
    return _status_clean(engine.status())


def _status(engine, call: msg.Call, info: Mapping) -> dict:
    return _status_clean(engine.status())


_OPS = {
    msg.Hello: _hello,
    msg.Submit: _submit,
    msg.Inject: _inject,
    msg.Step: _step,
    msg.Abort: _abort,
    msg.LoadWeights: _load_weights,
    msg.Configure: _configure,
    msg.Status: _status,
    msg.Shutdown: lambda engine, call, info: {},
}


def _error(call_id: Any, e: BaseException) -> dict:
    return {"id": call_id, "ok": False, "error": {"type": type(e).__name__, "message": str(e)}}


def serve(engine, rfile: IO[bytes], wfile: IO[bytes], info: Mapping | None = None) -> None:
    """The worker loop: answer calls from ``rfile`` on ``wfile`` until ``shutdown`` or end of input."""
    info = dict(info or {})
    while True:
        try:
            data = read_frame_bytes(rfile)
        except ProtocolError as e:  # a broken frame boundary: nothing after it can be trusted
            write_frame(wfile, _error(None, e))
            return
        if data is None:
            return
        call_id = None
        try:
            try:
                plain = unpack(data, "frame")
            except CodecError as e:
                raise ProtocolError(str(e)) from None
            call_id = plain.get("id") if isinstance(plain, Mapping) else None
            result, keep = handle(engine, plain, info)
            reply = {"id": call_id, "ok": True, "result": result}
        except Exception as e:  # noqa: BLE001 - reported to the caller, the worker keeps serving
            reply, keep = _error(call_id, e), True
        write_frame(wfile, reply)
        if not keep:
            return


def protocol_streams() -> tuple[IO[bytes], IO[bytes]]:
    """(input, output) binary streams for ``serve`` in a worker process. The protocol keeps the
    process's original stdout; file descriptor 1 is then pointed at stderr, so that anything a library
    prints cannot corrupt the frames."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return sys.stdin.buffer, out


# ------------------------------------------------------------------------------------ client side


class EngineProcess(EngineBase):
    """A ``RolloutEngine`` served by a worker process over the wire format (stdin/stdout pipes).

    ``command`` starts the worker (e.g. ``[python, "-m", "generation.vllm_worker", "--engine", "vllm",
    ...]``); its stderr goes to a log file whose tail is quoted when the worker dies. Requests keep
    their full records on this side (answers, texts), so trajectories and partials come back with the
    same ``PromptItem`` the caller submitted. ``version`` and ``admitting`` are mirrored locally and
    pushed to the worker when set."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        start_timeout: float = 600.0,
        weights_dir: str | None = None,
    ):
        self.command = list(command)
        self._log = tempfile.NamedTemporaryFile(prefix="laminar-engine-", suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=cwd or str(REPO_ROOT),
            env=full_env,
        )
        self._next_id = 0
        self._lock = threading.Lock()
        self._known: dict[RequestId, GenRequest] = {}
        self._weights_dir = weights_dir
        self._timer = threading.Timer(start_timeout, self._kill_slow_start)
        self._timer.start()
        try:
            self.info = self.send(msg.Hello())
        finally:
            self._timer.cancel()
        if self.info.get("protocol") != PROTOCOL_VERSION:
            self.close()
            raise ProtocolError(
                f"worker speaks protocol {self.info.get('protocol')}, this client {PROTOCOL_VERSION}"
            )
        st = self.info["status"]
        self.capacity = int(st["capacity"])
        self._version = int(st["version"])
        self._admitting = bool(st["admitting"])
        self.sampling = SamplingSpec(
            float(self.info["temperature"]), int(self.info["max_new_tokens"]), int(self.info["seed"])
        )
        self.engine_name = self.info.get("engine", "?")

    def _kill_slow_start(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    # -- transport
    def _log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _died(self, why: str) -> ProtocolError:
        code = self.proc.poll()
        return ProtocolError(
            f"engine process {why} (exit code {code}); its log {self._log.name} ends:\n{self._log_tail()}",
            "EngineDied",
        )

    def _roundtrip(self, payload: bytes) -> Any:
        with self._lock:
            if self.proc.poll() is not None:
                raise self._died("is not running")
            try:
                write_raw_frame(self.proc.stdin, payload)
                data = read_frame_bytes(self.proc.stdout)
            except (BrokenPipeError, OSError) as e:
                raise self._died(f"pipe failed ({type(e).__name__})") from None
            if data is None:
                raise self._died("closed its output")
        try:
            reply = msg.REPLY.decode(data)
        except CodecError as e:
            raise ProtocolError(str(e)) from None
        if not reply.ok:
            err = reply.error or msg.ErrorInfo(type="?", message="no error given")
            raise ProtocolError(f"engine error {err.type}: {err.message}", err.type)
        return reply.result

    def call(self, op: str, **fields) -> Any:
        """Send a call as plain fields (what the worker validates); the plain result."""
        self._next_id += 1
        return self._roundtrip(pack({"id": self._next_id, "op": op, **fields}))

    def send(self, call: msg.Call, result: Codec | None = None) -> Any:
        """Send a call model; its result decoded by ``result`` (plain data without one)."""
        self._next_id += 1
        plain = self._roundtrip(pack({**msg.CALL.dump(call), "id": self._next_id}))
        if result is None:
            return plain
        try:
            return result.from_plain(plain)
        except CodecError as e:
            raise ProtocolError(str(e)) from None

    def call_raw(self, payload: bytes) -> Any:
        """Send an arbitrary frame payload (tests of malformed messages)."""
        return self._roundtrip(payload)

    # -- RolloutEngine
    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        self.send(msg.Configure(version=int(v)))
        self._version = int(v)

    @property
    def admitting(self) -> bool:
        return self._admitting

    @admitting.setter
    def admitting(self, v: bool) -> None:
        if bool(v) != self._admitting:
            self.send(msg.Configure(admitting=bool(v)))
            self._admitting = bool(v)

    def submit(self, requests: Sequence[GenRequest], sampling: SamplingSpec | None = None) -> None:
        requests = list(requests)
        if not requests:
            return
        spec = None if sampling is None else msg.Sampling.model_construct(**dataclasses.asdict(sampling))
        self.send(msg.Submit.model_construct(requests=tuple(map(msg.wire_request, requests)), sampling=spec))
        for r in requests:
            self._known[request_id(r)] = r

    def inject(self, partials: Sequence[Partial]) -> None:
        partials = list(partials)
        if not partials:
            return
        self.send(msg.Inject.model_construct(partials=tuple(map(msg.wire_partial, partials))))
        for p in partials:
            self._known[request_id(p.request)] = p.request

    def step(self, max_steps: int) -> list[Trajectory]:
        res = self.send(msg.Step(max_steps=int(max_steps)), msg.STEP_RESULT)
        out = [msg.to_trajectory(t, self._known) for t in res.finished]
        for t in out:
            self._known.pop((t.prompt.prompt_id, t.group_uid, t.sample_idx), None)
        self._last_status = res.status
        return out

    def abort(self, request_ids=None, include_queued: bool = True) -> tuple[list[Partial], list[GenRequest]]:
        ids = None if request_ids is None else tuple((str(a), int(b), int(c)) for a, b, c in request_ids)
        res = self.send(msg.Abort(request_ids=ids, include_queued=bool(include_queued)), msg.ABORT_RESULT)
        parts = [msg.to_partial(p, self._known) for p in res.partials]
        reqs = [msg.to_request(r, self._known) for r in res.requests]
        for r in [p.request for p in parts] + reqs:
            self._known.pop(request_id(r), None)
        return parts, reqs

    def load_weights(
        self, version: int, state: Mapping[str, np.ndarray] | None = None, path: str | None = None
    ) -> None:
        if (state is None) == (path is None):
            raise ValueError("load_weights takes exactly one of state= and path=")
        tmp = None
        if state is not None:
            tmp = path = write_weights(state, self._weights_dir)
        try:
            res = self.send(msg.LoadWeights(version=int(version), path=str(path)), msg.LOADED)
        finally:
            if tmp is not None:
                os.unlink(tmp)
        self._version = res.version

    def status(self) -> dict:
        st = self.send(msg.Status())
        self._version, self._admitting = int(st["version"]), bool(st["admitting"])
        return st

    def close(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        if self.proc.poll() is None:
            try:
                self.send(msg.Shutdown())
            except ProtocolError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for s in (self.proc.stdin, self.proc.stdout):
            try:
                s.close()
            except OSError:
                pass
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass
        self.proc = None

    def __del__(self):
        try:
            if getattr(self, "proc", None) is not None and self.proc.poll() is None:
                self.proc.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# ------------------------------------------------------------------------- shared engine helpers


class PendingQueue:
    """FIFO of queued requests and injected partials (partials first) with selective removal: the
    bookkeeping an engine without its own admission control (vLLM behind ``VllmEngine``) needs."""

    def __init__(self):
        self.partials: deque[Partial] = deque()
        self.requests: deque[GenRequest] = deque()

    def __len__(self) -> int:
        return len(self.partials) + len(self.requests)

    def take(self, ids: set | None) -> tuple[list[Partial], list[GenRequest]]:
        if ids is None:
            out = (list(self.partials), list(self.requests))
            self.partials.clear()
            self.requests.clear()
            return out
        parts = [p for p in self.partials if request_id(p.request) in ids]
        reqs = [r for r in self.requests if request_id(r) in ids]
        self.partials = deque(p for p in self.partials if request_id(p.request) not in ids)
        self.requests = deque(r for r in self.requests if request_id(r) not in ids)
        return parts, reqs
