"""The agent endpoint's overhead: the same multi-turn workload through the in-process episode runner
and through the OpenAI-compatible endpoint (an agent written against ``openai``), same engine.

The workload: ``--episodes`` episodes of ``--turns`` policy turns with the chat template and a tool
(the BPE tokenizer and template of ``tests/environments/bpe.py``). The in-process baseline is an
environment whose ``step`` answers each turn with the tool message's tokens; the endpoint run is an
agent that sends each tool result back as a message, so both append one tool message per turn. Two
engines: ``scripted`` (turns cost nothing, so the numbers are the episode machinery's own) and
``model`` (a random two-layer Qwen2 decoding ``--new-tokens`` tokens per turn); ``tiny``: issue 43's
tool workload on the real tiny model (the warm start of ``benchmarks/tool_throughput.py``, its prompt
pool and char tokenizer): ``env=calculator_sandbox`` in-process against ``benchmarks/tool_agent.py``
(the same episodes by an agent written against ``openai``) through the endpoint, 3 turns at most,
48 tokens per turn, no added tool latency; both runs sample the same tokens (same engine seed and
contexts), which ``same_trajectories`` checks per round. Reported per engine:
wall time, policy turns (requests) per second for both, their ratio, the added wall time per request
((endpoint - in-process) / requests), and the agent's own per-request latency (p50, p90) against the
in-process runner's per-turn time. Rounds alternate the order; medians over ``--rounds``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_endpoint.py [--episodes 32] [--turns 4]
        [--rounds 3] [--engines scripted model tiny] [--warm-start DIR] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conf.schema import EngineOptions, EnvConfig  # noqa: E402
from environments.agents.chat import ChatFormat  # noqa: E402
from environments.base import StepResult  # noqa: E402
from environments.episodes import EpisodeEngine, EpisodeLimits  # noqa: E402
from environments.registry import wrap_engine  # noqa: E402
from generation.records import GenRequest, PromptItem  # noqa: E402
from tests.environments import agent_fixtures as fx  # noqa: E402
from tests.environments.bpe import bpe_tokenizer, random_qwen2  # noqa: E402

TURNS = int(os.environ.get("AGENT_BENCH_TURNS", "4"))
LATENCY: list[float] = []


async def agent(client, task):
    """``TURNS`` requests; each reply's tool calls (or the turn) answered with one tool message."""
    msgs = [{"role": "user", "content": task["prompt"]}]
    for _ in range(TURNS):
        t0 = time.perf_counter()
        r = await client.chat.completions.create(model="m", messages=msgs, tools=[fx.CALC])
        LATENCY.append(time.perf_counter() - t0)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        ids = [c.id for c in m.tool_calls or []] or ["none"]
        msgs += [{"role": "tool", "tool_call_id": i, "content": "16"} for i in ids]
    return 1.0


class InProcess:
    """The baseline: every turn answered with the template's tool message (one per turn)."""

    name = "in_process"

    def __init__(self, tok):
        self.fmt = ChatFormat(tok)
        turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        self.obs = self.fmt.delta(turn, [{"role": "tool", "content": "16"}], [fx.CALC])

    def reset(self, prompt):
        return tuple(self.fmt.first([{"role": "user", "content": prompt.text}], [fx.CALC])), {"n": 0}

    def step(self, state, turn):
        if state["n"] + 1 >= TURNS:
            return StepResult(done=True, reason="answer", state=state)
        return StepResult(self.obs, tool_call=True, state={"n": state["n"] + 1})

    def close(self):
        pass


def requests(tok, n):
    return [
        GenRequest(
            PromptItem(f"q{i}", f"What is {i} + 7?", "16", tuple(tok(f"What is {i} + 7?")["input_ids"])), 0, i
        )
        for i in range(n)
    ]


def tiny_workload(warm_dir: Path):
    """Issue 43's tool workload on the real tiny model: the warm-started model and prompt pool of
    ``benchmarks/tool_throughput.py`` (built once, cached in ``warm_dir``), its char tokenizer."""
    from benchmarks import rl_throughput as rt
    from benchmarks.tool_throughput import TOOL_WORKLOAD, WARM_ENV
    from generation.model import load_model

    if TOOL_WORKLOAD[0] not in rt.WORKLOAD:
        rt.WORKLOAD.extend(TOOL_WORKLOAD)
    model_dir, prompts = rt.warm_start(
        warm_dir, argparse.Namespace(seed=0, overrides=list(WARM_ENV), warm_device="cpu")
    )
    model, tok = load_model(model_dir)
    return tok, model, prompts


def tiny_requests(prompts, n: int, group: int = 4):
    """``n`` episodes: ``n / group`` prompts of the pool, ``group`` samples each (as an RL step's groups)."""
    return [GenRequest(p, s, i) for i, p in enumerate(prompts[: max(1, n // group)]) for s in range(group)]


def tiny_env(mode: str, workers: int) -> EnvConfig:
    """The in-process ``env=calculator_sandbox`` or the same episodes by ``benchmarks.tool_agent``
    through the endpoint (``env.max_turns=3``, as the tool workload; no added tool latency: the
    numbers are the machinery's and the sandbox's own)."""
    from benchmarks.tool_agent import TARGET

    target = "calculator_sandbox" if mode == "in_process" else TARGET
    return EnvConfig(target=target, max_turns=3, tool_workers=workers, tool_timeout_s=120.0)


def run_tiny(mode, tok, model, prompts, args) -> dict:
    """One run of the tiny model's tool workload; the trajectories' tokens kept for the comparison."""
    from benchmarks import tool_agent
    from generation.engine import Engine

    eng = Engine(model, tok, EngineOptions(max_new_tokens=48, capacity=64, seed=0))
    runner = wrap_engine(eng, tiny_env(mode, 8), tok)
    trajs, out = timed(runner, tiny_requests(prompts, args.episodes), tool_agent.LATENCY)
    out["tool_calls"] = sum(t.tool_calls for t in trajs)
    out["tokens"] = {f"{t.prompt.prompt_id}|{t.sample_idx}": list(t.response_tokens) for t in trajs}
    return out


def timed(runner, reqs, latency: list) -> tuple[list, dict]:
    """``runner.generate(reqs)`` timed, then closed: (the trajectories, wall seconds, turns, turns/s,
    end reasons, and the agents' request latency quantiles from ``latency``, cleared first)."""
    latency.clear()
    t0 = time.perf_counter()
    trajs = runner.generate(reqs)
    wall = time.perf_counter() - t0
    runner.close()
    turns = sum(t.turns for t in trajs)
    out = {
        "wall_s": wall,
        "turns": turns,
        "turns_per_s": turns / wall,
        "reasons": sorted({t.end_reason for t in trajs}),
    }
    if latency:
        q = statistics.quantiles(latency, n=10)
        out.update(request_p50_ms=1000 * statistics.median(latency), request_p90_ms=1000 * q[8])
    return trajs, out


def engine(kind, tok, model, new_tokens):
    from generation.engine import Engine

    call = '<tool_call>{"name": "calc", "arguments": {"input": "9+7"}}</tool_call>'
    if kind == "scripted":
        return fx.Scripted(tok, [call])
    return Engine(model, tok, EngineOptions(max_new_tokens=new_tokens, capacity=64, seed=0))


def run_once(kind, mode, tok, model, args) -> dict:
    eng = engine(kind, tok, model, args.new_tokens)
    workers = max(8, args.episodes)
    if mode == "endpoint":
        cfg = EnvConfig(target="benchmarks.agent_endpoint:agent", max_turns=TURNS + 1, tool_workers=workers,
                        tool_timeout_s=120.0)  # fmt: skip
        runner = wrap_engine(eng, cfg, tok)
    else:
        runner = EpisodeEngine(eng, InProcess(tok), tok, EpisodeLimits(max_turns=TURNS, tool_workers=workers))
    # the agent runs from the imported module, not __main__
    return timed(runner, requests(tok, args.episodes), _module().LATENCY)[1]


def _module():
    import benchmarks.agent_endpoint as me

    return me


def main() -> None:
    global TURNS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument(
        "--engines", nargs="+", default=["scripted", "model"], choices=["scripted", "model", "tiny"]
    )
    p.add_argument(
        "--warm-start",
        type=Path,
        default=ROOT / "workspace-bench-tools" / "warm",
        help="tiny: the tool workload's warm-start cache (benchmarks/tool_throughput.py --warm-start)",
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    TURNS = _module().TURNS = args.turns
    tok = bpe_tokenizer()
    model = random_qwen2(tok)
    result = {
        "episodes": args.episodes,
        "turns": args.turns,
        "load_before": os.getloadavg()[0],
        "engines": {},
    }
    for kind in args.engines:
        rounds = []
        if kind == "tiny":
            tiny = tiny_workload(args.warm_start)
        for r in range(args.rounds):
            order = ["in_process", "endpoint"] if r % 2 == 0 else ["endpoint", "in_process"]
            if kind == "tiny":
                rounds.append({m: run_tiny(m, *tiny, args) for m in order})
                same = rounds[-1]["in_process"].pop("tokens") == rounds[-1]["endpoint"].pop("tokens")
                rounds[-1]["same_trajectories"] = same
            else:
                rounds.append({m: run_once(kind, m, tok, model, args) for m in order})
            rounds[-1]["load"] = os.getloadavg()[0]
            if args.json_out:  # partial results after every round
                _write(args.json_out, {**result, "engines": {**result["engines"], kind: {"rounds": rounds}}})
        base = statistics.median(x["in_process"]["wall_s"] for x in rounds)
        ep = statistics.median(x["endpoint"]["wall_s"] for x in rounds)
        reqs = rounds[0]["endpoint"]["turns"]
        result["engines"][kind] = {
            "rounds": rounds,
            "in_process_turns_per_s": statistics.median(x["in_process"]["turns_per_s"] for x in rounds),
            "endpoint_requests_per_s": statistics.median(x["endpoint"]["turns_per_s"] for x in rounds),
            "endpoint_over_in_process_wall": ep / base,
            "added_ms_per_request": 1000 * (ep - base) / max(1, reqs),
            "request_p50_ms": statistics.median(x["endpoint"]["request_p50_ms"] for x in rounds),
            "in_process_turn_ms": 1000
            * statistics.median(x["in_process"]["wall_s"] / x["in_process"]["turns"] for x in rounds),
        }
        print(kind, json.dumps({k: v for k, v in result["engines"][kind].items() if k != "rounds"}, indent=1))
    result["load_after"] = os.getloadavg()[0]
    if args.json_out:
        _write(args.json_out, result)


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
