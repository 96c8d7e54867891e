"""Rollout engines behind the rollout protocol (``generation.protocol``), and the one place the
runtime chooses among them (``make_engine``).

- ``torch``: the built-in ``generation.engine.Engine`` in this process (``static_cache`` /
  ``cuda_graphs``: fixed-shape decode, CUDA graphs on a GPU).
- ``torch-process``: the same engine in a worker process behind the wire format (what ``vllm`` uses,
  with the built-in engine: the conformance tests exercise the wire path with it).
- ``vllm``: ``generation.vllm_worker`` in vLLM's own Python environment (``make vllm-env``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from collections.abc import Mapping

import torch

from conf.schema import ENGINE_KINDS, EngineKind, EngineOptions, RolloutConfig
from generation.engine import Engine
from generation.protocol import REPO_ROOT, EngineProcess, RolloutEngine

VLLM_PYTHON_ENV = "LAMINAR_VLLM_PYTHON"


def load_torch_engine(model_dir: str | Path, options: EngineOptions, *, device: str = "cpu") -> Engine:
    """The built-in ``Engine`` with ``options`` over the HF checkpoint in ``model_dir``."""
    from generation.model import load_model

    model, tokenizer = load_model(Path(model_dir), device)
    return Engine(model, tokenizer, options, device=device)


def vllm_python(explicit: str | None = None) -> str | None:
    """The interpreter of vLLM's environment: ``explicit``, else ``$LAMINAR_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` in the repository (``make vllm-env``); None when none exists."""
    for cand in (explicit, os.environ.get(VLLM_PYTHON_ENV), str(REPO_ROOT / ".venv-vllm" / "bin" / "python")):
        if cand and Path(cand).exists():
            return cand
    return None


def engine_kind(rollout: RolloutConfig) -> EngineKind:
    """``rollout.engine``, checked: an unknown kind is one clear error before any engine starts."""
    if rollout.engine not in ENGINE_KINDS:
        raise ValueError(f"rollout.engine={rollout.engine!r}: expected one of {ENGINE_KINDS}")
    return rollout.engine


def worker_command(model_dir: str | Path, options: EngineOptions, *, python: str, device: str) -> list[str]:
    """The command line of the engine worker (``generation.vllm_worker``) with ``options``."""
    r, kind = options.rollout, engine_kind(options.rollout)
    flags = (["--static-cache"] if r.static_cache else []) + (["--cuda-graphs"] if r.cuda_graphs else [])
    if kind == "vllm":
        flags += ["--vllm-gpu-memory-utilization", repr(float(r.vllm_gpu_memory_utilization))]
        flags += ["--vllm-enforce-eager"] if r.vllm_enforce_eager else []
        if options.lora_rank:  # the built-in engine merges adapters: nothing to set up
            flags += ["--lora-rank", str(int(options.lora_rank))]
    return [
        python,
        "-m",
        "generation.vllm_worker",
        "--engine",
        "torch" if kind == "torch-process" else kind,
        "--model-dir",
        str(model_dir),
        "--device",
        device,
        "--capacity",
        str(options.capacity),
        "--max-new-tokens",
        str(options.max_new_tokens),
        "--temperature",
        repr(float(options.temperature)),
        "--seed",
        str(options.seed),
        "--dtype",
        r.dtype,
        "--sync-every",
        str(r.sync_every),
        *flags,
    ]


def make_engine(
    model_dir: str | Path,
    options: EngineOptions | None = None,
    *,
    device: str = "cpu",
    env: Mapping[str, str] | None = None,
) -> RolloutEngine:
    """The rollout engine ``options.rollout.engine`` (``torch``, ``torch-process`` or ``vllm``) with
    ``options`` (``conf.schema.EngineOptions``; None: its defaults) over the HF checkpoint in
    ``model_dir``. Every kind speaks ``RolloutEngine`` and keeps ``Engine``'s names (``version``,
    ``admitting``, ``extract``, ``load_state``, ``step``, ``status``), so ``RolloutWorker`` drives them
    alike. The process kinds run ``generation.vllm_worker`` (``torch-process``: in this interpreter;
    ``vllm``: in ``vllm_python(options.rollout.vllm_python)``), ``env`` added to the worker's
    environment. ``options.lora_rank`` > 0 starts the vLLM worker for published LoRA adapters up to
    that rank (a ``model.lora`` RL run; ``generation.adapter.adapter_rank``); the built-in engines
    merge adapters without it."""
    options = options if options is not None else EngineOptions()
    kind = engine_kind(options.rollout)
    if kind == "torch":
        return load_torch_engine(model_dir, options, device=device)
    py = sys.executable if kind == "torch-process" else vllm_python(options.rollout.vllm_python)
    if py is None:
        raise RuntimeError(
            f"rollout.engine=vllm needs vLLM's environment: run `make vllm-env` (creates "
            f".venv-vllm) or set {VLLM_PYTHON_ENV} to a Python with vllm installed"
        )
    worker_env = {"OMP_NUM_THREADS": str(max(1, torch.get_num_threads()))}
    worker_env.update(env or {})
    return EngineProcess(worker_command(model_dir, options, python=py, device=device), env=worker_env)
