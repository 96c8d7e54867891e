"""Encode + decode throughput of the records that cross processes: the one codec (``core.codec``,
``generation.messages``) against the hand-written encoders it replaced, loaded from a git revision
(default 81ce12b, the last commit with them) and run in the same process on the same records.

Cases (each: the worker or writer side encodes, the other side decodes back to records):
- ``step``: the reply to a rollout ``step`` (the hot path): 64 finished trajectories of 256 tokens,
  prompts of 48 tokens, through ``protocol.handle`` and the client's decoding;
- ``submit``: 64 requests, decoded by the worker;
- ``abort``: 32 partials of 128 tokens back to the client;
- ``checkpoint_write`` / ``checkpoint_read``: 64 multi-turn trajectories (loss mask, environment
  state) to JSON text (each checkpoint) and back (a resume), as in ``rl_state.json``.

    PYTHONPATH=. python benchmarks/codec.py [--base 81ce12b] [--repeats 7] [--out FILE]

Prints records/s for each case and implementation and the ratio new/base (>1: faster).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.codec import pack  # noqa: E402
from generation import messages as msg  # noqa: E402
from generation import protocol as new_protocol  # noqa: E402
from generation.records import GenRequest, Partial, PromptItem, Trajectory  # noqa: E402
from training.rl import control as new_control  # noqa: E402


def load_base(rev: str, path: str, name: str):
    """The module at ``path`` as of git revision ``rev``."""
    text = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    d = Path(tempfile.mkdtemp(prefix="laminar-codec-bench-"))
    (d / f"{name}.py").write_text(text.stdout)
    spec = importlib.util.spec_from_file_location(name, d / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def records(n: int, resp: int, prompt: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    reqs, trajs, parts, episodes = [], [], [], []
    for i in range(n):
        p = PromptItem(f"p{i}", "q" * 80, "42", tuple(int(x) for x in rng.integers(0, 50_000, prompt)), 2)
        r = GenRequest(p, i % 8, group_uid=i // 8)
        toks = tuple(int(x) for x in rng.integers(0, 50_000, resp))
        lps = tuple(float(x) for x in -rng.exponential(1.0, resp))
        reqs.append(r)
        trajs.append(
            Trajectory("trajectory", p, r.sample_idx, toks, lps, 3, True, "t" * 300, 0.7, r.group_uid, 3)
        )
        parts.append(Partial(r, toks[: resp // 2], lps[: resp // 2], 3, 12.5))
        mask = tuple(int(x) for x in rng.integers(0, 2, resp))
        episodes.append(
            Trajectory(
                "trajectory", p, r.sample_idx, toks, lps, 3, True, "t" * 300, math.nan, r.group_uid, 3,
                loss_mask=mask, turns=3, tool_calls=2, end_reason="answer",
                env_state={"guesses": [1, 5, 9], "vars": {"x": 3}},
            )
        )  # fmt: skip
    return reqs, trajs, parts, episodes


class FakeEngine:
    """Hands back prepared records (what a worker's engine returns)."""

    def __init__(self, trajs, parts, reqs):
        self.trajs, self.parts, self.reqs, self.version, self.admitting = trajs, parts, reqs, 3, True

    def status(self):
        return {"version": 3, "active": 0, "queued": 0, "capacity": 64, "kv_tokens": 0, "admitting": True}

    def step(self, n):
        return list(self.trajs)

    def abort(self, ids, include_queued=True):
        return list(self.parts), []

    def submit(self, reqs, sampling=None):
        self.got = reqs


def cases(base_protocol, base_control, reqs, trajs, parts, episodes):
    eng = FakeEngine(trajs, parts, reqs)
    known = {new_protocol.request_id(r): r for r in reqs}

    def reply(result):
        return {"id": 1, "ok": True, "result": result}

    def new_step():
        data = pack(reply(new_protocol.handle(eng, msg.Step(max_steps=1), {})[0]))
        res = msg.STEP_RESULT.from_plain(msg.REPLY.decode(data).result)
        return [msg.to_trajectory(t, known) for t in res.finished]

    def base_step():
        data = msgpack.packb(
            reply(base_protocol.handle(eng, {"op": "step", "max_steps": 1}, {})[0]), use_bin_type=True
        )
        res = msgpack.unpackb(data, raw=False, strict_map_key=False)["result"]
        return [base_protocol.traj_from_wire(t, known) for t in res["finished"]]

    def new_submit():
        call = msg.Submit.model_construct(requests=tuple(map(msg.wire_request, reqs)), sampling=None)
        data = pack({**msg.CALL.dump(call), "id": 1})
        new_protocol.handle(eng, new_protocol.unpack(data), {})
        return eng.got

    def base_submit():
        call = {
            "id": 1,
            "op": "submit",
            "requests": [base_protocol._req_to_wire(r) for r in reqs],
            "sampling": None,
        }
        data = msgpack.packb(call, use_bin_type=True)
        base_protocol.handle(eng, msgpack.unpackb(data, raw=False, strict_map_key=False), {})
        return eng.got

    def new_abort():
        data = pack(reply(new_protocol.handle(eng, msg.Abort(), {})[0]))
        res = msg.ABORT_RESULT.from_plain(msg.REPLY.decode(data).result)
        return [msg.to_partial(p, known) for p in res.partials]

    def base_abort():
        data = msgpack.packb(reply(base_protocol.handle(eng, {"op": "abort"}, {})[0]), use_bin_type=True)
        res = msgpack.unpackb(data, raw=False, strict_map_key=False)["result"]
        return [base_protocol.partial_from_wire(p, known) for p in res["partials"]]

    def checkpoint_write(control):
        return lambda: json.dumps([control.trajectory_to_json(t) for t in episodes])

    saved = json.dumps([base_control.trajectory_to_json(t) for t in episodes])

    def checkpoint_read(control):
        return lambda: [control.trajectory_from_json(d) for d in json.loads(saved)]

    return {
        "step": (len(trajs), new_step, base_step),
        "submit": (len(reqs), new_submit, base_submit),
        "abort": (len(parts), new_abort, base_abort),
        "checkpoint_write": (len(episodes), checkpoint_write(new_control), checkpoint_write(base_control)),
        "checkpoint_read": (len(episodes), checkpoint_read(new_control), checkpoint_read(base_control)),
    }


def timed(fn, min_s: float = 0.3) -> float:
    """Calls per second of ``fn`` over at least ``min_s`` seconds."""
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < min_s:
        fn()
        n += 1
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="81ce12b")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base_protocol = load_base(args.base, "generation/protocol.py", "base_protocol")
    base_control = load_base(args.base, "training/rl/control.py", "base_control")
    reqs, trajs, parts, episodes = records(64, 256, 48)
    table = cases(base_protocol, base_control, reqs, trajs, parts, episodes)
    out = {"date": datetime.date.today().isoformat(), "base": args.base, "cases": {}}
    for name, (n, new, base) in table.items():
        a, b = new(), base()
        assert repr(a) == repr(b), f"{name}: the codecs disagree"  # repr: NaN equals NaN
        rates = {"new": [], "base": []}
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            rates["new"].append(timed(new) * n)
            rates["base"].append(timed(base) * n)
        med = {k: statistics.median(v) for k, v in rates.items()}
        out["cases"][name] = {
            "records": n,
            "new_records_per_s": round(med["new"]),
            "base_records_per_s": round(med["base"]),
            "ratio_new_over_base": round(med["new"] / med["base"], 3),
        }
        print(
            f"{name:16s} new {med['new']:10.0f} rec/s  base {med['base']:10.0f} rec/s  "
            f"ratio {med['new'] / med['base']:.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
