"""``laminar export ckpt=... out=DIR``: a checkpoint as one merged ``save_pretrained`` folder.

A LoRA checkpoint (a PEFT adapter folder) is merged into its base, the root of its lineage; a full
checkpoint is written as it is. The folder then loads anywhere with
``AutoModelForCausalLM.from_pretrained(DIR)`` (safetensors), with no adapter and no workspace.
"""

from __future__ import annotations

from pathlib import Path

from core.workspace import Workspace
from tasks.checkpoint_eval import EvalInputError, resolve_checkpoint


def parse_export_args(items: list[str]) -> tuple[str, str]:
    """``ckpt=SPEC out=DIR`` (either order) -> (SPEC, DIR); anything else raises EvalInputError."""
    got: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in ("ckpt", "out") or not value or key in got:
            raise EvalInputError(
                f"export takes ckpt=<checkpoint sha prefix or folder> out=<new folder>, got {item!r}"
            )
        got[key] = value
    if set(got) != {"ckpt", "out"}:
        raise EvalInputError("export needs both ckpt=<checkpoint sha prefix or folder> and out=<new folder>")
    return got["ckpt"], got["out"]


def export_checkpoint(ws: Workspace, spec: str, out: str | Path) -> dict:
    """Write checkpoint ``spec`` merged to ``out`` (which must not exist or be empty); returns what
    was done."""
    from generation.adapter import base_dir, is_adapter_dir
    from training.lora import full_model

    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise EvalInputError(f"out={out} exists and is not empty; name a new folder")
    ref = resolve_checkpoint(ws, spec)
    adapter = is_adapter_dir(ref.path)
    full_model(ref.path, out)
    return {
        "checkpoint": ref.sha256,
        "adapter": adapter,
        "out": str(out.resolve()),
        "base": str(base_dir(ref.path)) if adapter else None,
    }
