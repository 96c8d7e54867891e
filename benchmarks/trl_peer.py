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

``--model smollm2 DIR``: the real model instead (SmolLM2-135M-Instruct, the safetensors folder
``laminar model fetch smollm2`` writes) on ``recipe=smollm2_arith``'s task: the pool of its arithmetic
levels through the chat template with the recipe's answer-format prompt, its reward (the verifier plus
the format term, ``rewards.compose.Reward``: the same object scores both sides), LoRA for RL (the same
rank, alpha and modules: TRL gets them as its ``peft_config``), 16 prompts x 8 completions, 24 new
tokens, lr 2e-4 and the recipe's KL coefficient (TRL's ``beta``, the same k3 estimator in the loss;
the recipe's sizes; ``--prompts-per-step`` etc. override them). TRL gets the prompt as
a chat message and applies the same template; ``prompt_mismatches`` counts prompts whose token ids
differ from the project's (0 expected). Also reported: update tokens/s (generated tokens over the
time outside generation: scoring, log-probs, backward, optimizer).

TRL is a benchmark-only dependency: ``pip install -e '.[bench]'`` (or ``pip install trl==1.16.0``);
the project never imports it.

    .venv/bin/python benchmarks/trl_peer.py --workspace WS [--rounds 3] [--steps 8] [--warmup 2]
        [--threads 2] [--variants trl laminar laminar-reference] [--out benchmarks/results/trl_peer]
    .venv/bin/python benchmarks/trl_peer.py --model smollm2 DIR --threads 1 --rounds 2 --steps 3 \
        --warmup 1 --variants trl laminar --tag smollm2_2026-12-06
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
MODELS = ("smollm2",)
RECIPES = {"smollm2": "smollm2_arith"}
TINY_SIZES = {"prompts_per_step": 16, "group_size": 8, "max_new_tokens": 64}


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


def load_prompts(model_dir: Path, prompts_path: Path | None, template: str | None = None, rows=None):
    """(tokenizer, prompts): the rows of ``prompts_path`` (or ``rows``) in ``template`` (default: the
    tiny model's)."""
    from data_curation.synthetic import PROMPT_TEMPLATE
    from generation.model import encode_problem, load_tokenizer
    from generation.records import PromptItem
    from generation.setup import read_table

    tok = load_tokenizer(model_dir)
    rows = read_table(prompts_path) if rows is None else rows
    return tok, [
        PromptItem(
            prompt_id=r["prompt_id"],
            text=r["problem"],
            answer=r["answer"],
            prompt_tokens=encode_problem(tok, template or PROMPT_TEMPLATE, r["problem"]),
            level=r.get("level"),
        )
        for r in rows
    ]


def bench_config(args, extra: tuple[str, ...] = ()):
    """The project config both sides read: the default one (tiny mode), or ``--model``'s recipe, with
    the benchmark's seed, steps, batch and lengths."""
    from conf.loader import load_config

    recipe = [f"recipe={RECIPES[args.model[0]]}", f"threads={args.threads}"] if args.model else []
    cfg = load_config(
        [
            *recipe,
            f"seed={args.seed}",
            f"rl.steps={args.warmup + args.steps}",
            f"rl.prompts_per_step={args.prompts_per_step}",
            f"rl.group_size={args.group_size}",
            f"rl.max_new_tokens={args.max_new_tokens}",
            "rl.eval_every=0",
            *extra,
        ]
    )
    return cfg


def recipe_pool(cfg) -> list[dict]:
    """The recipe's training pool (its levels, pool size and seed), as the data stage draws it."""
    from data_curation.synthetic import generate

    d = cfg.data
    pool, _ = generate(cfg.seed, d.pool_size, d.heldout_size, list(d.levels))
    return [
        {"prompt_id": p.prompt_id, "problem": p.problem, "answer": p.answer, "level": p.level} for p in pool
    ]


def bench_prompts(args, cfg):
    """(tokenizer, prompts, template) of the run: the workspace's selected prompts (tiny mode) or the
    recipe's pool through its template and the model's chat template (``--model``)."""
    if args.model:
        return (*load_prompts(args.model_dir, None, cfg.data.template, recipe_pool(cfg)), cfg.data.template)
    from data_curation.synthetic import PROMPT_TEMPLATE

    return (*load_prompts(args.model_dir, args.prompts), PROMPT_TEMPLATE)


def bench_reward(cfg, verifier):
    """The reward both sides score with: the recipe's components (``--model``), else the verifier."""
    from rewards.compose import Reward

    return Reward.of(verifier, cfg.reward)


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
    from rewards.verifier import Verifier
    from training.rl import trainer as trainer_mod
    from training.rl.loop import rl_reward
    from training.rl.stage import objective_params, rl_start

    cfg = bench_config(args)
    _, prompts, _ = bench_prompts(args, cfg)
    params = objective_params(cfg.rl)
    sections = RLSections.of(cfg) if args.model else RLSections(cfg.rl, seed=args.seed, rollout=cfg.rollout)
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
    with (
        Verifier(timeout_s=cfg.eval.verifier_timeout_s) as verifier,
        tempfile.TemporaryDirectory(prefix="trl_peer-") as scratch,
    ):
        # LoRA on for rl (the recipe): a fresh adapter on the model, as the RL stage starts from
        model_dir = rl_start(Path(args.model_dir), sections.lora, Path(scratch), args.seed)
        reward = rl_reward(bench_reward(cfg, verifier), params) if args.model else verifier
        stamps = [time.perf_counter()]
        local.LocalDriver(model_dir, prompts, reward, params, sections, device="cpu", on_step=on_step).run()
    return {
        "step_s": [b - a for a, b in zip(stamps, stamps[1:])],
        "gen_s": [g for g, _ in gen_calls],
        "tokens": [n for _, n in gen_calls],
        "torch_threads": torch.get_num_threads(),
    }


def trl_dataset(args, prompts, template: str):
    """TRL's prompts: the project's prompt text (tiny: BOS + template, no special tokens added, which
    tokenizes to exactly the project's ids), or a chat message TRL puts through the chat template."""
    from datasets import Dataset

    if args.model:
        rows = [
            {
                "prompt": [{"role": "user", "content": template.replace("{problem}", p.text)}],
                "answer": p.answer,
                "problem": p.text,
            }
            for p in prompts
        ]
    else:
        bos = args.bos
        rows = [{"prompt": bos + template.replace("{problem}", p.text), "answer": p.answer} for p in prompts]
    return Dataset.from_list(rows)


def trl_reward(args, cfg, verifier):
    """TRL's reward function: the verifier's reward (tiny), or the recipe's composed reward over the
    same ``Sample``s the project scores (``--model``)."""
    if not args.model:
        return lambda prompts, completions, answer, **kw: [
            v.reward for v in verifier.verify_batch(list(completions), list(answer))
        ]
    from rewards.components import Sample

    composed = bench_reward(cfg, verifier)

    def reward(prompts, completions, answer, problem, completion_ids, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        samples = [
            Sample(t, a, len(ids), args.max_new_tokens, q)
            for t, a, ids, q in zip(texts, answer, completion_ids, problem)
        ]
        return list(composed.score(samples).total)

    return reward


def trl_config(args, cfg, out_dir: str):
    from trl import GRPOConfig

    return GRPOConfig(
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
        beta=cfg.rl.kl_coef or 0.0,  # the recipe's k3 KL to the reference, in the loss (none by default)
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        temperature=cfg.rl.temperature if args.model else 1.0,
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


def run_trl(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    from rewards.verifier import Verifier
    from training.lora import peft_config

    cfg = bench_config(args)
    tok, prompts, template = bench_prompts(args, cfg)
    args.bos = tok.bos_token or ""
    data = trl_dataset(args, prompts, template)
    known = {tuple(p.prompt_tokens) for p in prompts}
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model_dir), use_safetensors=True, dtype=torch.float32
    )
    lora = cfg.model.lora if cfg.model.lora.on("rl") else None
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
        if lora is not None:
            torch.manual_seed(args.seed)  # lora_A's initialisation, as the project seeds it
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=trl_reward(args, cfg, verifier),
            args=trl_config(args, cfg, tempfile.mkdtemp(prefix="trl_peer-")),
            train_dataset=data,
            processing_class=tok,
            callbacks=[Stamp()],
            peft_config=peft_config(lora) if lora is not None else None,
        )
        torch.set_num_threads(args.threads)  # after the Trainer set-up (accelerate may touch it)
        trainer.train()
    return {
        "step_s": [b - a for a, b in zip(stamps, stamps[1:])],
        "gen_s": [g for g, _ in gen_calls],
        "tokens": [n for _, n in gen_calls],
        "prompt_mismatches": mismatched[0],
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
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
        update_tokens_per_s=sum(toks) / (sum(step_s) - sum(gen_s)),
        mean_response_tokens=sum(toks) / len(toks) / (args.prompts_per_step * args.group_size),
        median_gen_s=statistics.median(gen_s),
        median_update_s=statistics.median(s - g for s, g in zip(step_s, gen_s)),
    )
    Path(args.result).write_text(json.dumps(res, indent=1))


# ------------------------------------------------------------------------------------------ driver


def loadavg() -> float:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except OSError:
        return float("nan")


def resolve_inputs(ap, args) -> None:
    """The checkpoint and prompts (``--workspace``, ``--model-dir``/``--prompts`` or ``--model``) and
    the sizes (``--model``: its recipe's unless given)."""
    if args.model:
        name, folder = args.model
        if name not in MODELS:
            ap.error(f"--model {name}: one of {', '.join(MODELS)}")
        args.model_dir = Path(folder)
        if not (args.model_dir / "model.safetensors").is_file():
            ap.error(f"--model {name} {folder}: no model.safetensors there (laminar model fetch {name})")
        from conf.loader import load_config

        rl = load_config([f"recipe={RECIPES[name]}"]).rl
        sizes = {"prompts_per_step": rl.prompts_per_step, "group_size": rl.group_size}
        sizes["max_new_tokens"] = rl.max_new_tokens
    else:
        if args.workspace is not None:
            args.model_dir, args.prompts = workspace_inputs(args.workspace)
        if args.model_dir is None or args.prompts is None:
            ap.error("give --workspace, --model-dir and --prompts, or --model NAME DIR")
        sizes = TINY_SIZES
    for k, v in sizes.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workspace",
        type=Path,
        help="a workspace with a finished default run (its RFT checkpoint and selected prompts)",
    )
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--prompts", type=Path)
    ap.add_argument(
        "--model",
        nargs=2,
        metavar=("NAME", "DIR"),
        help=f"a real model ({'|'.join(MODELS)}) and its safetensors folder: its recipe's task and sizes",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts-per-step", type=int, help="default: the recipe's (--model), else 16")
    ap.add_argument("--group-size", type=int, help="default: the recipe's (--model), else 8")
    ap.add_argument("--max-new-tokens", type=int, help="default: the recipe's (--model), else 64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trl_peer")
    ap.add_argument("--tag", default=time.strftime("%Y-%m-%d_%H%M"))
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    resolve_inputs(ap, args)
    if args.worker:
        return worker(args)

    runs: list[dict] = []
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants) :] + args.variants[: r % len(args.variants)]
        for v in order:
            res = run_worker(args, v)
            res["round"] = r
            runs.append(res)
            print(
                f"round {r} {v:18s} {res['median_step_s']:.3f} s/step | "
                f"step {res['step_tokens_per_s']:7.0f} tok/s | "
                f"gen {res['gen_tokens_per_s']:7.0f} tok/s | update {res['median_update_s']:.3f} s "
                f"{res['update_tokens_per_s']:6.0f} tok/s | "
                f"len {res['mean_response_tokens']:.1f} | "
                f"load {res['load_before']:.2f}->{res['load_after']:.2f}",
                flush=True,
            )
            write_results(args, runs, partial=True)  # a run cut short still leaves its numbers
    out = write_results(args, runs, partial=False)
    print(json.dumps({k: out[k] for k in ("summary", "ratios_vs_trl")}, indent=1))


def run_worker(args, variant: str) -> dict:
    """One (round, variant) process: its worker's result with the load around it."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    inputs = (
        ["--model", args.model[0], str(args.model_dir)]
        if args.model
        else ["--model-dir", str(args.model_dir), "--prompts", str(args.prompts)]
    )
    sizes = ("steps", "warmup", "threads", "prompts_per_step", "group_size", "max_new_tokens", "seed")
    cmd = [sys.executable, __file__, "--worker", variant, "--result", result, *inputs]
    for k in sizes:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
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
    res.update(load_before=load0, load_after=loadavg(), uptime_after=uptime())
    return res


SUMMARY_KEYS = (
    "median_step_s",
    "step_tokens_per_s",
    "gen_tokens_per_s",
    "update_tokens_per_s",
    "median_gen_s",
    "median_update_s",
    "mean_response_tokens",
)


def summarize(variants, runs: list[dict]) -> tuple[dict, dict]:
    """(per variant the median over rounds of each key, each variant's ratios to TRL)."""
    summary = {}
    for v in variants:
        mine = [x for x in runs if x["variant"] == v]
        if mine:
            summary[v] = {
                k: statistics.median(x[k] for x in mine) for k in SUMMARY_KEYS if all(k in x for x in mine)
            }
    ratios = {}
    if "trl" in summary:
        t = summary["trl"]
        for v in summary:
            if v != "trl":
                ratios[v] = {
                    k: summary[v][k] / t[k]
                    for k in ("step_tokens_per_s", "gen_tokens_per_s", "update_tokens_per_s")
                    if k in summary[v] and k in t
                }
                ratios[v]["seconds_per_step"] = t["median_step_s"] / summary[v]["median_step_s"]
    return summary, ratios


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return open("/proc/loadavg").read().strip()


def write_results(args, runs: list[dict], partial: bool) -> dict:
    summary, ratios = summarize(args.variants, runs)
    out = {
        "config": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("worker", "result")
        },
        "partial": partial,
        "machine": {"cpus": os.cpu_count(), "loadavg_end": open("/proc/loadavg").read().strip()},
        "uptime_end": uptime(),
        "summary": summary,
        "ratios_vs_trl": ratios,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"trl_peer_{args.tag}.json"
    path.write_text(json.dumps(out, indent=1))
    if not partial:
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
