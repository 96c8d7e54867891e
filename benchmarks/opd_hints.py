"""Can the model read a hint? The privileged self-teacher's prompt formats probed on an RFT checkpoint.

For each ``teacher.hint`` format (``{answer}`` filled, put before the problem as ``privileged_text``
does) and the plain prompt: the mean per-token log-prob of the reference solution after that prompt,
and the greedy accuracy with it. A hint the model can read raises both above the plain prompt's; on
the tiny default model every format tried lowers both (issue 54: why the self-teacher hurts there).

    .venv/bin/python benchmarks/opd_hints.py --base-ws /work/tmp-base-ws [--n 160] [--json-out F.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HINTS = ["Answer: {answer}\n", "#### {answer}\n", "{answer}\n", "What is {answer}?\n", "{answer} "]
"""``teacher.hint`` values to probe (the first is the default)."""


def probe(model, tok, rows, template: str, hint: str | None) -> dict:
    """Mean log-prob per solution token and greedy accuracy over ``rows`` with ``hint`` (None: plain)."""
    from generation.model import encode_prompt, encode_response
    from training.rl.teacher import privileged_text

    lp_sum, n_tok, correct = 0.0, 0, 0
    with torch.no_grad():
        for row in rows:
            text = template.replace("{problem}", row["problem"])
            if hint is not None:
                text = privileged_text(template, hint, row["problem"], row["answer"])
            p = list(encode_prompt(tok, text))
            r = list(encode_response(tok, row["solution"]))
            ids = torch.tensor([p + r])
            logp = torch.log_softmax(model(ids).logits[0, len(p) - 1 : -1], -1)
            lp_sum += float(logp.gather(-1, ids[0, len(p) :, None]).sum())
            n_tok += len(r)
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            said = tok.decode(out[0, len(p) :], skip_special_tokens=True)
            m = re.search(r"####\s*(-?\d+)", said)
            correct += bool(m and m.group(1) == row["answer"])
    return {"logprob_per_token": round(lp_sum / n_tok, 4), "greedy_accuracy": round(correct / len(rows), 4)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-ws", type=Path, required=True)
    ap.add_argument("--n", type=int, default=160, help="selected prompts probed (the first N)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)

    import pandas as pd

    from conf.loader import load_config
    from generation.model import load_model, load_tokenizer
    from generation.setup import setup_torch
    from tasks.stages.common import template

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from opd import base_run

    setup_torch(1, 0)
    summary = base_run(args.base_ws)
    art = {k: v["artifacts"] for k, v in summary["stages"].items()}
    model_dir = args.base_ws / "artifacts" / "model" / art["rft"]["model"]
    model, _ = load_model(model_dir, "cpu")
    tok = load_tokenizer(model_dir)
    prompts = args.base_ws / "artifacts" / "selection" / art["select"]["selection"] / "prompts.parquet"
    rows = pd.read_parquet(prompts).head(args.n).to_dict("records")
    tmpl = template(load_config([]))
    out = {"date": time.strftime("%Y-%m-%d"), "base_run": summary["run_id"], "model": "rft", "n": len(rows)}
    out["plain"] = probe(model.eval(), tok, rows, tmpl, None)
    out["hints"] = {h: probe(model, tok, rows, tmpl, h) for h in HINTS}
    print(json.dumps(out, indent=1))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
