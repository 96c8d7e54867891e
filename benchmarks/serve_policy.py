"""``laminar serve-policy`` under concurrent agents: continuous batching against one row at a time.

``--clients`` concurrent clients (each its own ``openai.AsyncOpenAI``, as an agent per episode would
be) each send ``--requests`` chat requests one after the other (greedy, ``--max-tokens`` at most,
each client its own arithmetic question per request) to a ``PolicyServer`` over one checkpoint. Two
servers over the same model object: ``batched`` (``max_batch=--max-batch``: every open request's
rows decode together, new ones join between steps) and ``one_at_a_time`` (``max_batch=1``: one row
decodes at a time, the unbatched path, requests queue in arrival order). Per cell: wall time,
requests/s, completion tokens/s, median and p90 request latency, the most rows decoded together,
and whether both servers returned the same completions (greedy: they should, up to float ties).
``--before COMMIT`` adds a third server: ``PolicyServer`` of that commit's ``serve.py`` (the code
before batching: one request at a time under a lock). Rounds alternate the servers' order; the
ratios are batched over each other server's requests/s (and requests per CPU second of the whole
process) in the same round (medians over rounds). Models: ``tiny`` (the default tiny model built
from config, its char tokenizer, random weights) and ``smollm2`` (``--smollm2 DIR``, a
``save_pretrained`` folder loaded through ``generation.model.load_model``). One torch thread;
results are written after every cell, so a cut run keeps what it measured.

    PYTHONPATH=$PWD nice -n 3 .venv/bin/python benchmarks/serve_policy.py [--models tiny smollm2]
        [--clients 1 4 16] [--requests 4] [--max-tokens 48] [--rounds 3] [--smollm2 DIR]
        [--before COMMIT] [--out benchmarks/results/agents/serve_policy_DATE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
import torch  # noqa: E402

from environments.agents.serve import PolicyServer  # noqa: E402

OPS = ["+", "-", "*"]


def _prompt(client: int, request: int) -> str:
    a, b = 3 + 7 * client + request, 11 + 5 * request + client
    return f"What is {a} {OPS[(client + request) % 3]} {b}?"


def _load(name: str, smollm2: str | None):
    if name == "tiny":
        from conf.schema import ModelConfig
        from generation.model import build_char_tokenizer, build_tiny_model

        tok = build_char_tokenizer()
        return build_tiny_model(ModelConfig(), tok, seed=0).eval(), tok
    if not smollm2:
        raise SystemExit("--models smollm2 needs --smollm2 DIR (a save_pretrained folder)")
    from generation.model import load_model

    return load_model(smollm2)


async def _client(srv: PolicyServer, k: int, requests: int, max_tokens: int, lat: list, outs: dict):
    c = openai.AsyncOpenAI(base_url=srv.base_url, api_key=srv.token, max_retries=0, timeout=3600)
    try:
        for j in range(requests):
            msgs = [{"role": "user", "content": _prompt(k, j)}]
            t0 = time.perf_counter()
            r = await c.chat.completions.create(
                model="m", messages=msgs, temperature=0, max_tokens=max_tokens
            )
            lat.append(time.perf_counter() - t0)
            outs[(k, j)] = (r.choices[0].message.content, r.usage.completion_tokens)
    finally:
        await c.close()


def _cell(srv: PolicyServer, clients: int, requests: int, max_tokens: int) -> tuple[dict, dict]:
    """One timed run of ``clients`` concurrent clients against ``srv``: (stats, completions)."""
    lat: list[float] = []
    outs: dict = {}

    async def go():
        await asyncio.gather(*[_client(srv, k, requests, max_tokens, lat, outs) for k in range(clients)])

    srv.peak_rows, steps = 0, getattr(srv, "steps", 0)
    t0, c0 = time.perf_counter(), time.process_time()
    asyncio.run(go())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(n for _, n in outs.values())
    lat.sort()
    stats = {
        "wall_s": round(wall, 3),
        "requests": len(lat),
        "requests_per_s": round(len(lat) / wall, 3),
        "cpu_s": round(cpu, 3),
        "requests_per_cpu_s": round(len(lat) / cpu, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "completion_tokens": tokens,
        "latency_p50_s": round(statistics.median(lat), 3),
        "latency_p90_s": round(lat[min(len(lat) - 1, int(0.9 * len(lat)))], 3),
        "decode_steps": getattr(srv, "steps", 0) - steps,
        "peak_rows": getattr(srv, "peak_rows", 1),
    }
    return stats, outs


def _median(rounds: list[dict], mode: str, key: str) -> float:
    return round(statistics.median(r[mode][key] for r in rounds), 3)


def _server_before(ref: str):
    """``PolicyServer`` of ``environments/agents/serve.py`` at git ``ref`` (the code before batching)."""
    path = f"{ref}:environments/agents/serve.py"
    src = subprocess.run(["git", "show", path], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("serve_before")
    exec(compile(src, path, "exec"), module.__dict__)
    return module.PolicyServer


def _servers(model, tok, cap: int, args) -> dict:
    servers = {
        "batched": PolicyServer(model, tok, max_tokens=cap, max_batch=args.max_batch, seed=0),
        "one_at_a_time": PolicyServer(model, tok, max_tokens=cap, max_batch=1, seed=0),
    }
    if args.before:
        servers["before"] = _server_before(args.before)(model, tok, max_tokens=cap, seed=0)
    return servers


def _round(servers: dict, r: int, clients: int, requests: int, cap: int) -> dict:
    """One round: every server in turn (the order reversed every other round), their ratios."""
    order = list(servers) if r % 2 == 0 else list(reversed(servers))
    got = {m: _cell(servers[m], clients, requests, cap) for m in order}
    row = {m: got[m][0] for m in servers}
    row["same_completions"] = all(got[m][1] == got["batched"][1] for m in servers)
    for m in servers:
        if m != "batched":
            row["batched_over_" + m] = {
                k: round(row["batched"][k] / row[m][k], 3) for k in ("requests_per_s", "requests_per_cpu_s")
            }
    row["load"] = round(os.getloadavg()[0], 2)
    return row


KEYS = ("requests_per_s", "requests_per_cpu_s", "tokens_per_s", "latency_p50_s", "latency_p90_s", "wall_s",
        "peak_rows", "decode_steps")  # fmt: skip


def run_model(name: str, args, result: dict, save) -> None:
    model, tok = _load(name, args.smollm2)
    cap = args.max_tokens if name == "tiny" else args.smollm2_max_tokens
    requests = args.requests if name == "tiny" else args.smollm2_requests
    servers = _servers(model, tok, cap, args)
    try:
        for srv in servers.values():  # warm-up: first imports, the first forward
            _cell(srv, 1, 1, 4)
        for clients in args.clients:
            cell = {"model": name, "clients": clients, "requests_per_client": requests, "max_tokens": cap,
                    "load_before": round(os.getloadavg()[0], 2), "rounds": []}  # fmt: skip
            for r in range(args.rounds):
                cell["rounds"].append(_round(servers, r, clients, requests, cap))
                print(name, clients, json.dumps(cell["rounds"][-1]), flush=True)
            rounds = cell["rounds"]
            cell["median"] = {m: {k: _median(rounds, m, k) for k in KEYS} for m in servers}
            for m in servers:
                if m != "batched":
                    cell["median"]["batched_over_" + m] = {
                        k: _median(rounds, "batched_over_" + m, k)
                        for k in ("requests_per_s", "requests_per_cpu_s")
                    }
            cell["load_after"] = round(os.getloadavg()[0], 2)
            result["cells"].append(cell)
            save(result)
    finally:
        for srv in servers.values():
            srv.close()


def markdown(result: dict) -> str:
    before = any("before" in c["median"] for c in result["cells"])
    extra = " | before req/s | batched / before, wall (CPU)" if before else ""
    lines = [
        f"# serve-policy: continuous batching against one row at a time ({result['date']})",
        "",
        f"`{result['command']}` at {result['commit']}, torch threads {result['threads']}, load average "
        f"{result['load_before']} before (2 cores shared with other benchmarks: absolute numbers are slowed "
        "by contention; the ratios compare the servers within each round).",
        "",
        "| model | clients | requests | batched req/s | one-at-a-time req/s "
        + "| batched / one-at-a-time, wall (CPU)"
        + extra
        + " | batched p50 / p90 s | one-at-a-time p50 / p90 s | decode steps | peak rows | same completions "
        "| load |",
        "|---" * (13 + 2 * before) + "|",
    ]
    for c in result["cells"]:
        med = c["median"]
        b, o, r1 = med["batched"], med["one_at_a_time"], med["batched_over_one_at_a_time"]
        same = sum(r["same_completions"] for r in c["rounds"])
        more = ""
        if before:
            rb = med["batched_over_before"]
            more = (f" | {med['before']['requests_per_s']} | {rb['requests_per_s']}x "
                    f"({rb['requests_per_cpu_s']}x)")  # fmt: skip
        lines.append(
            f"| {c['model']} | {c['clients']} | {c['clients'] * c['requests_per_client']} "
            f"| {b['requests_per_s']} | {o['requests_per_s']} | {r1['requests_per_s']}x "
            f"({r1['requests_per_cpu_s']}x){more} "
            f"| {b['latency_p50_s']} / {b['latency_p90_s']} | {o['latency_p50_s']} / {o['latency_p90_s']} "
            f"| {b['decode_steps']:g} / {o['decode_steps']:g} | {b['peak_rows']:g} "
            f"| {same}/{len(c['rounds'])} rounds | {c['load_before']} -> {c['load_after']} |"
        )
    lines += [
        "",
        "Each column is its own median over rounds (order alternated), so a ratio (the median of the "
        "per-round ratios) need not equal the quotient of two req/s medians. In parentheses: the ratio of "
        "requests per CPU second of the whole process (clients, endpoint and decoder), which contention "
        "moves far less than wall time. `before`: `environments/agents/serve.py` of the commit named in "
        "the command (one request at a time under a lock, a plain forward loop). Decode steps: batched / "
        "one at a time. Same completions: every server returned the same greedy completions. Per-round "
        "numbers in the JSON beside this file.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny"], choices=["tiny", "smollm2"])
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=4, help="requests per client (tiny)")
    ap.add_argument("--max-tokens", type=int, default=48, help="completion cap (tiny)")
    ap.add_argument("--smollm2", default=None, help="a save_pretrained folder of SmolLM2")
    ap.add_argument("--smollm2-requests", type=int, default=2)
    ap.add_argument("--smollm2-max-tokens", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=None, help="also the unbatched server of this git commit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "benchmarks/serve_policy.py " + " ".join(sys.argv[1:]),
        "commit": commit.stdout.strip(),
        "threads": args.threads,
        "load_before": round(os.getloadavg()[0], 2),
        "cells": [],
    }

    def save(res: dict) -> None:
        res["load_now"] = round(os.getloadavg()[0], 2)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
            Path(args.out + ".md").write_text(markdown(res))

    for name in args.models:
        run_model(name, args, result, save)
    save(result)
    print(markdown(result))


if __name__ == "__main__":
    main()
