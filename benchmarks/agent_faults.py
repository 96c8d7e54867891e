"""Agent faults in an RL run, as a table (issue 52's must-show): the scenario of
``tests/training/test_agent_faults.py`` (``fault_run``): agents that raise, hang past their timeout (asleep,
or blocking their own thread), open 100 clients they never close, send malformed requests, or send requests
without the token, beside good agents, in one run of the real rollout manager (the local driver's loop, one
in-process rollout, the tiny model taught the good agents' tool episode) in ``sync`` and ``partial`` mode,
or on the Ray runtime (two rollout actors) in ``ray-partial`` or ``ray-laminar`` mode.

Per mode and fault: the groups issued and trained, the episodes that finished and their end reasons,
the HTTP statuses the agents saw (counted) and the median seconds from an agent's start to its end;
per mode: the good groups trained exactly once (of those issued), groups trained twice or lost, live
sessions at the end and once the rollout closed, whether every endpoint connection then closed (the
leaked clients still held), the run's wall seconds. A correctness table, not a speed benchmark.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/agent_faults.py [--modes sync partial ray-laminar] [--steps 3]
        [--per-step 4] [--out benchmarks/results/agents/agent_faults_2026-12-06]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.environments import agent_fixtures as fx  # noqa: E402
from tests.training.test_agent_faults import (  # noqa: E402
    EPISODE_TIMEOUT_S,
    IDLE_S,
    FaultRun,
    connections_closed,
    fault_run,
    unfinished_uids,
)

KINDS = (*fx.FAULT_KINDS, "good")


def statuses_seen(t) -> Counter:
    """The HTTP statuses an episode's agent saw: those it returned (the faults that answer), else one
    200 per request it made (an agent that raised or hung returns none)."""
    result = t.env_state.get("result") if isinstance(t.env_state, dict) else None
    if isinstance(result, dict) and "statuses" in result:
        return Counter(result["statuses"])
    return Counter({200: t.env_state.get("requests", 0)})


def table(run: FaultRun) -> dict:
    """The per-fault rows and the run's totals."""
    m = run.driver.manager
    trained = Counter(u for u, _ in run.trained)
    issued = {u: fx.fault_of(p) for u, p in issued_prompts(run).items()}
    rest = unfinished_uids(m)
    rows = {}
    for kind in KINDS:
        eps = [t for t in run.finished if fx.fault_of(t.prompt.prompt_id) == kind]
        seen = sum((statuses_seen(t) for t in eps), Counter())
        secs = [
            s.ended_at - (s.deadline - EPISODE_TIMEOUT_S)
            for s in run.sessions
            if fx.fault_of(s.task["prompt_id"]) == kind and s.end is not None
        ]
        rows[kind] = {
            "groups_issued": sum(k == kind for k in issued.values()),
            "groups_trained": sum(trained[u] for u, k in issued.items() if k == kind),
            "episodes": len(eps),
            "end_reasons": dict(Counter(t.end_reason for t in eps)),
            "http_statuses": {str(k): v for k, v in sorted(seen.items())},
            "agent_seconds_median": round(statistics.median(secs), 2) if secs else None,
        }
    good = [u for u, k in issued.items() if k == "good"]
    out = {
        "rows": rows,
        "good_groups_issued": len(good),
        "good_groups_trained_once": sum(trained[u] == 1 for u in good),
        "good_groups_unfinished_at_end": sum(u in rest for u in good),
        "groups_trained_twice": sum(n > 1 for n in trained.values()),
        "groups_lost": len(set(issued) - set(trained) - rest),
        "updates": len(run.history),
        "repacks": m.counts.get("repacks", 0),
        "wall_s": round(run.wall, 1),
    }
    if hasattr(run.driver, "engine"):  # in process: the episode runner and the agents' hub are here
        out.update(
            env_errors=run.driver.engine.env_errors, live_sessions_at_end=run.driver.engine.env.hub.live()
        )
    return out


def close(run: FaultRun, out: dict) -> None:
    """Close the run's rollout (the local driver leaves it open) with the leaked clients still held:
    what is left after it (live sessions, open endpoint connections after ``2 * IDLE_S`` s)."""
    if not hasattr(run.driver, "engine"):  # the Ray runtime: its rollout actors are gone with the run
        return
    run.driver.engine.close()
    out["live_sessions_after_close"] = run.driver.engine.env.hub.live()
    out["connections_closed_after_idle"] = connections_closed(2 * IDLE_S)
    fx.LEAKED.clear()


def issued_prompts(run: FaultRun) -> dict[int, str]:
    """group uid -> prompt id of every group issued (the sessions' tasks carry the prompt ids; a group
    whose episodes never opened a session is still queued, and counted as unfinished)."""
    out = {t.group_uid: t.prompt.prompt_id for t in run.finished}
    for q in run.driver.manager.in_flight():
        out.setdefault(q.group_uid, q.prompt.prompt_id)
    return out


def markdown(results: dict, args) -> str:
    lines = [
        "# Agent faults in an RL run (issue 52), 2026-12-06",
        "",
        f"`python benchmarks/agent_faults.py --steps {args.steps} --per-step {args.per_step}`: "
        f"{args.steps} updates of {args.per_step} groups x 2 episodes; one prompt per fault, good "
        f"prompts for the rest; `episode_timeout_s` {EPISODE_TIMEOUT_S:g}, `idle_timeout_s` {IDLE_S:g}; "
        "the tiny model taught the good agent's tool episode; the real rollout manager with one "
        "in-process rollout (`sync`, `partial`) or on the Ray runtime with two rollout actors (`ray-*`). "
        "2 cores shared with six benchmark runs: seconds are loaded-machine seconds.",
        "",
    ]
    for mode, r in results.items():
        lines += [
            f"## {mode}",
            "",
            "| agent | groups issued | groups trained | episodes | end reasons | HTTP statuses seen | "
            "agent s (median) |",
            "|---|---|---|---|---|---|---|",
        ]
        for kind, row in r["rows"].items():
            reasons = ", ".join(f"{k} {v}" for k, v in row["end_reasons"].items())
            statuses = ", ".join(f"{k} x{v}" for k, v in row["http_statuses"].items())
            secs = "-" if row["agent_seconds_median"] is None else row["agent_seconds_median"]
            lines.append(
                f"| {kind} | {row['groups_issued']} | {row['groups_trained']} | {row['episodes']} | "
                f"{reasons} | {statuses} | {secs} |"
            )
        text = (
            f"Good groups trained exactly once: {r['good_groups_trained_once']} of {r['good_groups_issued']} "
            f"issued ({r['good_groups_unfinished_at_end']} still in flight at the end); groups trained "
            f"twice: {r['groups_trained_twice']}; groups lost: {r['groups_lost']}; updates {r['updates']}; "
            f"repacks {r['repacks']}; run wall {r['wall_s']} s."
        )
        if "env_errors" in r:
            text += (
                f" Environment errors {r['env_errors']}; live sessions at the end "
                f"{r['live_sessions_at_end']} (the episodes in flight), {r['live_sessions_after_close']} "
                f"once the rollout closed; every endpoint connection closed within {2 * IDLE_S:g} s after "
                f"(the leaked clients still held): {r['connections_closed_after_idle']}."
            )
        else:
            text += (
                " (Ray: the agents run in the rollout actors, whose sessions and seconds are not read here.)"
            )
        lines += ["", text, ""]
    lines += [
        "Under laminar, repack moves long-tail episodes between the rollout actors, and a hanging or "
        "blocking agent's episode is one: a moved episode restarts from its prompt (a fresh agent run); "
        "one moved twice ends `env_error` (counted in `episode/failed`) instead of `agent_timeout` "
        '(docs/agents.md, "Repack and resume"). Which episodes repack moves varies from run to run.',
        "",
    ]
    return "\n".join(lines)


def start_ray() -> None:
    """A local Ray instance as the tests start it (``tests/conftest.py``'s ``local_ray``)."""
    import ray

    from training.rl.drivers.ray import actor_env

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": actor_env(1)})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["sync", "partial", "ray-laminar"],
                    choices=["sync", "partial", "ray-partial", "ray-laminar"])  # fmt: skip
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--per-step", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/agents/agent_faults_2026-12-06"))
    args = ap.parse_args()
    results = {}
    for mode in args.modes:
        ray = mode.startswith("ray-")
        if ray:
            start_ray()
        with tempfile.TemporaryDirectory() as folder:
            steps, per_step = args.steps, args.per_step
            run = fault_run(
                folder, mode.removeprefix("ray-"), steps=steps, prompts_per_step=per_step, ray=ray
            )
            results[mode] = table(run)
            close(run, results[mode])
        print(mode, json.dumps(results[mode], indent=1), flush=True)
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(results, args))


if __name__ == "__main__":
    main()
