"""LoRA training through ``peft``: a frozen base with trainable low-rank adapters.

A stage with ``model.lora`` on for it (``LoraConfig.on(stage)``) loads what it starts from with
``load_trainable``: an adapter folder continues its adapter (PEFT's own config), a full model gets a
fresh adapter (``lora_B`` = 0: the same function as the base until the first step). Only the adapter
parameters require gradients, so the optimizers built over ``trainable_parameters`` hold state for
them alone. ``save_trained`` writes a PEFT folder for an adapter (its base recorded by
``generation.adapter.base_reference``) and a ``save_pretrained`` folder otherwise.

``adapter_state`` is what RL publishes: the adapter tensors under PEFT's saved names and the
scaling (``generation.adapter`` merges them on the rollouts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from conf.schema import LoraConfig
from generation.adapter import ADAPTER_CONFIG, SCALING_KEY, base_dir, base_reference, is_adapter_dir
from generation.model import check_adapter_weights, load_model, load_tokenizer, save_model


def peft_config(cfg: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def is_peft(model) -> bool:
    """Whether ``model`` is a PEFT model (never imports peft, a seconds-long import, to say no)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def load_trainable(
    model_dir: str | Path, cfg: LoraConfig | None, stage: str, *, device: str = "cpu", seed: int = 0
):
    """(model, tokenizer, base) for a training stage. LoRA on for ``stage``: a PeftModel over the frozen
    base (an adapter folder's own adapter continued, or a fresh one seeded with ``seed``) and the base
    folder; otherwise the plain model (an adapter folder merged) and None."""
    model_dir = Path(model_dir)
    if cfg is None or not cfg.on(stage):
        model, tokenizer = load_model(model_dir, device)
        return model, tokenizer, None
    from peft import get_peft_model

    if is_adapter_dir(model_dir):
        return continue_adapter(model_dir, device)
    model, tokenizer = load_model(model_dir, device)
    torch.manual_seed(seed)  # lora_A's initialisation
    model = get_peft_model(model, peft_config(cfg))
    model.peft_config["default"].base_model_name_or_path = base_reference(model_dir)
    return model.to(device), tokenizer, model_dir


def continue_adapter(adapter_dir: str | Path, device: str = "cpu"):
    """(PeftModel with the folder's adapter trainable on its frozen base, tokenizer, base folder)."""
    from peft import PeftModel

    check_adapter_weights(adapter_dir)
    base = base_dir(adapter_dir)
    model, _ = load_model(base, device)
    model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    model.peft_config["default"].base_model_name_or_path = base_reference(base)
    return model.to(device), load_tokenizer(adapter_dir), base


def load_for_rl(model_dir: str | Path, device: str = "cpu"):
    """(model, tokenizer) RL's trainer starts from: an adapter folder trains its adapter (the RL stage
    hands the runtime an adapter folder exactly when ``model.lora`` is on for rl), else the full model."""
    if is_adapter_dir(model_dir):
        model, tokenizer, _ = continue_adapter(model_dir, device)
        return model, tokenizer
    return load_model(Path(model_dir), device)


def sampling_copy(model):
    """The sampler's own copy of the policy: a plain model. For a PEFT model, its base without the
    adapter (``unload``, not merged): published adapter versions are merged into it from then on."""
    import copy

    clone = copy.deepcopy(model)
    return clone.unload() if is_peft(model) else clone


def full_model(model_dir: str | Path, out_dir: str | Path) -> Path:
    """An adapter folder written out as its merged ``save_pretrained`` model (``laminar export``, and RL
    when it trains every weight of what an adapter stage left)."""
    model, tokenizer = load_model(Path(model_dir), "cpu")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_model(model, tokenizer, Path(out_dir))
    return Path(out_dir)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters an optimizer steps: all of a plain model, the adapters of a PEFT model."""
    return [p for p in model.parameters() if p.requires_grad]


def save_trained(model, tokenizer, out_dir: str | Path) -> None:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors + tokenizer) for a PEFT
    model, a full ``save_pretrained`` folder otherwise."""
    if not is_peft(model):
        save_model(model, tokenizer, Path(out_dir))
        return
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    readme = Path(out_dir) / "README.md"  # PEFT's model card template: nothing the pipeline reads
    if readme.exists():
        readme.unlink()
    canonical_adapter_config(Path(out_dir) / ADAPTER_CONFIG)


def canonical_adapter_config(path: Path) -> None:
    """Rewrite a PEFT ``adapter_config.json`` with its module sets sorted. PEFT holds
    ``target_modules`` (and ``exclude_modules``) as sets and writes them in set order, which follows the
    process's string-hash seed: the same adapter got a different file, so a different artifact sha256,
    in every process. PEFT reads the sorted list back as the same set."""
    cfg = json.loads(path.read_text())
    for key in ("target_modules", "exclude_modules"):
        if isinstance(cfg.get(key), list):
            cfg[key] = sorted(cfg[key])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def lora_scaling(model) -> float:
    """The adapters' alpha / r (one value: every adapted module of a config shares it)."""
    from peft.tuners.lora import LoraLayer

    values = {float(m.scaling["default"]) for m in model.modules() if isinstance(m, LoraLayer)}
    if len(values) != 1:
        raise ValueError(f"expected one LoRA scaling over the adapted modules, found {sorted(values)}")
    return values.pop()


def adapter_state(model) -> dict[str, np.ndarray]:
    """The adapter tensors of a PEFT model as host float32 arrays under PEFT's saved names, plus the
    scaling: a published adapter version (``generation.adapter``)."""
    plan = model.__dict__.get("_laminar_publish_plan")
    if plan is None:  # once per model: which parameters, under which saved names, and the scaling
        from peft import get_peft_model_state_dict

        names = {n: n.replace(".default.", ".") for n, p in model.named_parameters() if p.requires_grad}
        if set(names.values()) != set(get_peft_model_state_dict(model)):
            raise ValueError("the trainable parameters are not exactly the adapter's saved tensors")
        plan = model.__dict__["_laminar_publish_plan"] = (names, lora_scaling(model))
    names, scaling = plan
    params = dict(model.named_parameters())
    out = {saved: params[n].detach().to("cpu", torch.float32).numpy().copy() for n, saved in names.items()}
    out[SCALING_KEY] = np.array([scaling], dtype=np.float32)
    return out


def fresh_adapter(model_dir: str | Path, cfg: LoraConfig, out_dir: str | Path, *, seed: int) -> Path:
    """Write a fresh adapter on the full model ``model_dir`` to ``out_dir`` (what RL starts from when
    the stage before it trained every weight): the runtime's roles then all start from one folder."""
    model, tokenizer, _ = (
        load_trainable(model_dir, cfg, "rl", seed=seed) if cfg.on("rl") else (None, None, None)
    )
    if model is None:
        raise ValueError("fresh_adapter needs model.lora on for rl")
    model.peft_config["default"].base_model_name_or_path = str(Path(model_dir).resolve())
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_trained(model, tokenizer, out_dir)
    return Path(out_dir)


def adapter_from_state(start_dir: str | Path, state: dict[str, np.ndarray], out_dir: str | Path) -> None:
    """Write the adapter folder of published ``state`` (``adapter_state``), with the config and base of
    the adapter folder ``start_dir`` it continued."""
    from peft import PeftModel, set_peft_model_state_dict

    base = base_dir(start_dir)
    model, _ = load_model(base, "cpu")
    model = PeftModel.from_pretrained(model, str(start_dir), is_trainable=False)
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state.items() if k != SCALING_KEY}
    result = set_peft_model_state_dict(model, tensors)
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise KeyError(f"adapter state lacks {missing[:3]}")
    model.peft_config["default"].base_model_name_or_path = base_reference(base)
    save_trained(model, load_tokenizer(start_dir), out_dir)
