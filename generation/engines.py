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
from collections.abc import Mapping, Sequence

import torch

from conf.schema import ENGINE_KINDS, EngineKind
from generation.engine import Engine
from generation.protocol import REPO_ROOT, EngineProcess, RolloutEngine

VLLM_PYTHON_ENV = "LAMINAR_VLLM_PYTHON"


def load_torch_engine(
    model_dir: str | Path,
    *,
    device: str = "cpu",
    capacity: int = 64,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    dtype: str = "auto",
    sync_every: int = 0,
    static_cache: bool = False,
    cuda_graphs: bool = False,
):
    """The built-in ``Engine`` over the HF checkpoint in ``model_dir``; ``static_cache`` (implied by
    ``cuda_graphs``): static KV slots."""
    from generation.model import load_model

    model, tokenizer = load_model(Path(model_dir), device)
    kw = dict(
        device=device,
        capacity=capacity,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        dtype=dtype,
        sync_every=sync_every,
    )
    return Engine(model, tokenizer, static_cache=static_cache, cuda_graphs=cuda_graphs, **kw)


def vllm_python(explicit: str | None = None) -> str | None:
    """The interpreter of vLLM's environment: ``explicit``, else ``$LAMINAR_VLLM_PYTHON``, else
    ``.venv-vllm/bin/python`` in the repository (``make vllm-env``); None when none exists."""
    for cand in (explicit, os.environ.get(VLLM_PYTHON_ENV), str(REPO_ROOT / ".venv-vllm" / "bin" / "python")):
        if cand and Path(cand).exists():
            return cand
    return None


def worker_command(
    kind: EngineKind,
    model_dir: str | Path,
    *,
    python: str,
    device: str,
    capacity: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    dtype: str = "auto",
    sync_every: int = 0,
    static_cache: bool = False,
    cuda_graphs: bool = False,
    lora_rank: int = 0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    engine = "torch" if kind == "torch-process" else kind
    flags = (["--static-cache"] if static_cache else []) + (["--cuda-graphs"] if cuda_graphs else [])
    if kind == "vllm" and lora_rank:  # the built-in engine merges adapters: nothing to set up
        flags += ["--lora-rank", str(int(lora_rank))]
    return [
        python,
        "-m",
        "generation.vllm_worker",
        "--engine",
        engine,
        "--model-dir",
        str(model_dir),
        "--device",
        device,
        "--capacity",
        str(capacity),
        "--max-new-tokens",
        str(max_new_tokens),
        "--temperature",
        repr(float(temperature)),
        "--seed",
        str(seed),
        "--dtype",
        dtype,
        "--sync-every",
        str(sync_every),
        *flags,
        *extra_args,
    ]


def make_engine(
    kind: EngineKind,
    model_dir: str | Path,
    *,
    device: str = "cpu",
    capacity: int = 64,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    dtype: str = "auto",
    sync_every: int = 0,
    static_cache: bool = False,
    cuda_graphs: bool = False,
    python: str | None = None,
    vllm_args: Sequence[str] = (),
    lora_rank: int = 0,
    env: Mapping[str, str] | None = None,
) -> RolloutEngine:
    """The rollout engine ``kind`` (``torch``, ``torch-process`` or ``vllm``) over the HF checkpoint in
    ``model_dir``. Every kind speaks ``RolloutEngine`` and keeps ``Engine``'s names
    (``version``, ``admitting``, ``extract``, ``load_state``, ``step``, ``status``), so
    ``RolloutWorker`` drives them alike. ``python`` is the worker interpreter of the process kinds
    (``vllm``: ``vllm_python()``); ``vllm_args`` are extra ``--vllm-*`` options for the vLLM worker
    (e.g. ``["--vllm-gpu-memory-utilization", "0.5"]``). ``dtype``, ``sync_every``, ``static_cache`` and
    ``cuda_graphs`` configure the built-in ``Engine``.
    ``lora_rank`` > 0 starts the vLLM worker for published LoRA adapters up to that rank (a ``model.lora``
    RL run; ``generation.adapter.adapter_rank``); the built-in engines merge adapters without it."""
    if kind == "torch":
        return load_torch_engine(
            model_dir,
            device=device,
            capacity=capacity,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            dtype=dtype,
            sync_every=sync_every,
            static_cache=static_cache,
            cuda_graphs=cuda_graphs,
        )
    if kind == "torch-process":
        py = python or sys.executable
    elif kind == "vllm":
        py = vllm_python(python)
        if py is None:
            raise RuntimeError(
                f"rollout.engine=vllm needs vLLM's environment: run `make vllm-env` (creates "
                f".venv-vllm) or set {VLLM_PYTHON_ENV} to a Python with vllm installed"
            )
    else:
        raise ValueError(f"unknown rollout engine {kind!r}; choose one of {ENGINE_KINDS}")
    cmd = worker_command(
        kind,
        model_dir,
        python=py,
        device=device,
        capacity=capacity,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        dtype=dtype,
        sync_every=sync_every,
        static_cache=static_cache,
        cuda_graphs=cuda_graphs,
        lora_rank=lora_rank,
        extra_args=vllm_args if kind == "vllm" else (),
    )
    worker_env = {"OMP_NUM_THREADS": str(max(1, torch.get_num_threads()))}
    worker_env.update(env or {})
    return EngineProcess(cmd, env=worker_env)


ROLLOUT_DEFAULTS = {
    "engine": "torch",
    "dtype": "auto",
    "sync_every": 0,
    "static_cache": False,
    "cuda_graphs": False,
    "vllm_python": None,
    "vllm_gpu_memory_utilization": 0.85,
    "vllm_enforce_eager": False,
}


def rollout_engine_options(rollout_cfg=None, lora_rank: int = 0) -> dict:
    """``make_engine`` keyword arguments (besides model dir, device, capacity, max_new_tokens,
    temperature, seed) from a ``rollout`` config section; missing fields take ``ROLLOUT_DEFAULTS``.
    ``lora_rank``: the rank of the adapter the run samples with (0: none), which a vLLM worker must be
    started for. Plain values only, so the dict travels to a Ray actor as is."""
    get = (
        (lambda k: getattr(rollout_cfg, k, ROLLOUT_DEFAULTS[k]))
        if rollout_cfg is not None
        else ROLLOUT_DEFAULTS.get
    )
    kind = str(get("engine"))
    if kind not in ENGINE_KINDS:
        raise ValueError(f"rollout.engine={kind!r}: expected one of {ENGINE_KINDS}")
    opts = {
        "kind": kind,
        "dtype": str(get("dtype")),
        "sync_every": int(get("sync_every")),
        "static_cache": bool(get("static_cache")),
        "cuda_graphs": bool(get("cuda_graphs")),
    }
    if kind == "vllm":
        opts["python"] = get("vllm_python")
        opts["vllm_args"] = [
            "--vllm-gpu-memory-utilization",
            str(float(get("vllm_gpu_memory_utilization"))),
        ] + (["--vllm-enforce-eager"] if get("vllm_enforce_eager") else [])
        if lora_rank:
            opts["lora_rank"] = int(lora_rank)
    return opts
