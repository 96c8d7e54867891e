"""The warm-up stage: SFT on the curated prompt pool's demonstrations."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tqdm.auto import tqdm

from conf.schema import EnvConfig, LoraConfig, SFTConfig
from generation.model import encode_problem, encode_response
from training.lora import load_trainable, save_trained
from generation.setup import read_table
from training.sft import SFTExample, train_sft


def target(row: dict) -> str:
    """What warm-up imitates: the demonstration when the pool has one, else the worked solution, else
    just the final answer in the ``#### <answer>`` form the verifier reads."""
    for key in ("demonstration", "solution"):
        if row.get(key):
            return row[key]
    return f"#### {row['answer']}"


def tool_demonstrations(examples, rows, env: EnvConfig, tokenizer, sandbox=None) -> list[SFTExample]:
    """``examples`` with ``env.demo_tool_share`` of them (by a hash of the prompt id) replaced by a
    two-turn tool demonstration (``ToolEnvironment.demonstration``: the observation masked out); an
    environment without the calculator tool (a game, a user's environment) leaves them as they are."""
    from environments.calculator import arith_call
    from environments.registry import make_environment
    from generation.records import PromptItem

    environment = make_environment(env, tokenizer, sandbox)
    if "calc" not in getattr(environment, "tools", {}):  # no calculator to demonstrate (a game, a user's)
        return list(examples)
    out = []
    for ex, r in zip(examples, rows):
        share = int(hashlib.sha256(f"tool:{r['prompt_id']}".encode()).hexdigest()[:8], 16) / 16**8
        call = arith_call(r["problem"]) if share < env.demo_tool_share else None
        if call is None:
            out.append(ex)
            continue
        tokens, mask = environment.demonstration(call, f"#### {r['answer']}")
        prompt, _ = environment.reset(PromptItem(r["prompt_id"], r["problem"], r["answer"], ex.prompt_tokens))
        out.append(SFTExample(prompt, tokens, mask))
    return out


def warmup(
    model_dir: Path,
    prompts_path: Path,
    cfg: SFTConfig,
    *,
    template: str,
    seed: int,
    device: str,
    out_dir: Path,
    lora: LoraConfig | None = None,
    env: EnvConfig | None = None,
    sandbox=None,
) -> dict[str, float]:
    """Warm-up SFT on the curated pool's demonstrations (for the synthetic task ``data.demo_error_rate``
    of their steps slip); prompts without a level are always used, the others when in ``cfg.levels``.
    With a tool environment (``env``), ``env.demo_tool_share`` of them solve the problem with the tool
    (run under ``sandbox``, the run's ``conf.schema.SandboxConfig``, where the tool runs code)."""
    model, tokenizer, _ = load_trainable(model_dir, lora, "warmup", device=device, seed=seed)
    rows = [
        r
        for r in read_table(Path(prompts_path))
        if r.get("level") is None or r.get("level") in set(cfg.levels)
    ]
    examples = [
        SFTExample(encode_problem(tokenizer, template, r["problem"]), encode_response(tokenizer, target(r)))
        for r in rows
    ]
    if env is not None and not env.is_default():
        examples = tool_demonstrations(examples, rows, env, tokenizer, sandbox)
    with tqdm(total=cfg.steps, desc="warmup sft", unit="step", leave=False, disable=None) as bar:
        metrics = train_sft(
            model,
            examples,
            steps=cfg.steps,
            batch_size=cfg.batch_size,
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm,
            pad_id=tokenizer.pad_token_id,
            seed=seed,
            device=device,
            progress=bar,
            stage="warmup",
            keys={
                "sft.lr": cfg.lr,
                "sft.max_grad_norm": cfg.max_grad_norm,
                "sft.weight_decay": cfg.weight_decay,
                "sft.warmup_steps": cfg.warmup_steps,
            },
        )
    save_trained(model.to("cpu"), tokenizer, out_dir)
    return metrics
