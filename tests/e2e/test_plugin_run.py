"""Plug-ins by import path through the real CLI: a package written outside the repository (a reward
used as the run's verdict, a shaping reward, a file benchmark scored by the plug-in's verdict, a
stateful environment) runs
the tiny DAG; every stage that judges asks the plug-in; editing the plug-in's file reruns exactly the
stages that use it (the rest come from cache); ``laminar lineage`` names it with its file's hash."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.configs import TINY_CURATED
from tests.e2e.cli import ROOT, laminar, latest_summary

pytestmark = pytest.mark.e2e

REWARDS = '''\
"""A user's rewards: a verdict of its own and a shaping term (docs/plugins.md)."""
import os
from dataclasses import dataclass

from rewards.verifier import Verdict, extract_answer, normalize_answer


@dataclass
class Params:
    tag: str = "mine"


def judge(sample, params):
    """Correct when the final answer equals the gold one, as plain strings after normalising."""
    with open(os.environ["PLUGIN_LOG"], "a") as f:
        f.write("judge\\n")
    raw = extract_answer(sample.text)
    ok = raw is not None and normalize_answer(raw) == normalize_answer(sample.answer)
    return Verdict(ok, f"{params.tag}:{raw}")


judge.Params = Params


def brevity(sample):
    with open(os.environ["PLUGIN_LOG"], "a") as f:
        f.write("brevity\\n")
    return -len(sample.text) / 100.0
'''

ENVS = """\
\"\"\"A user's stateful environment (docs/environments.md's Countdown): the tries so far are its state.\"\"\"
import os

from pydantic import BaseModel, Field

from environments.base import StepResult


class Countdown:
    name = "countdown"

    class Params(BaseModel):
        tries: int = Field(2, ge=1)

    def __init__(self, tokenizer, params, env):
        self.tokenizer, self.tries = tokenizer, params.tries

    def reset(self, prompt):
        with open(os.environ["PLUGIN_LOG"], "a") as f:
            f.write("reset\\n")
        return prompt.prompt_tokens, {"answer": str(prompt.answer).strip(), "tries": []}

    def step(self, state, turn):
        said = turn.text.rsplit("####", 1)[-1].strip()
        new = {"answer": state["answer"], "tries": state["tries"] + [said]}
        if said == state["answer"] or len(new["tries"]) >= self.tries:
            return StepResult(done=True, reason="answer", state=new)
        ids = self.tokenizer("\\n= no\\n", add_special_tokens=False)["input_ids"]
        return StepResult(tuple(ids), tool_call=True, state=new)

    def close(self):
        pass
"""

USES_PLUGIN = {"difficulty", "dart", "difficulty_rft", "rl", "eval_warmup", "eval_rft", "eval_rl"}
"""The stages that judge with the run's verdict or score with the shaping reward (``mypkg/rewards.py``);
the environment (``mypkg/envs.py``, another file) is used by warm-up, curation (it samples episodes),
RL and the evaluations."""
USES_ENV = {"warmup", "difficulty", "dart", "difficulty_rft", "rl", "eval_warmup", "eval_rft", "eval_rl"}


def overrides(bench: Path) -> list[str]:
    spec = f"{{name: mine, path: {bench}, verdict: 'mypkg.rewards:judge', verdict_params: {{tag: bench}}}}"
    return [
        *TINY_CURATED,
        "reward.components=[{target: 'mypkg.rewards:judge', verdict: true, params: {tag: run}},"
        "{target: 'mypkg.rewards:brevity', weight: 0.1}]",
        f"eval.benchmarks=[arith_heldout,{spec}]",
        "env.target=mypkg.envs:Countdown",
        "env.params.tries=2",
        "env.max_turns=2",
    ]


def query(ws: Path, sql: str) -> list[tuple]:
    import duckdb

    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugin")
    pkg = tmp / "site" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(REWARDS)
    (pkg / "envs.py").write_text(ENVS)
    assert not pkg.resolve().is_relative_to(ROOT)
    bench = tmp / "bench.jsonl"
    bench.write_text(
        "".join(
            json.dumps({"problem": f"{a} + {b}", "answer": str(a + b)}) + "\n"
            for a, b in [(1, 2), (3, 4), (2, 2)]
        )
    )
    log = tmp / "calls.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(pkg.parent)]),
        "PLUGIN_LOG": str(log),
    }
    ws = tmp / "ws"
    laminar("run", *overrides(bench), ws=ws, env=env)
    return ws, env, pkg / "rewards.py", bench, log


def test_the_plugins_judge_and_score_every_stage(plugin_run):
    ws, _, _, _, log = plugin_run
    first = latest_summary(ws)
    assert {s["status"] for s in first["stages"].values()} == {"ran"}
    calls = log.read_text().split()
    assert calls.count("judge") > 0 and calls.count("brevity") > 0 and calls.count("reset") > 0
    rl_spec = query(ws, "SELECT value FROM metrics WHERE stage = 'rl' AND name = 'reward/brevity'")
    assert rl_spec, "the shaping plug-in's term is recorded per RL step"
    # the file benchmark is judged by the plug-in with its own params, the held-out set by the run's
    preds = dict(query(ws, "SELECT benchmark, any_value(pred) FROM eval_results GROUP BY benchmark"))
    assert preds["mine"].startswith("bench:") and preds["arith_heldout"].startswith("run:"), preds


def test_editing_the_plugin_reruns_exactly_the_stages_that_use_it(plugin_run):
    ws, env, source, bench, _ = plugin_run
    source.write_text(source.read_text() + "\n# edited: same behaviour, new bytes\n")
    laminar("run", *overrides(bench), ws=ws, env=env)
    ran = {k for k, v in latest_summary(ws)["stages"].items() if v["status"] == "ran"}
    assert ran == USES_PLUGIN, ran
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    rl = latest_summary(ws)["checkpoints"]["rl"]
    out = laminar("lineage", rl[:12], ws=ws, env=env).stdout
    assert f"plugin:mypkg.rewards:judge: {digest}" in out, out
    assert f"plugin:mypkg.rewards:brevity: {digest}" in out, out
    env_digest = hashlib.sha256((source.parent / "envs.py").read_bytes()).hexdigest()
    assert f"plugin:mypkg.envs:Countdown: {env_digest}" in out, out
    assert "judge (mypkg.rewards:judge) [verdict] x1" in out and "brevity (mypkg.rewards:brevity) x0.1" in out


def test_editing_the_environment_reruns_exactly_the_stages_that_run_episodes(plugin_run):
    ws, env, source, bench, _ = plugin_run
    envs = source.parent / "envs.py"
    envs.write_text(envs.read_text() + "\n# edited\n")
    laminar("run", *overrides(bench), ws=ws, env=env)
    ran = {k for k, v in latest_summary(ws)["stages"].items() if v["status"] == "ran"}
    assert ran == USES_ENV, ran


def test_a_plugin_that_does_not_import_fails_before_any_write(tmp_path):
    ws = tmp_path / "ws"
    proc = laminar("run", "reward.components=[{target: 'nope.x:y', verdict: true}]", ws=ws, check=False)
    assert proc.returncode == 2 and not ws.exists()
    assert proc.stderr.strip() == (
        "laminar: config error: reward.components[0]: plug-in 'nope.x:y' cannot be imported: "
        "ModuleNotFoundError: No module named 'nope'"
    )
