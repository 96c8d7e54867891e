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


def _tool_share(prompt_id: str) -> float:
    return int(hashlib.sha256(f"tool:{prompt_id}".encode()).hexdigest()[:8], 16) / 16**8


def tool_demonstrations(examples, rows, env: EnvConfig, tokenizer, sandbox=None) -> list[SFTExample]:
    """``examples`` with ``env.demo_tool_share`` of them (by a hash of the prompt id) replaced by a
    two-turn tool demonstration, the observation masked out: ``ToolEnvironment.demonstration`` for the
    in-process calculator; for an agent (``env.target`` naming ``solve``) the agent's own episode with
    scripted turns (``demonstrate``: its tool called in the format the endpoint renders and parses for
    its conversation, the agent's tool result, the answer). An environment without the calculator tool
    (a game, a user's environment, an agent that offers no ``calc``) leaves them as they are."""
    from environments.calculator import arith_call
    from environments.registry import make_environment
    from generation.records import PromptItem

    environment = make_environment(env, tokenizer, sandbox)
    agent = callable(getattr(environment, "demonstrate", None))
    try:
        if not agent and "calc" not in getattr(environment, "tools", {}):
            return list(examples)
        jobs = {}
        for i, (ex, r) in enumerate(zip(examples, rows)):
            call = arith_call(r["problem"]) if _tool_share(r["prompt_id"]) < env.demo_tool_share else None
            if call is not None:
                item = PromptItem(r["prompt_id"], r["problem"], r["answer"], ex.prompt_tokens, r.get("level"))
                jobs[i] = (item, call, f"#### {r['answer']}")
        if agent:
            done = _agent_demonstrations(environment, jobs)
        else:
            done = {}
            for i, (item, call, answer) in jobs.items():
                tokens, mask = environment.demonstration(call, answer)
                done[i] = (environment.reset(item)[0], tokens, mask)
        return [SFTExample(*done[i]) if done.get(i) else ex for i, ex in enumerate(examples)]
    finally:
        close = getattr(environment, "close", None)
        if callable(close):
            close()


def _agent_demonstrations(environment, jobs: dict) -> dict:
    """``environment.demonstrate`` of every job, agents run at once (each waits on its own agent)."""
    from concurrent.futures import ThreadPoolExecutor

    if not jobs:
        return {}
    with ThreadPoolExecutor(min(len(jobs), 16), thread_name_prefix="agent-demo") as pool:
        out = pool.map(lambda job: environment.demonstrate(*job), jobs.values())
        return dict(zip(jobs, out))


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
