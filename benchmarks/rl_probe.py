"""The RL stage alone from a finished workspace's RFT checkpoint and HIVE selection, then the held-out
evaluation: try RL settings without rerunning curation (issue 23). Overrides are config keys.

    .venv/bin/python benchmarks/rl_probe.py WORKSPACE --tag lr3e5 -- seed=1 rl.lr=3e-5
"""

import argparse
import glob
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conf.loader import load_config
from evaluation.stages import evaluate_checkpoint
from generation.setup import setup_torch
from rewards.verifier import Verifier
from tasks.stages.common import template
from tasks.stages.evaluate import eval_templates as _eval_templates
from training.rl.sections import RLSections
from training.rl.stage import rl


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ws")
    p.add_argument("--tag")
    p.add_argument("over", nargs="*")
    a, extra = p.parse_known_args()
    a.over = [o for o in a.over + extra if o != "--"]
    ws = Path(a.ws)
    s = json.load(open(glob.glob(str(ws / "runs/*/summary.json"))[0]))
    cfg = load_config(a.over)
    setup_torch(1, cfg.seed)
    A = ws / "artifacts"  # artifacts/<kind>/<sha256>
    rft = A / "model" / s["stages"]["rft"]["artifacts"]["model"]
    sel = A / "selection" / s["stages"]["select"]["artifacts"]["selection"]
    data = A / "dataset" / s["stages"]["data"]["artifacts"]["dataset"]
    out = Path(tempfile.mkdtemp(prefix="rl_probe-"))
    t0 = time.time()
    with Verifier(timeout_s=5.0) as ver:
        rl(
            rft,
            sel / "prompts.parquet",
            RLSections(cfg.rl, seed=cfg.seed, select=cfg.curation.select),
            template=template(cfg),
            device="cpu",
            out_dir=out,
            reward=ver,
            history_path=sel / "history.parquet",
        )
    t1 = time.time()
    ev = Path(tempfile.mkdtemp(prefix="rl_probe-"))
    summ = evaluate_checkpoint(
        out, data, cfg.eval, templates=_eval_templates(), seed=cfg.seed, device="cpu", out_dir=ev
    )
    h = summ["arith_heldout"]
    print(
        "RESULT",
        a.tag,
        a.over,
        "rl_s",
        round(t1 - t0),
        "acc",
        round(h["accuracy"], 4),
        {k: round(next(iter(v.values())), 3) for k, v in h["by_level"].items()},
        flush=True,
    )


if __name__ == "__main__":
    main()
