"""A reward model on a real public preference file: Anthropic's HH-RLHF ``harmless-base/test.jsonl.gz``
(vendored byte-identical in ``data_curation/data/``, MIT; provenance in its README), ingested through
``data_curation.preferences`` (shape ``hh``: two transcripts that share a prompt prefix), decontaminated
against every evaluation benchmark, with the counts reconciled (rows in = comparisons + quarantined +
duplicates + contaminated). A Bradley-Terry RM on a tiny random backbone (a character tokenizer over the
file's own characters) is trained on 80% of the comparisons; printed: its held-out pairwise accuracy
beside random / longer-wins / shorter-wins on the same split.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/reward_model_public.py --seed 0 [--steps 600] [--out F.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HH_FILE = ROOT / "data_curation" / "data" / "hh_rlhf_harmless_base_test.jsonl.gz"


def hh_rows(path: Path = HH_FILE) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def benchmark_items() -> list:
    from evaluation.benchmarks import BENCHMARKS, load_benchmark
    from evaluation.code_benchmarks import load_humaneval

    items = [it for name in sorted(BENCHMARKS) for it in load_benchmark(name)]
    return items + load_humaneval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-len", type=int, default=256, help="characters the RM reads (the end of the text)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import pyarrow.parquet as pq

    from conf.schema import ModelConfig
    from data_curation.preferences import ingest_preferences
    from generation.model import build_char_tokenizer, build_tiny_model, save_model
    from training.reward_model import train_reward_model

    rows = hh_rows()
    charset = "".join(sorted({ch for r in rows for k in ("chosen", "rejected") for ch in r[k]}))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hh-rm-") as tmp:
        tmp = Path(tmp)
        counts = ingest_preferences([("hh_rlhf_harmless_test", "hh", rows)], tmp / "prefs", benchmark_items())
        reconciled = counts["candidates"] == (
            counts["comparisons"] + counts["quarantined"] + counts["duplicates"] + counts["contaminated"]
        )
        reasons: dict[str, int] = {}
        for r in pq.read_table(tmp / "prefs" / "quarantine.parquet").to_pylist():
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        comps = pq.read_table(tmp / "prefs" / "comparisons.parquet").to_pylist()
        tok = build_char_tokenizer(charset)
        cfg = ModelConfig(
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            max_seq_len=max(args.max_len, 160),
        )
        save_model(build_tiny_model(cfg, tok, args.seed), tok, tmp / "lm")
        m = train_reward_model(
            tmp / "lm", comps, tmp / "rm", steps=args.steps, lr=args.lr, max_len=args.max_len, seed=args.seed
        )
    out = {
        "seed": args.seed,
        "file": str(HH_FILE.relative_to(ROOT)),
        "steps": args.steps,
        "max_len": args.max_len,
        "reconciled": reconciled,
        "quarantine_reasons": reasons,
        "seconds": round(time.perf_counter() - t0, 1),
        **counts,
        **m,
    }
    text = json.dumps(out, indent=1, sort_keys=True)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
