"""``rl``: reinforcement learning from the RFT model on HIVE's selection (the Laminar runtime, or the
synchronous in-process driver), with in-run evaluations; every step's metrics are recorded."""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config
from tasks.records import Stage, StageContext, StageResult
from tasks.stages.common import (
    DATASET,
    MODEL,
    REWARD_MODEL,
    RFT_DATA,
    SELECTION,
    produce,
    drop_defaults,
    dumps,
    env_key,
    env_plugins,
    eval_name,
    file_benchmarks,
    insert_many,
    lora_key,
    numerics,
    record_checkpoint,
    record_history,
    reward_key,
    reward_targets,
    sandbox_key,
    select_config,
    template,
)
from tasks.stages.evaluate import eval_plugins, eval_templates, open_judges

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

    from core.artifacts import ArtifactRef

COLLAPSE = 0.5
"""RL reward collapsed: the last 5 steps' mean reward below this share of its best 5-step mean."""
RL_DROP = 0.02
"""RL ended below where it started: held-out accuracy after RL more than this under RFT's (about
1.5 standard errors of avg@4 on the 300 synthetic held-out problems)."""


def rl_key(c: Config) -> dict:
    from training.rl.mix import mix_key

    key = {
        **drop_defaults(c.rl, "loss", "loss_params"),
        "verifier_timeout_s": c.eval.verifier_timeout_s,
        **({"teacher": c.teacher.model_dump()} if rl_reads_teacher(c) else {}),  # OPD, ReLIFT (issue 54)
        "template": template(c),
        **numerics(c),
        **lora_key(c, "rl"),
        "select": select_config(c),
        **({"cluster": c.cluster.model_dump()} if c.rl.uses_ray() else {}),
        **({"trainer": c.trainer.model_dump()} if not c.trainer.is_default() else {}),
        "rollout": c.rollout.model_dump(),  # both drivers sample with the rollout engine
        **({"eval": c.eval.model_dump()} if c.rl.eval_every else {}),
        "reward": reward_key(c),
        **env_key(c),
        **sandbox_key(c),
        **mix_key(c.envs),  # several environments, weighted (absent when none)
    }
    if not c.rl.relift.enabled:  # ReLIFT off: the key as it was before rl.relift
        del key["relift"]
    return key


def teacher_files(cfg: Config, catalog=None) -> dict[str, str]:
    """The OPD teacher's folder (``teacher.path=DIR``); nothing for the self-teacher or without one."""
    from core.artifacts import hash_tree

    path = cfg.teacher.path
    if not rl_reads_teacher(cfg):
        return {}
    return {"teacher.path": hash_tree(Path(path).expanduser())} if path and path != "self" else {}


def rl_reads_teacher(cfg: Config) -> bool:
    """The RL stage reads ``teacher.path`` (OPD, or ReLIFT's teacher; DART's teacher is DART's)."""
    return any(not r.startswith("curation.") for r in cfg.teacher_readers())


def relift_reads_dart(cfg: Config) -> bool:
    """ReLIFT takes failed prompts' solutions from DART's data (``rl.relift.source``)."""
    r = cfg.rl.relift
    return r.enabled and r.source in ("dart", "dart_then_teacher")


def rl_plugins(cfg: Config) -> list[str]:
    """Every reward component that is a plug-in (the verdict among them), a custom loss, the
    environment, and the held-out set's evaluation plug-ins with in-run evaluation."""
    loss = [cfg.rl.loss] if cfg.rl.loss else []
    evals = eval_plugins(cfg) if cfg.rl.eval_every else []
    return [*reward_targets(cfg.reward.components), *loss, *env_plugins(cfg), *evals]


def rl_body(ctx: StageContext) -> StageResult:
    from evaluation.stages import in_run_evaluator
    from rewards.compose import Reward
    from rewards.verdicts import open_verdict
    from rewards.verifier import Verifier
    from generation.model import load_tokenizer
    from training.rl.sections import RLSections
    from training.rl.stage import TIMING_KEYS, rl
    from generation.setup import setup_torch
    from tasks.tracking import active

    setup_torch(ctx.cfg.threads, ctx.cfg.seed)
    meta: dict = {}
    data = Path(ctx.inputs[DATASET].path)
    rm_ref = ctx.inputs.get(REWARD_MODEL)
    if ctx.cfg.reward.uses_reward_model() and rm_ref is None:
        raise ValueError("reward.components names reward_model but no reward_model stage ran before rl")

    def run(out: Path) -> dict:
        with (
            open_verdict(ctx.cfg.reward, ctx.cfg.eval.verifier_timeout_s, ctx.cfg.sandbox) as verifier,
            ExitStack() as stack,
        ):
            evaluate = None
            if ctx.cfg.rl.eval_every > 0:
                tokenizer = load_tokenizer(ctx.inputs[MODEL].path)
                evaluate = in_run_evaluator(
                    tokenizer,
                    data if (data / "heldout.parquet").exists() else None,
                    ctx.cfg.eval,
                    templates=eval_templates(ctx.cfg),
                    seed=ctx.cfg.seed,
                    device=ctx.device,
                    verifier=verifier
                    if isinstance(verifier, Verifier)
                    else stack.enter_context(
                        Verifier(timeout_s=ctx.cfg.eval.verifier_timeout_s)  # vendored math benchmarks
                    ),
                    files=file_benchmarks(ctx.cfg),
                    env=ctx.cfg.env,
                    judges=open_judges(ctx.cfg, stack, verifier),
                    sandbox=ctx.cfg.sandbox,
                )
            sel = ctx.inputs[SELECTION]
            result = rl(
                Path(ctx.inputs[MODEL].path),
                sel.file("prompts.parquet"),
                RLSections.of(ctx.cfg),
                template=template(ctx.cfg),
                device=ctx.device,
                out_dir=out,
                reward=Reward.of(
                    verifier,
                    ctx.cfg.reward,
                    rm_ref.path if rm_ref else None,
                    template(ctx.cfg),
                    sandbox=ctx.cfg.sandbox,
                ),
                history_path=sel.file("history.parquet"),
                evaluate=evaluate,
                state_dir=ctx.state_dir,
                on_metrics=active().step_logger(ctx.stage or "rl"),
                dart_data=ctx.inputs[RFT_DATA].file("rft.parquet") if RFT_DATA in ctx.inputs else None,
            )
        rows = [m.as_dict() for m in result.history]
        meta["timings"] = [{k: m[k] for k in ("step", *TIMING_KEYS) if k in m} for m in rows]
        rewards = [m.reward for m in result.history]
        window = (
            [sum(rewards[i : i + 5]) / len(rewards[i : i + 5]) for i in range(max(1, len(rewards) - 4))]
            if rewards
            else []
        )
        return {
            "steps": len(result.history),
            "trajectories": sum(result.consumed.values()),
            "generated": int(sum(m.generated_trajectories for m in result.history)),
            "reward_last5": window[-1] if window else None,
            "reward_first5": window[0] if window else None,
            "reward_peak5": max(window) if window else None,
            "reward_first": rewards[0] if rewards else None,
            **_term_summary(rows),
        }

    ref, metrics = produce(ctx, MODEL, run, meta)
    return StageResult({MODEL: ref}, metrics)


def _term_summary(rows: list[dict]) -> dict[str, float]:
    """Each reward component's mean (``reward/<name>``) at the first step and over the last 5 steps,
    and its fallback count over the run (``reward_errors/<name>``)."""
    out: dict[str, float] = {}
    for key in sorted({k for m in rows for k in m if k.startswith("reward/")}):
        values = [m[key] for m in rows if key in m]
        out[f"{key}_first"], out[f"{key}_last5"] = values[0], sum(values[-5:]) / len(values[-5:])
    for key in sorted({k for m in rows for k in m if k.startswith("reward_errors/")}):
        out[key] = sum(m.get(key, 0.0) for m in rows)
    return out


def record_rl(con: Connection, ctx: StageContext, res: StageResult, key: str) -> None:
    ref = res.artifacts[MODEL]
    stage = ctx.stage or "rl"  # rl@2 in round 2 (tasks.rounds)
    record_checkpoint(con, ctx, res, key, stage, int(res.metrics.get("steps") or 0))
    values: dict[tuple[int, str], float] = {}  # (step, name) -> value; timings after the history
    with open(ref.file("history.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    timings = ctx.store.manifest(ref).get("meta", {}).get("timings", [])
    for m in steps + timings:
        values.update({(int(m["step"]), name): float(v) for name, v in m.items() if name != "step"})
    insert_many(
        con,
        "metrics",
        ("cache_key", "stage", "step", "name", "value"),
        [(key, stage, step, metric, v) for (step, metric), v in values.items()],
        "DO UPDATE SET value = excluded.value",
    )
    with open(ref.file("consumed.json")) as f:
        consumed = json.load(f)
    insert_many(
        con,
        "consumed_prompts",
        ("checkpoint_sha", "prompt_id", "n_trajectories"),
        [(ref.sha256, pid, n) for pid, n in consumed.items()],
    )
    record_history(con, ref, "rewards.parquet")
    record_reward(con, ref)


def record_reward(con: Connection, ref: ArtifactRef) -> None:
    """``reward_components`` (the reward the checkpoint trained under) and ``reward_terms`` (every
    response's score per component): the RL artifact's ``reward.json`` and ``reward_terms.parquet``."""
    with open(ref.file("reward.json")) as f:
        spec = json.load(f)
    rows = [
        (ref.sha256, i, c["name"], c["weight"], c["correctness"], dumps(c["params"]))
        for i, c in enumerate(spec)
    ]
    insert_many(
        con,
        "reward_components",
        ("checkpoint_sha", "position", "component", "weight", "correctness", "params_json"),
        rows,
    )
    con.execute(
        "INSERT INTO reward_terms SELECT ?, idx, step, prompt_id, sample_idx, component, value "
        "FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file("reward_terms.parquet"))],
    )


def rl_headline(m: dict) -> str:
    if not m.get("steps"):
        return ""
    return (
        f"reward {m['reward_first']:.3f} -> {m['reward_last5']:.3f} (last 5)  "
        f"{m.get('generated', 0):.0f} rollouts"
    )


def rl_warnings(by: Mapping[str, dict]) -> list[str]:
    """An RL reward that collapsed, and an RL model that ends below the model it started from on a
    benchmark (the evaluations of both)."""
    out: list[str] = []
    rl = by.get("rl", {})
    peak, last = rl.get("reward_peak5"), rl.get("reward_last5")
    if peak is not None and last is not None and peak > 0.1 and last < COLLAPSE * peak:
        out.append(
            f"RL reward collapsed: last 5 steps {last:.3f} against a best of {peak:.3f} "
            "(lower rl.lr, or check the objective's clip and KL settings)"
        )
    before, after = by.get(eval_name(STAGE.inputs[MODEL][0]), {}), by.get(eval_name("rl"), {})
    for bench in sorted(set(before) & set(after)):
        b, a = before[bench], after[bench]
        if (
            isinstance(b, dict)
            and isinstance(a, dict)
            and None not in (b.get("accuracy"), a.get("accuracy"))
            and a["accuracy"] < b["accuracy"] - RL_DROP
        ):
            out.append(
                f"RL ended below where it started on {bench}: {a['accuracy']:.3f} after RL against "
                f"{b['accuracy']:.3f} after RFT"
            )
    return out


STAGE = Stage(
    name="rl",
    inputs={
        MODEL: ("rft", MODEL),
        SELECTION: ("select", SELECTION),
        DATASET: ("data", DATASET),
        REWARD_MODEL: ("reward_model", MODEL),
        RFT_DATA: ("dart", RFT_DATA),  # ReLIFT's solutions (read only with rl.relift.source=dart...)
    },
    reads={RFT_DATA: relift_reads_dart},
    config=rl_key,
    body=rl_body,
    record=record_rl,
    headline=rl_headline,
    plugins=rl_plugins,
    external=teacher_files,
    policy=True,
    title="RL",
    step_metrics=True,
    warnings=rl_warnings,
)
