"""The warm-up stage alone, for one seed and recipe: its loss curve and held-out accuracy as it learns.

Same data, model initialisation, example order and optimizer as the pipeline's warm-up (batch,
learning rate, cosine schedule, clipping), with the model shape and schedule as flags; held-out
avg@1 every ``--eval-every`` steps and avg@4 at the end, overall and per level. Writes
``--out/warmup_<tag>_s<seed>.json``. Where the 4-head default failed on seed 1 (issue 23):

    .venv/bin/python benchmarks/warmup_probe.py --seed 1 --heads 4 --kv 2 --tag four_heads
    .venv/bin/python benchmarks/warmup_probe.py --seed 1 --heads 8 --kv 4 --tag eight_heads
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch
from conf.schema import ModelConfig
from data_curation.synthetic import generate, PROMPT_TEMPLATE
from generation.model import build_char_tokenizer, build_tiny_model, encode_problem, encode_response
from training.sft import SFTExample, collate, lr_lambda
from evaluation.benchmarks import items_from_records
from evaluation.evaluate import evaluate_items, summarize_rows
from rewards.verifier import Verifier


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--bs", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--floor", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--inter", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv", type=int, default=4)
    p.add_argument("--err", type=float, default=0.15)
    p.add_argument("--b2", type=float, default=0.95)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, default=Path("/tmp"))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    pool, held = generate(a.seed, 6000, 300, [1, 2, 3, 4, 5], a.err)
    tok = build_char_tokenizer()
    mc = ModelConfig(
        hidden_size=a.hidden,
        intermediate_size=a.inter,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv,
    )
    model = build_tiny_model(mc, tok, a.seed)
    ex = [
        SFTExample(encode_problem(tok, PROMPT_TEMPLATE, r.problem), encode_response(tok, r.demonstration))
        for r in pool
    ]
    items = items_from_records("arith_heldout", [r.__dict__ for r in held], id_key="prompt_id")
    ver = Verifier(timeout_s=5.0).__enter__()

    def ev(n):
        model.eval()
        rows = evaluate_items(
            model,
            tok,
            items,
            templates={"arith_heldout": PROMPT_TEMPLATE},
            n_samples=n,
            temperature=1.0,
            max_new_tokens=64,
            batch_size=256,
            seed=a.seed,
            device="cpu",
            verifier=ver,
        )
        s = summarize_rows(rows, n)["arith_heldout"]
        model.train()
        lv = {k: round(next(iter(v.values())), 3) for k, v in (s.get("by_level") or {}).items()}
        return round(s["accuracy"], 4), lv

    rng = random.Random(f"sft:{a.seed}")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.wd, betas=(0.9, a.b2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(a.warm, a.steps, a.floor))
    order, ema, log, evals = [], None, [], []
    t0 = time.time()
    for step in range(a.steps):
        if len(order) < a.bs:
            fresh = list(range(len(ex)))
            rng.shuffle(fresh)
            order.extend(fresh)
        idx, order = order[: a.bs], order[a.bs :]
        ids, attn, labels = collate([ex[i] for i in idx], tok.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        v = float(loss.detach())
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        if (step + 1) % 25 == 0:
            log.append((step + 1, round(ema, 4)))
        if (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
            acc, lv = ev(1)
            evals.append((step + 1, acc, lv))
            print(a.tag, a.seed, step + 1, "loss", round(ema, 3), "acc@1", acc, lv, flush=True)
    train_s = time.time() - t0
    acc, lv = ev(a.n)
    out = dict(args=vars(a), train_s=round(train_s, 1), final_acc=acc, by_level=lv, loss=log, evals=evals)
    print(json.dumps({k: out[k] for k in ("train_s", "final_acc", "by_level")}), a.tag, a.seed, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / f"warmup_{a.tag}_s{a.seed}.json", "w") as f:
        json.dump(out, f, default=str)
    ver.__exit__(None, None, None)


if __name__ == "__main__":  # the verifier spawns workers that re-import this module
    main()
