"""TRL's ``GRPOTrainer`` against the project's synchronous RL stage, side by side on the same
checkpoint, prompts, reward (the project's verifier), batch, lengths, optimizer and threads.

Both sides train the RFT checkpoint of a finished default run on its HIVE-selected prompts: 16 prompts
x 8 completions a step, 64 new tokens at temperature 1 (full vocabulary), GRPO (group-normalised
advantages, sequence-mean loss, clip 0.2, no KL), AdamW lr 1e-4 betas (0.9, 0.99) no weight decay,
gradient norm clipped at 1.0, ``--threads`` torch threads. Each (round, variant) runs in its own
process, the variants in a rotated order per round; every process runs ``--warmup`` untimed steps,
then ``--steps`` timed ones. Reported per variant (median over rounds of each round's median):
seconds per step, generated tokens/s over the whole step, and generated tokens/s of the generation
phase alone (the time inside ``model.generate`` for TRL, inside the rollout's orders for laminar;
generated tokens = each completion up to and including its EOS), and the ratios to TRL.

Variants: ``trl`` (TRL 1.16, HF ``generate``), ``laminar`` (the sync RL stage's local driver,
``training.rl.drivers.local.LocalDriver``, as shipped) and ``laminar-reference`` (the same driver
with the padded trainer forward the project had before issue 30), so the before/after of this
machine and load sits in one table.

TRL is a benchmark-only dependency: ``pip install -e '.[bench]'`` (or ``pip install trl==1.16.0``);
the project never imports it.

    .venv/bin/python benchmarks/trl_peer.py --workspace WS [--rounds 3] [--steps 8] [--warmup 2]
        [--threads 2] [--variants trl laminar laminar-reference] [--out benchmarks/results/trl_peer]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from training.rl.sections import RLSections

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("trl", "laminar", "laminar-reference")


def workspace_inputs(ws: Path) -> tuple[Path, Path]:
    """(RFT checkpoint folder, selected prompts parquet) of a finished run in workspace ``ws``."""
    summaries = sorted(glob.glob(str(ws / "runs" / "*" / "summary.json")))
    for s in reversed(summaries):
        stages = json.load(open(s))["stages"]
        if "rft" in stages and "select" in stages:
            art = ws / "artifacts"
            return (
                art / "model" / stages["rft"]["artifacts"]["model"],
                art / "selection" / stages["select"]["artifacts"]["selection"] / "prompts.parquet",
            )
    raise SystemExit(f"no finished run with rft and select stages under {ws}/runs")


def load_prompts(model_dir: Path, prompts_path: Path):
    from data_curation.synthetic import PROMPT_TEMPLATE
    from generation.model import encode_problem, load_tokenizer
    from generation.records import PromptItem
    from generation.setup import read_table

    tok = load_tokenizer(model_dir)
    rows = read_table(prompts_path)
    return tok, [
        PromptItem(
            prompt_id=r["prompt_id"],
            text=r["problem"],
            answer=r["answer"],
            prompt_tokens=encode_problem(tok, PROMPT_TEMPLATE, r["problem"]),
            level=r.get("level"),
        )
        for r in rows
    ]


def completion_lengths(completions, eos_id: int) -> list[int]:
    """Generated tokens per row of ``completions`` [B, T]: up to and including the first EOS."""
    import torch

    is_eos = completions == eos_id
    first = torch.where(
        is_eos.any(1),
        is_eos.int().argmax(1) + 1,
        torch.full_like(is_eos[:, 0], completions.shape[1], dtype=torch.long),
    )
    return first.tolist()


# ------------------------------------------------------------------------------------------ workers


def run_laminar(args, reference: bool) -> dict:
    import torch

    import training.rl.drivers.local as local
    from conf.loader import load_config
    from rewards.verifier import Verifier
    from training.rl import trainer as trainer_mod
    from training.rl.stage import objective_params

    cfg = load_config(
        [
            f"seed={args.seed}",
            f"rl.steps={args.warmup + args.steps}",
            f"rl.prompts_per_step={args.prompts_per_step}",
            f"rl.group_size={args.group_size}",
            f"rl.max_new_tokens={args.max_new_tokens}",
            "rl.eval_every=0",
        ]
    )
    _, prompts = load_prompts(args.model_dir, args.prompts)
    gen_calls: list[tuple[float, int]] = []
    pending = [0.0, 0]  # seconds and tokens of the rollout's orders since the last step
    original = local.run_order

    def timed_order(engine, order, *a, **kw):
        t0 = time.perf_counter()
        out = original(engine, order, *a, **kw)
        pending[0] += time.perf_counter() - t0
        pending[1] += sum(len(t.response_tokens) for t in getattr(out, "finished", ()))
        return out

    def on_step(m) -> None:
        stamps.append(time.perf_counter())
        gen_calls.append((pending[0], pending[1]))
        pending[:] = [0.0, 0]

    local.run_order = timed_order
    if reference and hasattr(trainer_mod, "REFERENCE_FORWARD"):
        trainer_mod.REFERENCE_FORWARD = True  # the padded trainer forward (the decode has no reference path)
    stamps = [time.perf_counter()]
    with Verifier(timeout_s=cfg.eval.verifier_timeout_s) as verifier:
        local.LocalDriver(
            Path(args.model_dir),
            prompts,
            verifier,
            objective_params(cfg.rl),
            RLSections(cfg.rl, seed=args.seed, rollout=cfg.rollout),
            device="cpu",
            on_step=on_step,
        ).run()
    return {
        "step_s": [b - a for a, b in zip(stamps, stamps[1:])],
        "gen_s": [g for g, _ in gen_calls],
        "tokens": [n for _, n in gen_calls],
        "torch_threads": torch.get_num_threads(),
    }


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from conf.loader import load_config
    from data_curation.synthetic import PROMPT_TEMPLATE
    from rewards.verifier import Verifier

    cfg = load_config([f"seed={args.seed}"])
    tok, prompts = load_prompts(args.model_dir, args.prompts)
    bos = tok.bos_token or ""
    # the prompt text TRL tokenizes (no special tokens added) gives exactly the project's prompt ids
    data = Dataset.from_list(
        [{"prompt": bos + PROMPT_TEMPLATE.replace("{problem}", p.text), "answer": p.answer} for p in prompts]
    )
    known = {tuple(p.prompt_tokens) for p in prompts}
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model_dir), use_safetensors=True, dtype=torch.float32
    )
    gen_calls: list[tuple[float, int]] = []
    mismatched = [0]
    original = model.generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = original(*a, **kw)
        dt = time.perf_counter() - t0
        ids, attn = kw["input_ids"], kw["attention_mask"]
        width = ids.shape[1]
        for row, m in zip(ids.tolist(), attn.tolist()):
            mismatched[0] += tuple(r for r, k in zip(row, m) if k) not in known
        gen_calls.append((dt, sum(completion_lengths(out[:, width:], tok.eos_token_id))))
        return out

    model.generate = timed_generate
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if not stamps:
                stamps.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            stamps.append(time.perf_counter())

    with Verifier(timeout_s=cfg.eval.verifier_timeout_s) as verifier:

        def reward(prompts, completions, answer, **kw):
            return [v.reward for v in verifier.verify_batch(list(completions), list(answer))]

        out_dir = tempfile.mkdtemp(prefix="trl_peer-")
        gcfg = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=args.prompts_per_step * args.group_size,
            num_generations=args.group_size,
            max_completion_length=args.max_new_tokens,
            max_steps=args.warmup + args.steps,
            learning_rate=cfg.rl.lr,
            adam_beta1=0.9,
            adam_beta2=0.99,
            weight_decay=cfg.rl.weight_decay,
            max_grad_norm=cfg.rl.max_grad_norm,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch",
            beta=0.0,
            loss_type="grpo",
            scale_rewards="group",
            epsilon=0.2,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            use_cpu=True,
            bf16=False,
            fp16=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            seed=args.seed,
            dataloader_num_workers=0,
            log_completions=False,
            disable_tqdm=True,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=gcfg,
            train_dataset=data,
            processing_class=tok,
            callbacks=[Stamp()],
        )
        torch.set_num_threads(args.threads)  # after the Trainer set-up (accelerate may touch it)
        trainer.train()
    return {
        "step_s": [b - a for a, b in zip(stamps, stamps[1:])],
        "gen_s": [g for g, _ in gen_calls],
        "tokens": [n for _, n in gen_calls],
        "prompt_mismatches": mismatched[0],
        "torch_threads": torch.get_num_threads(),
    }


def worker(args) -> None:
    import torch

    from generation.setup import setup_torch

    setup_torch(args.threads, args.seed)
    t0 = time.perf_counter()
    res = (
        run_trl(args)
        if args.worker == "trl"
        else run_laminar(args, reference=args.worker == "laminar-reference")
    )
    res["process_s"] = time.perf_counter() - t0
    n = len(res["step_s"])
    if len(res["gen_s"]) != n or n != args.warmup + args.steps:
        raise SystemExit(
            f"{args.worker}: {n} steps and {len(res['gen_s'])} generate calls, expected "
            f"{args.warmup + args.steps} each"
        )
    w = args.warmup
    step_s, gen_s, toks = res["step_s"][w:], res["gen_s"][w:], res["tokens"][w:]
    res.update(
        variant=args.worker,
        torch_version=torch.__version__,
        median_step_s=statistics.median(step_s),
        step_tokens_per_s=sum(toks) / sum(step_s),
        gen_tokens_per_s=sum(toks) / sum(gen_s),
        mean_response_tokens=sum(toks) / len(toks) / (args.prompts_per_step * args.group_size),
        median_update_s=statistics.median(s - g for s, g in zip(step_s, gen_s)),
    )
    Path(args.result).write_text(json.dumps(res, indent=1))


# ------------------------------------------------------------------------------------------ driver


def loadavg() -> float:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except OSError:
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workspace",
        type=Path,
        help="a workspace with a finished default run (its RFT checkpoint and selected prompts)",
    )
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trl_peer")
    ap.add_argument("--tag", default=time.strftime("%Y-%m-%d_%H%M"))
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.workspace is not None:
        args.model_dir, args.prompts = workspace_inputs(args.workspace)
    if args.model_dir is None or args.prompts is None:
        ap.error("give --workspace, or --model-dir and --prompts")
    if args.worker:
        return worker(args)

    runs: list[dict] = []
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
        for v in order:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                result = f.name
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                v,
                "--result",
                result,
                "--model-dir",
                str(args.model_dir),
                "--prompts",
                str(args.prompts),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--threads",
                str(args.threads),
                "--prompts-per-step",
                str(args.prompts_per_step),
                "--group-size",
                str(args.group_size),
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--seed",
                str(args.seed),
            ]
            env = {
                **os.environ,
                "OMP_NUM_THREADS": str(args.threads),
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            }
            load0 = loadavg()
            subprocess.run(cmd, check=True, env=env, cwd=ROOT)
            res = json.loads(Path(result).read_text())
            os.unlink(result)
            res.update(round=r, load_before=load0, load_after=loadavg())
            runs.append(res)
            print(
                f"round {r} {v:18s} {res['median_step_s']:.3f} s/step | "
                f"step {res['step_tokens_per_s']:7.0f} tok/s | "
                f"gen {res['gen_tokens_per_s']:7.0f} tok/s | update {res['median_update_s']:.3f} s | "
                f"len {res['mean_response_tokens']:.1f} | load {load0:.2f}->{res['load_after']:.2f}",
                flush=True,
            )

    summary = {}
    for v in args.variants:
        mine = [x for x in runs if x["variant"] == v]
        summary[v] = {
            k: statistics.median(x[k] for x in mine)
            for k in (
                "median_step_s",
                "step_tokens_per_s",
                "gen_tokens_per_s",
                "median_update_s",
                "mean_response_tokens",
            )
        }
    ratios = {}
    if "trl" in summary:
        for v in args.variants:
            if v != "trl":
                ratios[v] = {
                    "step_tokens_per_s": summary[v]["step_tokens_per_s"]
                    / summary["trl"]["step_tokens_per_s"],
                    "gen_tokens_per_s": summary[v]["gen_tokens_per_s"] / summary["trl"]["gen_tokens_per_s"],
                    "seconds_per_step": summary["trl"]["median_step_s"] / summary[v]["median_step_s"],
                }
    out = {
        "config": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("worker", "result")
        },
        "machine": {"cpus": os.cpu_count(), "loadavg_end": open("/proc/loadavg").read().strip()},
        "summary": summary,
        "ratios_vs_trl": ratios,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trl_peer_{args.tag}.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({"summary": summary, "ratios_vs_trl": ratios}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
