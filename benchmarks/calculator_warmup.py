"""The calculator environment after warm-up SFT alone (no curation, no RL): a tiny default model
trained on worked solutions only against one trained with ``env.demo_tool_share`` of the
demonstrations using the calculator, both evaluated on held-out problems by level (the long level
through episodes for the tool arm). A cheap proxy for ``laminar run env=calculator``.

    python benchmarks/calculator_warmup.py --steps 300 --out benchmarks/results/environments/x.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from conf.schema import EnvConfig, ModelConfig
from data_curation.synthetic import PROMPT_TEMPLATE, generate
from evaluation.benchmarks import BenchmarkItem
from evaluation.evaluate import evaluate_items
from generation.model import build_char_tokenizer, build_tiny_model, encode_problem, encode_response
from rewards.verifier import Verifier
from training.sft import SFTExample, train_sft
from training.warmup import tool_demonstrations


def arm(tool: bool, pool, held, args, tok) -> dict:
    model = build_tiny_model(ModelConfig(), tok, args.seed)
    rows = [{"prompt_id": p.prompt_id, "problem": p.problem, "answer": p.answer} for p in pool]
    examples = [
        SFTExample(encode_problem(tok, PROMPT_TEMPLATE, p.problem), encode_response(tok, p.demonstration))
        for p in pool
    ]
    env = EnvConfig(target="calculator", max_turns=3, demo_tool_share=args.share)
    if tool:
        examples = tool_demonstrations(examples, rows, env, tok)
    t0 = time.perf_counter()
    train_sft(
        model,
        examples,
        steps=args.steps,
        batch_size=32,
        lr=3e-3,
        warmup_steps=20,
        weight_decay=0.0,
        max_grad_norm=1.0,
        pad_id=tok.pad_token_id,
        seed=args.seed,
    )
    train_s = time.perf_counter() - t0
    model.eval()
    items = [BenchmarkItem("heldout", p.prompt_id, p.problem, p.answer, str(p.level)) for p in held]
    out = {
        "train_seconds": round(train_s, 1),
        "tool_demonstrations": sum(bool(e.loss_mask) for e in examples),
    }
    with Verifier(timeout_s=5.0) as verifier:
        for name, e in (("single_turn", None), ("calculator", env)):
            if e is not None and not tool:
                continue
            rows_ = evaluate_items(
                model,
                tok,
                items,
                templates={"heldout": PROMPT_TEMPLATE},
                n_samples=1,
                temperature=1.0,
                max_new_tokens=args.max_new_tokens,
                batch_size=64,
                seed=args.seed,
                device="cpu",
                verifier=verifier,
                env=e,
            )
            by_level = {}
            for r in rows_:
                by_level.setdefault(r.level, []).append(r)
            out[name] = {
                lv: {
                    "accuracy": sum(r.correct for r in rs) / len(rs),
                    "tool_calls": sum(r.tool_calls for r in rs) / len(rs),
                    "turns": sum(r.turns for r in rs) / len(rs),
                    "tool_errors": sum(r.tool_errors for r in rs) / len(rs),
                    "n": len(rs),
                }
                for lv, rs in sorted(by_level.items())
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--share", type=float, default=0.5)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--pool", type=int, default=3000)
    ap.add_argument("--heldout", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=110)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    pool, held = generate(args.seed, args.pool, args.heldout, args.levels)
    result = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name, tool in (("plain", False), ("tool", True)):
        result[name] = arm(tool, pool, held, args, tok)
        print(name, json.dumps(result[name]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
