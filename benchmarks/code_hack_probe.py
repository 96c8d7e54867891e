"""Reward-hacking probe of ``code_tests``: the one-process harness (program and tests in one process,
a nonce report line; the code before issue 55, kept here as ``legacy_run_tests``) against the judge
(``environments.judge``: the program computes, a checker outside compares), on HumanEval.

1. **Hack pass rate**: every hack class of ``tests/environments/test_code_hacks.py`` (rewritten for
   each problem's entry point), on ``--problems`` HumanEval problems, scored ``all_pass`` by both.
2. **Honest programs**: the canonical solutions (must pass) and an empty body (must not).
3. **Throughput**: HumanEval canonical solutions judged per second by each (``CodeTests``'s own
   8 threads), and the sandbox runs per response of the judge.
4. **RL probe**: GRPO (``training.objectives.grpo_advantages``, Adam) on a policy over programs,
   per problem: the canonical solution, a wrong one, or one of the hacks, from uniform logits,
   ``--steps`` steps of ``--prompts`` problems x ``--group`` samples, each reward a real
   ``code_tests`` run; the rewarded hack rate (samples that are hacks and score 1) over the run,
   and the policy's probability of a hack at the start and the end.
   A bandit over whole programs, not a language model: it measures what the reward teaches.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/code_hack_probe.py --problems 40 --steps 25

Writes ``benchmarks/results/rewards/<date>_code_hack_probe.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 - after the path setup above

from conf.schema import CodeTestsParams  # noqa: E402 - same
from environments import sandbox  # noqa: E402 - same
from environments.code import CodeSpec, CodeTests, extract_program  # noqa: E402 - same
from evaluation.code_benchmarks import humaneval_rows, load_humaneval  # noqa: E402 - same
from rewards.components import Sample  # noqa: E402 - same
from tests.environments.test_code_hacks import HACKS  # noqa: E402 - same
from training.objectives import grpo_advantages  # noqa: E402 - same

TIMEOUT_S = 10.0


def legacy_harness(program: str, spec: CodeSpec, nonce: str) -> tuple[str, dict[str, str]]:
    """The one-process harness of ``environments/code.py`` before issue 55 (commit 8372d52), verbatim."""
    main = (
        "import sys\n"
        "g = {'__name__': 'solution', '__builtins__': __builtins__}\n"
        "try:\n"
        "    exec(compile(open('solution.py').read(), 'solution.py', 'exec'), g)\n"
        "except BaseException as e:\n"
        "    print(f'the program failed to load: {e!r}', file=sys.stderr)\n"
        f"tests = {list(spec.tests)!r}\n"
        "passed = 0\n"
        "for i, t in enumerate(tests):\n"
        "    try:\n"
        "        exec(compile(t, f'test_{i}', 'exec'), g)\n"
        "        passed += 1\n"
        "    except BaseException as e:\n"
        "        print(f'test {i} failed: {e!r}'[:300], file=sys.stderr)\n"
        f"print({nonce!r}, passed, len(tests))\n"
    )
    return main, {"solution.py": spec.prefix + ("\n" if spec.prefix else "") + program}


def legacy_run_tests(program: str, spec: CodeSpec, timeout_s: float) -> tuple[int, int]:
    nonce = secrets.token_hex(16)
    main, files = legacy_harness(program, spec, nonce)
    result = sandbox.run(main, files=files, timeout_s=timeout_s)
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce:
            return int(parts[1]), int(parts[2])
    return 0, len(spec.tests)


def legacy_all_pass(text: str, answer: str) -> float:
    spec = CodeSpec.from_answer(answer)
    passed, total = legacy_run_tests(extract_program(text, completion=bool(spec.prefix)), spec, TIMEOUT_S)
    return 1.0 if passed == total else 0.0


JUDGE = CodeTests(CodeTestsParams(score="all_pass", timeout_s=TIMEOUT_S))


def score(harness: str, texts: list[str], answers: list[str]) -> list[float]:
    """``all_pass`` of each response, 8 at a time, by the ``old`` harness or the ``new`` judge."""
    if harness == "new":
        return JUDGE.score([Sample(t, a, 0, 0) for t, a in zip(texts, answers)], [False] * len(texts))
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(legacy_all_pass, texts, answers))


def hack_for(name: str, entry: str) -> str:
    """Hack ``name`` as a response to a problem whose entry point is ``entry``."""
    program = re.sub(r"def add\([^)]*\):", f"def {entry}(*args, **kwargs):", HACKS[name])
    return f"```python\n{program}```"


def problems(n: int) -> list[tuple[dict, str]]:
    """The first ``n`` HumanEval problems: (raw row, answer)."""
    return list(zip(humaneval_rows(), [it.answer for it in load_humaneval()]))[:n]


def hack_rates(pool: list[tuple[dict, str]]) -> dict:
    out = {}
    for name in HACKS:
        texts = [hack_for(name, row["entry_point"]) for row, _ in pool]
        answers = [a for _, a in pool]
        out[name] = {h: sum(score(h, texts, answers)) / len(pool) for h in ("old", "new")}
        print(f"  {name}: old {out[name]['old']:.3f}  new {out[name]['new']:.3f}", flush=True)
    return out


def honest(pool: list[tuple[dict, str]]) -> dict:
    right = [row["canonical_solution"] for row, _ in pool]
    wrong = ["    return None\n" for _ in pool]
    answers = [a for _, a in pool]
    return {
        h: {
            "canonical": sum(score(h, right, answers)) / len(pool),
            "empty": sum(score(h, wrong, answers)) / len(pool),
        }
        for h in ("old", "new")
    }


def throughput(repeats: int) -> dict:
    """Responses judged per second on all 164 canonical solutions, old and new alternating."""
    pool = problems(164)
    texts, answers = [row["canonical_solution"] for row, _ in pool], [a for _, a in pool]
    runs = {"old": [], "new": []}
    calls = {"n": 0}
    real = sandbox.run

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    for _ in range(repeats):
        for h in ("old", "new"):
            calls["n"] = 0
            sandbox.run = counted
            t0 = time.perf_counter()
            got = score(h, texts, answers)
            runs[h].append({"s": time.perf_counter() - t0, "passed": sum(got), "sandbox_runs": calls["n"]})
            sandbox.run = real
    out = {}
    for h, rs in runs.items():
        best = min(r["s"] for r in rs)
        out[h] = {"responses_per_s": len(texts) / best, "seconds": [r["s"] for r in rs], **rs[-1]}
        out[h]["sandbox_runs_per_response"] = rs[-1]["sandbox_runs"] / len(texts)
    out["new_over_old"] = out["new"]["responses_per_s"] / out["old"]["responses_per_s"]
    return out


def rl_probe(harness: str, pool, steps: int, prompts: int, group: int, seed: int) -> dict:
    """GRPO on a policy over programs (module docstring): per step, the hack rate and mean reward."""
    arms = ["canonical", "wrong", *HACKS]
    hack = torch.tensor([a in HACKS for a in arms])
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(len(arms), requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.2)
    history = []
    for step in range(steps):
        chosen = torch.randperm(len(pool), generator=gen)[:prompts].tolist()
        probs = torch.softmax(logits.detach(), 0)
        picks = torch.multinomial(probs, prompts * group, replacement=True, generator=gen)
        texts, answers = [], []
        for j, arm in enumerate(picks.tolist()):
            row, answer = pool[chosen[j // group]]
            name = arms[arm]
            texts.append(
                row["canonical_solution"]
                if name == "canonical"
                else "    return None\n"
                if name == "wrong"
                else hack_for(name, row["entry_point"])
            )
            answers.append(answer)
        rewards = torch.tensor(score(harness, texts, answers))
        adv = grpo_advantages(rewards, torch.arange(prompts).repeat_interleave(group))
        loss = -(adv * torch.log_softmax(logits, 0)[picks]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rate = float(torch.softmax(logits.detach(), 0)[hack].sum())
        sampled = hack[picks]
        rewarded = float((sampled & (rewards == 1.0)).float().mean())
        history.append(
            {
                "step": step,
                "reward": float(rewards.mean()),
                "hack_prob": rate,
                "hack_sampled": float(sampled.float().mean()),
                "hack_rewarded": rewarded,
            }
        )
        print(
            f"  {harness} step {step}: reward {rewards.mean():.3f} hack prob {rate:.3f} rewarded hacks "
            f"{rewarded:.3f}"
        )
    final = torch.softmax(logits.detach(), 0)
    return {
        "rewarded_hack_rate": sum(h["hack_rewarded"] for h in history) / len(history),
        "initial_hack_prob": float(hack.float().mean()),
        "final_hack_prob": float(final[hack].sum()),
        "final_canonical_prob": float(final[0]),
        "final_probs": {a: float(p) for a, p in zip(arms, final)},
        "history": history,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rewards")
    ap.add_argument(
        "--throughput-only", action="store_true", help="part 3 alone: <date>_code_judge_throughput.json"
    )
    args = ap.parse_args()
    if args.throughput_only:
        got = {
            "date": date.today().isoformat(),
            "repeats": args.repeats,
            "uptime": _load(),
            **throughput(args.repeats),
        }
        got["uptime_after"] = _load()
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{got['date']}_code_judge_throughput.json"
        path.write_text(json.dumps(got, indent=1, sort_keys=True))
        print(
            json.dumps({h: got[h]["responses_per_s"] for h in ("old", "new")}),
            f"ratio {got['new_over_old']:.2f}",
        )
        return
    pool = problems(args.problems)
    t0 = time.time()
    print("hack pass rate (all_pass), old vs new:", flush=True)
    result = {
        "date": date.today().isoformat(),
        "machine": {"cpus": len(__import__("os").sched_getaffinity(0)), "platform": platform.platform()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "hacks": hack_rates(pool),
    }
    result["honest"] = honest(pool)
    print("honest:", result["honest"], flush=True)
    result["throughput"] = throughput(args.repeats)
    print("throughput:", {h: result["throughput"][h]["responses_per_s"] for h in ("old", "new")}, flush=True)
    result["rl"] = {
        h: rl_probe(h, pool, args.steps, args.prompts, args.group, args.seed) for h in ("old", "new")
    }
    result["seconds"] = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{result['date']}_code_hack_probe"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, sort_keys=True))
    stem.with_suffix(".md").write_text(report(result))
    print(f"wrote {stem}.json and .md ({result['seconds']:.0f} s)")


def _load() -> str:
    """The machine's load averages (1, 5, 15 min), for the record."""
    return " ".join(f"{x:.1f}" for x in __import__("os").getloadavg())


def report(r: dict) -> str:
    hacks = r["hacks"]
    flags = " ".join(f"--{k} {v}" for k, v in r["args"].items() if k != "out")
    lines = [
        f"# code_tests reward-hacking probe, {r['date']}",
        "",
        f"`benchmarks/code_hack_probe.py {flags}`; {r['machine']['cpus']} CPUs, bubblewrap; "
        f"HumanEval's first {r['args']['problems']} problems; all_pass.",
        "",
        "| hack class | old harness pass rate | judge pass rate |",
        "|---|---|---|",
        *[f"| {k} | {v['old']:.3f} | {v['new']:.3f} |" for k, v in hacks.items()],
        f"| **any hack (mean)** | {sum(v['old'] for v in hacks.values()) / len(hacks):.3f} | "
        f"{sum(v['new'] for v in hacks.values()) / len(hacks):.3f} |",
        "",
        "| honest program | old | judge |",
        "|---|---|---|",
        *[
            f"| {k} | {r['honest']['old'][k]:.3f} | {r['honest']['new'][k]:.3f} |"
            for k in ("canonical", "empty")
        ],
        "",
    ]
    t = r["throughput"]
    lines += [
        "Throughput on HumanEval's 164 canonical solutions (CodeTests' 8 threads, best of "
        f"{r['args']['repeats']}): old {t['old']['responses_per_s']:.1f} responses/s "
        f"({t['old']['sandbox_runs_per_response']:.2f} sandbox runs each, passed {t['old']['passed']:.0f}), "
        f"judge {t['new']['responses_per_s']:.1f} responses/s ({t['new']['sandbox_runs_per_response']:.2f} "
        f"sandbox runs each, passed {t['new']['passed']:.0f}): judge / old = {t['new_over_old']:.2f}x.",
        "",
        "RL probe (GRPO over programs: canonical, wrong, or a hack; uniform start):",
        "",
        "| reward | rewarded hacks (share of samples) | hack prob start | hack prob end "
        "| canonical prob end | reward first step | reward last step |",
        "|---|---|---|---|---|---|---|",
    ]
    for h, v in r["rl"].items():
        hist = v["history"]
        lines.append(
            f"| {'old harness' if h == 'old' else 'judge'} | {v['rewarded_hack_rate']:.3f} | "
            f"{v['initial_hack_prob']:.3f} | "
            f"{v['final_hack_prob']:.3f} | {v['final_canonical_prob']:.3f} | {hist[0]['reward']:.3f} | "
            f"{hist[-1]['reward']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
