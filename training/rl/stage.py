"""The RL stage: from the warm-up checkpoint on the prompt pool, with the configured objective.

Writes the final checkpoint, the per-step history (``history.jsonl``, without wall-clock timings so
that identical weights hash identically) and the prompts trained on (``consumed.json``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from tqdm.auto import tqdm

from conf.schema import RLConfig
from training.model import encode_prompt, load_model, save_model
from training.objectives import PRESETS, ObjectiveParams
from training.rl.loop import RLResult, format_step, run_sync
from training.rl.records import PromptItem
from training.setup import read_table

LOG = logging.getLogger("laminar.training")
TIMING_KEYS = ("gen_seconds", "train_seconds", "gen_tokens_per_s")


OVERRIDABLE = ("advantage", "loss_agg", "behaviour_weight", "is_cap", "clip_low", "clip_high", "dual_clip",
               "dynamic_sampling", "max_sampling_rounds", "overlong_shaping", "overlong_filter", "kl_coef")


def objective_params(cfg: RLConfig) -> ObjectiveParams:
    """The algorithm's preset with the config's explicit overrides (None keeps the preset)."""
    overrides = {k: getattr(cfg, k) for k in OVERRIDABLE if getattr(cfg, k) is not None}
    return dataclasses.replace(PRESETS[cfg.algorithm], overlong_cache_len=cfg.overlong_cache_len, **overrides)


def rl(model_dir: Path, data_dir: Path, cfg: RLConfig, *, template: str, seed: int, device: str, out_dir: Path,
       verifier) -> RLResult:
    """RL from the warm-up checkpoint on the prompt pool (see the module docstring for what it writes)."""
    model, tokenizer = load_model(model_dir, device)
    rows = read_table(Path(data_dir) / "pool.parquet")
    prompts = [PromptItem(prompt_id=r["prompt_id"], text=r["problem"], answer=r["answer"],
                          prompt_tokens=encode_prompt(tokenizer, template.format(problem=r["problem"])),
                          level=r.get("level")) for r in rows]
    params = objective_params(cfg)
    with tqdm(total=cfg.steps, desc=f"rl {cfg.algorithm}/{cfg.mode}", unit="step", leave=False) as bar:
        def on_step(m: dict) -> None:
            line = format_step(m, cfg.steps)
            bar.update(1)
            bar.write(line)
            LOG.info(line)

        result = run_sync(model, tokenizer, prompts, verifier, params, steps=cfg.steps,
                          prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size, lr=cfg.lr,
                          weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
                          max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=seed,
                          device=device, minibatches=cfg.minibatches, on_step=on_step)
    save_model(model.to("cpu"), tokenizer, out_dir)
    with open(Path(out_dir) / "history.jsonl", "w") as f:
        for m in result.history:
            f.write(json.dumps({k: v for k, v in m.items() if k not in TIMING_KEYS}, sort_keys=True) + "\n")
    with open(Path(out_dir) / "consumed.json", "w") as f:
        json.dump(dict(sorted(result.consumed.items())), f, indent=1)
    return result
