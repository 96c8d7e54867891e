"""A plug-in's source file enters the cache key of exactly the stages that use it (``Stage.plugins``);
the default run's keys hold no plug-in."""

from __future__ import annotations

import importlib
import sys

import pytest

from conf.loader import load_config
from tasks.dag import EVAL_STAGE, STAGES

VERDICT_STAGES = {"difficulty", "dart", "difficulty_rft", "rl", "eval_warmup", "eval_rft", "eval_rl"}


@pytest.fixture
def package(tmp_path, monkeypatch):
    pkg = tmp_path / "keypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "judge.py").write_text("def judge(sample):\n    return 1.0\n")
    (pkg / "loss.py").write_text("def loss(batch, objective):\n    return batch.logprobs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.startswith("keypkg")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def plugin_hashes(cfg) -> dict[str, dict[str, str]]:
    return {
        s.name: {k: v for k, v in s.external_hashes(cfg, None).items() if k.startswith("plugin:")}
        for s in (*STAGES, EVAL_STAGE)
        if s.active(cfg)
    }


def test_the_default_run_has_no_plugin_in_any_key():
    assert all(not h for h in plugin_hashes(load_config([])).values())


def test_editing_a_plugin_changes_the_keys_of_exactly_the_stages_that_use_it(package):
    cfg = load_config(
        [
            "reward.components=[{target: 'keypkg.judge:judge', verdict: true}, {name: format, weight: 0}]",
            "rl.loss=keypkg.loss:loss",
        ]
    )
    before = plugin_hashes(cfg)
    assert {s for s, h in before.items() if "plugin:keypkg.judge:judge" in h} == VERDICT_STAGES | {"eval"}
    assert {s for s, h in before.items() if "plugin:keypkg.loss:loss" in h} == {"rl"}
    (package / "judge.py").write_text("def judge(sample):\n    return 1.0  # edited\n")
    after = plugin_hashes(cfg)
    changed = {s for s in before if before[s] != after[s]}
    assert changed == VERDICT_STAGES | {"eval"}
    (package / "loss.py").write_text("def loss(batch, objective):\n    return 2 * batch.logprobs\n")
    assert {s for s in after if after[s] != plugin_hashes(cfg)[s]} == {"rl"}


def test_a_benchmark_verdict_enters_only_the_evaluations(package):
    bench = f"{{name: mine, path: {package / '__init__.py'}, verdict: 'keypkg.judge:judge'}}"
    cfg = load_config([f"eval.benchmarks=[arith_heldout,{bench}]"])
    users = {s for s, h in plugin_hashes(cfg).items() if h}
    assert users == {"eval_warmup", "eval_rft", "eval_rl", "eval", "rl"}  # rl: its in-run evaluation
    cfg = load_config([f"eval.benchmarks=[arith_heldout,{bench}]", "rl.eval_every=0"])
    assert {s for s, h in plugin_hashes(cfg).items() if h} == {"eval_warmup", "eval_rft", "eval_rl", "eval"}
