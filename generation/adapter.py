"""LoRA adapters on the generation side: PEFT adapter folders and published adapter versions.

A LoRA checkpoint is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``, plus the
tokenizer's files) whose ``base_model_name_or_path`` names the full model it adapts: the name of a
sibling folder in the same artifact store (``artifacts/model/<sha256>``; the workspace stays
movable) or an absolute path. ``load_model`` of such a folder returns the merged model.

A published adapter version (what RL's trainer sends through the relays when it trains LoRA) is a
``{name: array}`` dict of the adapter tensors only, under PEFT's saved names
(``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), plus ``SCALING_KEY`` (alpha / r).
A rollout keeps its own copy of the base: ``load_published`` merges each version into it,
``W = W0 + scaling * B @ A`` from the kept ``W0``, so versions never accumulate and every version
gives the same weights whatever was loaded before (benchmarks/lora_publish.py measures merged
against unmerged decoding). The vLLM worker does not merge: it writes each version as a PEFT folder
and names it in every request (``generation.vllm_worker``); it imports this module for the names
only, so torch is imported inside the functions that need it (vLLM's environment pins its own).
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Mapping, Sequence

import numpy as np

ADAPTER_CONFIG = "adapter_config.json"
SCALING_KEY = "__lora_scaling__"
_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def base_dir(adapter_dir: str | Path) -> Path:
    """The full model an adapter folder applies to (see the module docstring)."""
    adapter_dir = Path(adapter_dir)
    with open(adapter_dir / ADAPTER_CONFIG) as f:
        name = json.load(f).get("base_model_name_or_path") or ""
    for cand in (adapter_dir.parent / name, Path(name).expanduser()):
        if name and (cand / "config.json").is_file():
            return cand.resolve()
    raise FileNotFoundError(
        f"adapter {adapter_dir}: its base model {name!r} is neither a folder beside it in the "
        "artifact store nor an existing path; copy the base next to it or pass the workspace "
        "it came from"
    )


def base_reference(base: str | Path) -> str:
    """What an adapter records as its base: the folder's name when the base is a sealed artifact (the
    adapter will sit beside it in the store), else its absolute path."""
    base = Path(base).resolve()
    return base.name if (base / "manifest.json").is_file() else str(base)


def adapter_rank(path: str | Path) -> int:
    """The rank ``r`` of the adapter folder ``path``, 0 for a full model folder: what a vLLM rollout
    must be started with (``--lora-rank``) to take the versions published on top of it."""
    if not is_adapter_dir(path):
        return 0
    with open(Path(path) / ADAPTER_CONFIG) as f:
        r = json.load(f).get("r")
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"adapter {path}: {ADAPTER_CONFIG} has no positive integer rank r (got {r!r})")
    return r


def model_dir_for_sampling(path: str | Path) -> Path:
    """The folder an engine that receives published versions loads: the base of an adapter folder
    (the adapter itself arrives as version 0 before any sampling), else the folder itself."""
    return base_dir(path) if is_adapter_dir(path) else Path(path)


def is_adapter_state(state: Mapping[str, np.ndarray]) -> bool:
    return SCALING_KEY in state


def adapter_pairs(state: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{base parameter name: (A, B)}`` of a published adapter; raises on a half pair."""
    pairs: dict[str, list] = {}
    for k, v in state.items():
        if k == SCALING_KEY:
            continue
        if not k.startswith(_PREFIX) or not k.endswith((_A, _B)):
            raise KeyError(f"published adapter: unexpected tensor {k!r} (only lora_A/lora_B weights travel)")
        module = k[len(_PREFIX) : -len(_A)]
        pairs.setdefault(module + ".weight", [None, None])[0 if k.endswith(_A) else 1] = v
    half = [k for k, (a, b) in pairs.items() if a is None or b is None]
    if half:
        raise KeyError(f"published adapter: lora_A or lora_B missing for {half[:3]}")
    return {k: (a, b) for k, (a, b) in pairs.items()}


def merge_adapter(model, state: Mapping[str, np.ndarray]) -> int:
    """Set every adapted weight of the plain (unwrapped) ``model`` to ``W0 + scaling * B @ A``, W0 being
    the weight before the first adapter was merged (kept on the model). Checked before anything is
    written; returns the number of weights merged."""
    import torch

    with torch.no_grad():
        return _merge_adapter(model, state)


def _merge_adapter(model, state: Mapping[str, np.ndarray]) -> int:
    import torch

    scaling = float(np.asarray(state[SCALING_KEY]).reshape(-1)[0])
    pairs = adapter_pairs(state)
    params = dict(model.named_parameters())
    for name, (a, b) in pairs.items():
        if name not in params:
            raise KeyError(f"published adapter adapts {name!r}, which this model does not have")
        w = params[name]
        if (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"published adapter: {name} A {a.shape} x B {b.shape} does not fit {tuple(w.shape)}"
            )
    kept = model.__dict__.setdefault("_lora_base_weights", {})
    for name, (a, b) in pairs.items():
        w = params[name]
        if name not in kept:
            kept[name] = w.detach().clone()
        w0 = kept[name]
        a_t = torch.from_numpy(np.array(a, dtype=np.float32)).to(w.device)
        b_t = torch.from_numpy(np.array(b, dtype=np.float32)).to(w.device)
        if w.dtype == torch.float32:  # one fused W0 + scaling * B @ A straight into the weight
            torch.addmm(w0, b_t, a_t, alpha=scaling, out=w.data)
        else:
            w.copy_(torch.addmm(w0.float(), b_t, a_t, alpha=scaling).to(w.dtype))
    for name in [n for n in kept if n not in pairs]:  # a module this version no longer adapts: back to W0
        params[name].copy_(kept[name])
    return len(pairs)


def load_published(model, state: Mapping[str, np.ndarray]) -> None:
    """Load a published version into a plain model: merge an adapter, or replace every weight."""
    import torch

    if is_adapter_state(state):
        merge_adapter(model, state)
    else:
        model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()}, strict=True)


def sequence_logprobs(model, tokens: Sequence[int], temperature: float = 1.0) -> list[float]:
    """Log-probs of ``tokens[1:]`` given their prefixes under ``model`` (one forward pass): what the
    rollout-equals-trainer check compares between a rollout and the trainer."""
    import torch

    with torch.inference_mode():
        return _sequence_logprobs(model, tokens, temperature)


def _sequence_logprobs(model, tokens: Sequence[int], temperature: float) -> list[float]:
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).cpu().tolist()
