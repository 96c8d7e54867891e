"""Atomic checkpoints of the RL runtime: a trainer killed at any point resumes from the last
complete checkpoint.

Layout under ``root``::

    step-000012/            a complete checkpoint: its files plus COMPLETE.json
        COMPLETE.json       {"step": 12, "files": {relative path: sha256}}, written last
    .tmp-step-000013-4711/  a checkpoint being written by process 4711 (ignored by readers)

:func:`write_checkpoint` lets a caller's ``writer`` fill a fresh temp folder, fsyncs every file,
renames the folder to ``step-NNNNNN`` and only then writes the marker (temp name, fsync, rename,
fsync of the folders). A folder without a marker, or whose files no longer match the marker's
sha256, is not a checkpoint: :func:`latest_checkpoint` skips it.

Trainer state (:func:`save_trainer_state` / :func:`load_trainer_state`) is safetensors for every
tensor (weights, optimizer state, torch RNG) and JSON for everything else (optimizer
hyper-parameters and non-tensor state, Python and NumPy RNG, version, caller extras). Nothing is
pickled, so loading a checkpoint never executes code from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from core.artifacts import hash_file

__all__ = [
    "MARKER",
    "write_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_step",
    "is_complete",
    "save_trainer_state",
    "load_trainer_state",
    "save_json",
    "load_json",
    "verified_files",
    "RUN_STATE",
    "save_run",
    "resume_run",
]

MARKER = "COMPLETE.json"
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_RE = re.compile(r"^\.tmp-step-(\d{6,})-(\d+)$")

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
STATE_FILE = "trainer_state.json"
CRITIC_FILE = "critic.safetensors"
CRITIC_OPTIMIZER_FILE = "critic_optimizer.safetensors"
REFERENCE_FILE = "reference.safetensors"
CONTROLS_FILE = "trainer_controls.json"


# ---- durable filesystem helpers -----------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_and_fsync(path: Path) -> str:
    """sha256 of ``path``'s bytes, and fsync of the file, in one pass."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


def _atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp name + fsync + rename + fsync of the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint folder: its marker first (durably), so a half-deleted folder is never
    taken for a complete checkpoint."""
    marker = path / MARKER
    if marker.exists():
        marker.unlink()
        _fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True
    return True


# ---- checkpoints --------------------------------------------------------------------------------


def checkpoint_step(path: Path) -> int | None:
    """The step of a ``step-NNNNNN`` folder name, else None."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        step = checkpoint_step(p)
        if step is not None and p.is_dir():
            out.append((step, p))
    return sorted(out)


def _read_marker(path: Path) -> dict | None:
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        return None
    if marker.get("step") != checkpoint_step(path):
        return None
    return marker


def is_complete(path: Path, *, verify: bool = True) -> bool:
    """Whether ``path`` is a complete checkpoint: its marker exists, names its own step, and (with
    ``verify``) every file it lists exists with the recorded sha256."""
    path = Path(path)
    marker = _read_marker(path)
    if marker is None:
        return False
    if not verify:
        return True
    for name, digest in marker["files"].items():
        f = path / name
        try:
            if not f.is_file() or hash_file(f) != digest:
                return False
        except OSError:
            return False
    return True


def verified_files(ckpt: Path, sub: str) -> list[Path]:
    """The files under ``ckpt/sub`` after checking them against the checkpoint's own marker: every
    file there must be listed with its sha256, and every listed file must be there. Raises
    ValueError naming the first file that is not, so a loader that must trust what it reads (a
    pickle-based format such as DeepSpeed's) never opens a file the checkpoint did not write."""
    ckpt = Path(ckpt)
    marker = _read_marker(ckpt)
    if marker is None:
        raise ValueError(f"{ckpt} is not a complete checkpoint (no valid {MARKER}): refusing to load from it")
    listed = {k: v for k, v in marker["files"].items() if k.startswith(sub.rstrip("/") + "/")}
    present = sorted(p.relative_to(ckpt).as_posix() for p in (ckpt / sub).rglob("*") if p.is_file())
    for rel in present:
        if rel not in listed:
            raise ValueError(f"{ckpt / rel} is not in the checkpoint's {MARKER}: refusing to load it")
        if hash_file(ckpt / rel) != listed[rel]:
            raise ValueError(
                f"{ckpt / rel} does not match the sha256 in the checkpoint's {MARKER}: refusing to load it"
            )
    missing = sorted(set(listed) - set(present))
    if missing:
        raise ValueError(f"{ckpt / missing[0]} is listed in the checkpoint's {MARKER} but missing")
    return [ckpt / rel for rel in present]


def list_checkpoints(root: Path, *, verify: bool = False) -> list[Path]:
    """The ``step-NNNNNN`` folders of ``root`` that carry a valid marker, by ascending step. With
    ``verify`` the files are also checked against their sha256 (reads every file)."""
    return [p for _, p in _step_dirs(root) if is_complete(p, verify=verify)]


def latest_checkpoint(root: Path) -> Path | None:
    """The highest-step complete checkpoint of ``root`` whose files all match their sha256, else
    None. Temp folders, marker-less folders and corrupted checkpoints are skipped."""
    for _, p in reversed(_step_dirs(root)):
        if is_complete(p, verify=True):
            return p
    return None


def _clean_stale_temps(root: Path) -> None:
    """Remove temp folders left by writers that died (their pid no longer exists)."""
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if m and p.is_dir() and not _pid_alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True)


def write_checkpoint(root: Path, step: int, writer: Callable[[Path], None], keep: int = 2) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically and return its folder.

    ``writer(tmp_dir)`` writes the checkpoint's files (subfolders allowed) into a fresh
    ``root/.tmp-step-{step:06d}-{pid}``. Then every file is fsynced and hashed, the folder is renamed
    to ``root/step-{step:06d}`` (replacing any existing folder of that step, whose marker is removed
    first), and last the marker ``COMPLETE.json`` is written via a temp name + fsync + rename,
    followed by an fsync of the step folder and of ``root``. If anything before the marker fails,
    the temp (or renamed) folder is removed and the error re-raised: no ``step-*`` folder is left.

    Once the marker exists, complete checkpoints at or below ``step`` beyond the newest ``keep``
    are deleted (checkpoints of a higher step are left alone), together with marker-less
    ``step-*`` folders of a lower step (leftovers of a writer killed between rename and marker).
    Temp folders of dead writers are removed too.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_temps(root)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    final = root / f"step-{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    renamed = False
    try:
        writer(tmp)
        files: dict[str, str] = {}
        for dirpath, dirnames, filenames in os.walk(tmp):
            dirnames.sort()
            for fn in sorted(filenames):
                f = Path(dirpath) / fn
                rel = f.relative_to(tmp).as_posix()
                if rel == MARKER:
                    raise ValueError(f"a checkpoint writer must not write {MARKER}")
                files[rel] = _hash_and_fsync(f)
            _fsync_dir(Path(dirpath))
        if final.exists():
            _remove_checkpoint(final)
        os.rename(tmp, final)
        renamed = True
        _fsync_dir(root)
        _atomic_write_text(
            final / MARKER, json.dumps({"step": step, "files": files}, indent=1, sort_keys=True)
        )
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(final if renamed else tmp, ignore_errors=True)
        raise

    complete = [(s, p) for s, p in _step_dirs(root) if s <= step and is_complete(p, verify=False)]
    for _, p in sorted(complete, reverse=True)[keep:]:
        _remove_checkpoint(p)
    for s, p in _step_dirs(root):
        if s < step and not (p / MARKER).exists():
            shutil.rmtree(p, ignore_errors=True)
    return final


# ---- JSON state ---------------------------------------------------------------------------------


def _json_path(dir: Path, name: str) -> Path:
    p = Path(dir) / name
    return p if p.suffix else p.with_suffix(".json")


def save_json(dir: Path, name: str, obj: Any) -> Path:
    """Write ``obj`` as JSON to ``dir/name`` (``.json`` appended when ``name`` has no suffix),
    atomically (temp name + fsync + rename). For the coordinator's state inside a checkpoint: data
    cursor, buffered trajectories, in-flight prompts. Raises TypeError for non-JSON values."""
    path = _json_path(dir, name)
    _atomic_write_text(path, json.dumps(obj))
    return path


def load_json(dir: Path, name: str) -> Any:
    """Read what :func:`save_json` wrote."""
    return json.loads(_json_path(dir, name).read_text(encoding="utf-8"))


# ---- trainer state ------------------------------------------------------------------------------

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"


def _encode(obj: Any, path: str, tensors: dict) -> Any:
    """JSON-able form of ``obj``: every tensor moves into ``tensors`` under its dotted ``path`` and
    is replaced by a reference; tuples and dicts with non-string keys are tagged to round-trip."""
    import torch

    if isinstance(obj, torch.Tensor):
        key = path
        if key in tensors:
            raise ValueError(f"two tensors map to the safetensors key {key!r}")
        tensors[key] = obj.detach().to("cpu").clone().contiguous()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not ({_TENSOR, _TUPLE, _ITEMS} & set(obj)):
            return {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        for k in obj:
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"cannot serialise dict key {k!r} at {path}")
        return {_ITEMS: [[k, _encode(v, f"{path}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot serialise {type(obj).__name__} at {path}")


def _decode(obj: Any, tensors: dict) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR}:
            return tensors[obj[_TENSOR]]
        if set(obj) == {_TUPLE}:
            return tuple(_decode(v, tensors) for v in obj[_TUPLE])
        if set(obj) == {_ITEMS}:
            return {k: _decode(v, tensors) for k, v in obj[_ITEMS]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def _optimizer_payload(optimizer) -> tuple[dict, dict]:
    """(JSON structure, tensors) of ``optimizer.state_dict()``. State tensors are keyed
    ``state.{param_index}.{name}``; tensor-valued hyper-parameters ``param_groups.{i}.{name}``."""
    tensors: dict = {}
    sd = optimizer.state_dict()
    state = {str(idx): _encode(st, f"state.{idx}", tensors) for idx, st in sd["state"].items()}
    groups = _encode(sd["param_groups"], "param_groups", tensors)
    rest = {k: _encode(v, k, tensors) for k, v in sd.items() if k not in ("state", "param_groups")}
    return {"state": state, "param_groups": groups, "rest": rest}, tensors


def _optimizer_from_payload(payload: dict, tensors: dict) -> dict:
    sd = {k: _decode(v, tensors) for k, v in payload.get("rest", {}).items()}
    sd["state"] = {int(idx): _decode(st, tensors) for idx, st in payload["state"].items()}
    sd["param_groups"] = _decode(payload["param_groups"], tensors)
    return sd


def _numpy_state() -> dict | None:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "name": name,
        "keys": [int(k) for k in keys],
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _set_numpy_state(state: dict | None) -> None:
    if state is None:
        return
    import numpy as np

    np.random.set_state(
        (
            state["name"],
            np.asarray(state["keys"], dtype=np.uint32),
            state["pos"],
            state["has_gauss"],
            state["cached_gaussian"],
        )
    )


def save_trainer_state(dir: Path, model, optimizer, *, version: int, extra: dict | None = None) -> None:
    """Write the trainer's full state into ``dir`` (typically a :func:`write_checkpoint` writer's
    temp folder), without any pickle:

    - ``model.safetensors``: the model's state dict (tied/shared tensors stored once, via
      ``safetensors.torch.save_model``); of a LoRA (PEFT) model, its trainable adapter tensors only,
    - ``optimizer.safetensors``: every optimizer state tensor as ``state.{param_index}.{name}``
      (e.g. AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) and any tensor hyper-parameter,
    - ``rng.safetensors``: ``torch.get_rng_state()`` (and each CUDA device's state when CUDA is
      initialised),
    - ``trainer_state.json``: version, ``extra``, the optimizer's param groups (lr, betas, eps,
      weight_decay, ...) and non-tensor state, Python's ``random`` and NumPy's global RNG state.

    ``model=None`` / ``optimizer=None`` leave their files out (a backend that checkpoints them
    through its own API, e.g. DeepSpeed, keeps only the version and RNG here).
    """
    import torch
    from safetensors.torch import save_file, save_model

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    if model is not None:
        from training.lora import is_peft

        if is_peft(
            model
        ):  # LoRA: the adapters only; the frozen base comes back from its own folder on resume
            save_file(
                {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad},
                str(dir / MODEL_FILE),
            )
        else:
            save_model(model, str(dir / MODEL_FILE))
    opt_json = None
    if optimizer is not None:
        opt_json, opt_tensors = _optimizer_payload(optimizer)
        save_file(opt_tensors, str(dir / OPTIMIZER_FILE))
    rng = {"torch": torch.get_rng_state().clone()}
    n_cuda = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"cuda.{i}"] = s.cpu().clone()
        n_cuda = torch.cuda.device_count()
    save_file(rng, str(dir / RNG_FILE))
    state = {
        "version": int(version),
        "extra": extra if extra is not None else {},
        "optimizer": opt_json,
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
        "python_random": _encode(random.getstate(), "python_random", {}),
        "numpy_random": _numpy_state(),
        "cuda_devices": n_cuda,
        "torch_version": torch.__version__,
    }
    (dir / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")


def load_trainer_state(dir: Path, model, optimizer) -> dict:
    """Restore what :func:`save_trainer_state` wrote into ``model`` and ``optimizer`` (built the same
    way as when saved: same parameters and param-group layout; ``None`` skips one) and restore the
    torch, CUDA, Python
    and NumPy RNGs. Returns ``{"version", "extra", "optimizer_class", "torch_version"}``."""
    import torch
    from safetensors.torch import load_file, load_model

    dir = Path(dir)
    state = json.loads((dir / STATE_FILE).read_text(encoding="utf-8"))
    if optimizer is not None and state.get("optimizer_class") not in (None, type(optimizer).__name__):
        raise ValueError(
            f"checkpoint optimizer is {state['optimizer_class']}, got {type(optimizer).__name__}"
        )
    if model is not None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        from training.lora import is_peft

        if is_peft(model):  # the adapters (every trainable tensor, nothing else) onto the frozen base
            tensors = load_file(str(dir / MODEL_FILE), device=str(device))
            want = {n for n, p in model.named_parameters() if p.requires_grad}
            if set(tensors) != want:
                raise KeyError(
                    f"checkpoint adapters {sorted(set(tensors) ^ want)[:3]} do not match the model's"
                )
            model.load_state_dict(tensors, strict=False)
        else:
            load_model(model, str(dir / MODEL_FILE), strict=True, device=str(device))
    if optimizer is not None:
        opt_tensors = load_file(str(dir / OPTIMIZER_FILE))
        optimizer.load_state_dict(_optimizer_from_payload(state["optimizer"], opt_tensors))

    rng = load_file(str(dir / RNG_FILE))
    torch.set_rng_state(rng["torch"])
    cuda_states = [rng[f"cuda.{i}"] for i in range(state.get("cuda_devices", 0)) if f"cuda.{i}" in rng]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    random.setstate(_decode(state["python_random"], {}))
    _set_numpy_state(state.get("numpy_random"))
    return {
        "version": state["version"],
        "extra": state["extra"],
        "optimizer_class": state.get("optimizer_class"),
        "torch_version": state.get("torch_version"),
    }


def save_trainer_extras(dir: Path, trainer) -> None:
    """What a ``PolicyTrainer`` holds beside its policy and optimizer, into ``dir``: the critic's
    weights (``critic.safetensors``) and optimizer (``critic_optimizer.safetensors``) when it has a
    critic, the KL reference (``reference.safetensors``) when the objective resets it, and the
    adaptive entropy coefficient and the critic optimizer's param groups (``trainer_controls.json``)."""
    from safetensors.torch import save_file, save_model

    dir = Path(dir)
    controls: dict[str, Any] = {"entropy_coef": float(trainer.entropy_coef), "critic_optimizer": None}
    if trainer.critic is not None:
        save_model(trainer.critic, str(dir / CRITIC_FILE))
        controls["critic_optimizer"], tensors = _optimizer_payload(trainer.critic_opt)
        save_file(tensors, str(dir / CRITIC_OPTIMIZER_FILE))
    if trainer.ref_model is not None and trainer.params.ref_reset_every:
        save_model(trainer.ref_model, str(dir / REFERENCE_FILE))
    _atomic_write_text(dir / CONTROLS_FILE, json.dumps(controls))


def load_trainer_extras(dir: Path, trainer) -> None:
    """Restore what :func:`save_trainer_extras` wrote into ``trainer`` (built as when saved). A
    checkpoint without a critic for a trainer with one (or the reverse) is refused: resuming would
    silently restart the critic from scratch."""
    from safetensors.torch import load_file, load_model

    dir = Path(dir)
    path = dir / CONTROLS_FILE
    controls = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    has_critic = (dir / CRITIC_FILE).exists()
    if has_critic != (trainer.critic is not None):
        raise ValueError(
            f"checkpoint {dir} {'has' if has_critic else 'has no'} critic state but the run's objective "
            f"{'has none' if has_critic else 'has a critic'}: resume with the rl.algorithm it was saved with"
        )
    if trainer.critic is not None:
        device = next(trainer.critic.parameters()).device
        load_model(trainer.critic, str(dir / CRITIC_FILE), strict=True, device=str(device))
        tensors = load_file(str(dir / CRITIC_OPTIMIZER_FILE))
        trainer.critic_opt.load_state_dict(_optimizer_from_payload(controls["critic_optimizer"], tensors))
    if trainer.ref_model is not None and trainer.params.ref_reset_every and (dir / REFERENCE_FILE).exists():
        device = next(trainer.ref_model.parameters()).device
        load_model(trainer.ref_model, str(dir / REFERENCE_FILE), strict=True, device=str(device))
    if "entropy_coef" in controls:
        trainer.entropy_coef = float(controls["entropy_coef"])


# ---- the RL run's record ------------------------------------------------------------------------

RUN_STATE = "rl_state.json"
"""The driver's part of an RL checkpoint (beside the trainer's files): the version, the mode, the
prompt source's state, the manager's state (``RolloutManager.state``) and the history."""


@dataclass(frozen=True)
class Resumed:
    """What :func:`resume_run` restored: the checkpoint, the trainer's version, the history so far."""

    path: Path
    version: int
    history: list


def save_run(
    root: Path, *, save_trainer: Callable[[Path], None], manager, source, history: list, mode: str
) -> Path:
    """Checkpoint an RL run at the manager's version, atomically (:func:`write_checkpoint`), for
    every driver: ``save_trainer(folder)`` writes the trainer's state (its weights, optimizer and RNG;
    a DeepSpeed trainer its shards), then :data:`RUN_STATE` holds the manager, the prompt source and
    the history (``StepMetrics``). Returns the checkpoint's folder."""

    def writer(tmp: Path) -> None:
        save_trainer(tmp)
        save_json(
            tmp,
            RUN_STATE,
            {
                "version": manager.version,
                "mode": mode,
                "source": source.state(),
                **manager.state(),
                "history": [m.as_dict() for m in history],
            },
        )

    return write_checkpoint(root, manager.version, writer)


def resume_run(root: Path | None, *, load_trainer: Callable[[Path], int], manager, source) -> Resumed | None:
    """Restore the last complete checkpoint under ``root`` that :func:`save_run` wrote, if any:
    ``load_trainer(folder)`` restores the trainer and returns its version; the prompt source and the
    manager take their state back and the manager starts at that version. None without one."""
    from training.rl.records import StepMetrics

    ckpt = latest_checkpoint(root) if root is not None and Path(root).exists() else None
    if ckpt is None:
        return None
    state = load_json(ckpt, RUN_STATE)
    version = load_trainer(ckpt)
    source.load_state(state["source"])
    manager.load_state(state)
    manager.start_at(version)
    manager.counts["resumed"] = 1
    logging.getLogger("laminar.training").warning("resuming RL from checkpoint %s (update %d)", ckpt, version)
    return Resumed(ckpt, version, [StepMetrics.from_dict(h) for h in state["history"]])
