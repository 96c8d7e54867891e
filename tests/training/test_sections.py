"""Config sections travel as objects (issue 51): the RL stage, its drivers and the rollout actor take one
``RLSections``, and every engine takes one ``EngineOptions`` whose defaults are the only ones."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from conf.loader import load_config
from conf.schema import EngineOptions, RolloutConfig
from generation.engine import Engine
from generation.engines import make_engine, worker_command
from generation.model import build_char_tokenizer, build_tiny_model, encode_prompt, save_model
from generation.records import PromptItem
from tests.training.rl_fakes import MICRO
from training.objectives import PRESETS
from training.rl.actors import RolloutWorker
from training.rl.drivers.local import LocalDriver
from training.rl.drivers.ray import LaminarRuntime
from training.rl.sections import RLSections
from training.rl.stage import rl

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {f.name for f in dataclasses.fields(RLSections)}


@pytest.mark.parametrize("hop", [rl, LocalDriver, LaminarRuntime, RolloutWorker], ids=lambda h: h.__name__)
def test_no_hop_fans_the_sections_out_into_keywords(hop):
    """A new section (or option) edits the schema and ``RLSections``, never these signatures."""
    params = set(inspect.signature(hop).parameters)
    assert "run" in params and not params & SECTIONS, sorted(params & SECTIONS)


def test_the_sections_are_the_validated_configs_own_objects():
    cfg = load_config(["seed=3", "rl.max_new_tokens=7", "rollout.sync_every=2", "env=calculator"])
    run = RLSections.of(cfg)
    assert run.rl is cfg.rl and run.rollout is cfg.rollout and run.env is cfg.env and run.seed == 3
    assert run.select is cfg.curation.select and run.lora is cfg.model.lora and run.cluster is cfg.cluster
    opts = run.engine_options(5, lora_rank=4)
    assert (opts.capacity, opts.max_new_tokens, opts.seed, opts.lora_rank) == (5, 7, 3, 4)
    assert opts.rollout is cfg.rollout and opts.temperature == cfg.rl.temperature


def test_the_local_driver_builds_its_engine_from_the_sections(tmp_path):
    tok = build_char_tokenizer()
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, tmp_path)
    cfg = load_config(["rl.max_new_tokens=5", "rl.rollout_capacity=3", "rollout.sync_every=2", "seed=4"])
    prompts = [PromptItem(f"p{i}", f"{i}+1", str(i + 1), encode_prompt(tok, f"{i}+1="), 1) for i in range(4)]
    driver = LocalDriver(tmp_path, prompts, None, PRESETS["grpo"], RLSections.of(cfg), device="cpu")
    driver._build()
    batch = cfg.rl.prompts_per_step * cfg.rl.group_size  # the local rollout holds the whole batch
    assert (driver.engine.capacity, driver.engine.max_new_tokens, driver.engine.seed) == (batch, 5, 4)
    assert driver.engine.sync_every == 2 and driver.engine.temperature == cfg.rl.temperature


def test_engine_options_have_one_default_each(tmp_path):
    """``Engine``, ``make_engine`` and the worker's command line take their defaults from
    ``EngineOptions`` (no literal default for an engine option in their signatures)."""
    tok = build_char_tokenizer()
    save_model(build_tiny_model(MICRO, tok, seed=0), tok, tmp_path)
    d = EngineOptions()
    engine = make_engine(tmp_path)
    assert (engine.capacity, engine.max_new_tokens, engine.temperature, engine.seed) == (
        d.capacity,
        d.max_new_tokens,
        d.temperature,
        d.seed,
    )
    assert Engine(engine.model, tok).capacity == d.capacity
    cmd = worker_command(tmp_path, d, python="py", device="cpu")
    assert cmd[cmd.index("--capacity") + 1] == str(d.capacity) and d.rollout == RolloutConfig()
    names = set(inspect.signature(EngineOptions).parameters) | set(
        inspect.signature(RolloutConfig).parameters
    )
    literal = []
    for path in ("generation/engine.py", "generation/engines.py", "generation/vllm_worker.py"):
        for fn in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = fn.args
                pos = a.posonlyargs + a.args
                pairs = list(zip(pos[len(pos) - len(a.defaults) :], a.defaults)) + list(
                    zip(a.kwonlyargs, a.kw_defaults)
                )
                literal += [
                    f"{path}:{fn.name}({arg.arg})"
                    for arg, default in pairs
                    if arg.arg in names | {"gpu_memory_utilization", "enforce_eager"}
                    and isinstance(default, ast.Constant)
                    and default.value is not None
                ]
    assert not literal, literal
