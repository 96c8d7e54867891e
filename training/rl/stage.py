"""The RL stage: from the RFT checkpoint on the selected prompts, with the configured objective.

Writes the final checkpoint, the per-step history (``history.jsonl``, without wall-clock timings so
that identical weights hash identically), the prompts trained on (``consumed.json``) and every
rolled-out group's mean reward (``rewards.parquet``: the reward history HIVE selects from next).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from pathlib import Path

from collections.abc import Callable

from tqdm.auto import tqdm

from conf.schema import LoraConfig, RLConfig, SelectConfig
from generation.adapter import is_adapter_dir
from generation.model import encode_problem, load_tokenizer
from training.objectives import PRESETS, ObjectiveParams
from rewards.compose import Reward
from training.rl.loop import RLResult, group_scorer, rl_reward
from training.rl.mix import rl_sources
from training.rl.records import StepMetrics
from training.rl.sections import RLSections
from training.rl.relift import build_relift
from training.rl.teacher import with_teacher
from generation.records import PromptItem
from generation.setup import read_table

LOG = logging.getLogger("laminar.training")
TIMING_KEYS = (
    "gen_seconds",
    "train_seconds",
    "gen_tokens_per_s",
    "eval_seconds",
    "tokens_per_s",
    "occupancy",
    "publish_stall_s",
    "publish_cpu_s",
    "wall_seconds",
    "repacks",
)


OVERRIDABLE = (
    "advantage",
    "loss_agg",
    "behaviour_weight",
    "is_cap",
    "clip_low",
    "clip_high",
    "dual_clip",
    "dynamic_sampling",
    "max_sampling_rounds",
    "overlong_shaping",
    "overlong_filter",
    "kl_coef",
    "kl_in_reward",
    "ratio_level",
    "gamma",
    "gae_lambda",
    "value_lambda",
    "lambda_alpha",
    "value_coef",
    "value_clip",
    "value_warmup_steps",
    "nll_coef",
    "entropy_coef",
    "entropy_target",
    "ref_reset_every",
)


def objective_params(cfg: RLConfig) -> ObjectiveParams:
    """The algorithm's preset with the config's explicit overrides (None keeps the preset)."""
    overrides = {k: getattr(cfg, k) for k in OVERRIDABLE if getattr(cfg, k) is not None}
    if cfg.loss is not None:  # a custom loss by import path (training.objectives.custom_loss)
        overrides.update(loss=cfg.loss, loss_params=tuple(sorted((cfg.loss_params or {}).items())))
    return dataclasses.replace(PRESETS[cfg.algorithm], overlong_cache_len=cfg.overlong_cache_len, **overrides)


def hive_source(select: SelectConfig | None, history_path: Path | None, seed: int):
    """The RL loop's prompt source for ``curation.select`` (None: off): None (uniform: the seeded
    cursor) or a factory of HIVE's online source, its GRESO history seeded from ``history_path``."""
    if (
        select is None
        or select.strategy != "hive"
        or (not select.online_greso and select.online_entropy == "off")
    ):
        return None
    from data_curation.hive import GresoFilter
    from training.rl.loop import HiveSource

    history = None
    if select.online_greso and history_path is not None and Path(history_path).exists():
        import polars as pl

        history = pl.read_parquet(history_path)
    greso = (
        GresoFilter(
            history, easy_threshold=select.greso_easy_threshold, hard_threshold=select.greso_hard_threshold
        )
        if select.online_greso
        else None
    )
    return lambda cursor, engine: HiveSource(
        cursor,
        engine,
        greso=greso,
        entropy_rule=select.online_entropy,
        seed=seed,
        round_headroom=select.round_headroom,
        min_round=select.min_round,
    )


def rl(
    model_dir: Path,
    prompts_path: Path,
    run: RLSections,
    *,
    template: str,
    device: str,
    out_dir: Path,
    reward,
    history_path: Path | None = None,
    evaluate: Callable[[object], dict[str, float]] | None = None,
    state_dir: Path | None = None,
    on_metrics: Callable[[dict[str, float]], None] | None = None,
    dart_data: Path | None = None,
) -> RLResult:
    """RL from ``model_dir`` on the prompts of ``prompts_path`` with the config sections ``run``
    (``RLSections``; see the module docstring for what it writes). ``run.select`` turns on HIVE's
    online pruning (its GRESO history from ``history_path``); ``evaluate`` runs every
    ``run.rl.eval_every`` steps. Either loop checkpoints into ``state_dir`` every
    ``run.rl.checkpoint_every`` steps and resumes from it after a crash. ``run.rl.uses_ray()`` picks the
    driver: the Ray driver runs the roles on Ray (``run.cluster``) and also writes
    ``timeline.json``/``.png`` and ``runtime.json`` (throughput, staleness histogram, repacks, failures);
    else the local driver runs in this process. ``on_metrics``: called with every step's metrics
    (``StepMetrics.as_dict``) as the step ends (an experiment tracker's logger; with Ray on the driver,
    with what the actors report). ``run.lora`` on for rl: only adapters train (continuing the adapter
    ``model_dir`` holds, or a fresh one on it), only adapters are published, and ``out_dir`` becomes a
    PEFT adapter folder. ``reward``: the ``rewards.compose.Reward`` every response is scored with (a
    bare verifier: the math verifier alone); DAPO's preset adds its overlong component
    (``training.rl.loop.rl_reward``). ``run.env``, ``run.envs``, ``run.sandbox``: the episodes'
    environments and their tools' sandbox. ``dart_data``: DART's data, for ReLIFT (``rl_objective``)."""
    cfg = run.rl
    with tempfile.TemporaryDirectory(prefix="laminar-rl-start-") as scratch:
        model_dir = rl_start(Path(model_dir), run.lora, Path(scratch), run.seed)
        tokenizer = load_tokenizer(model_dir)
        prompts = rl_prompts(Path(prompts_path), tokenizer, template, cfg.steps)
        params, reward, hooks = rl_objective(run, model_dir, tokenizer, template, reward, dart_data)
        with tqdm(
            total=cfg.steps, desc=f"rl {cfg.algorithm}/{cfg.mode}", unit="step", leave=False, disable=None
        ) as bar:
            run, source = with_sources(run, history_path, tokenizer, template)
            driver = make_driver(
                model_dir,
                prompts,
                reward,
                params,
                run,
                device=device,
                state_dir=state_dir,
                source=source,
                on_step=_progress(bar, cfg.steps, on_metrics),
                evaluate=evaluate,
                **hooks,
            )
            result = driver.run()
            if cfg.uses_ray():
                write_runtime_report(driver, Path(out_dir))
        save_rl_model(driver, model_dir, tokenizer, Path(out_dir))
        write_rl_records(result, Path(out_dir), reward)
        return result


def rl_objective(run: RLSections, model_dir: Path, tokenizer, template: str, reward, dart_data: Path | None):
    """``(params, reward, hooks)``: the objective (OPD's teacher with ``rl.algorithm=opd``), the reward
    it scores with, and the drivers' extra hooks: ``relift`` (``training.rl.relift.Relift``) when
    ``run.rl.relift`` is on, its solutions from the teacher (``run.teacher.path``, which then only
    samples) or from DART's data ``dart_data`` (``rft.parquet``)."""
    cfg = run.rl
    opd_teacher = run.teacher if cfg.algorithm == "opd" else None
    params = with_teacher(objective_params(cfg), opd_teacher, model_dir, template)  # OPD
    reward = rl_reward(reward, params)
    score = group_scorer(reward, params, cfg.max_new_tokens)
    relift = build_relift(
        run, model_dir=model_dir, tokenizer=tokenizer, template=template, score=score, dart_data=dart_data
    )
    return params, reward, ({"relift": relift} if relift is not None else {})


def with_sources(run: RLSections, history_path: Path | None, tokenizer, template: str):
    """``(run, source)``: ``run`` with the env its episodes run (the weighted mix of ``run.envs``, or
    ``run.env``) and the drivers' prompt source (HIVE's, the mix's, or None: the cursor)."""
    s = rl_sources(run.select, history_path, run.seed, run.env, run.envs, tokenizer, template)
    return dataclasses.replace(run, env=s["env"]), s["source"]


def rl_prompts(prompts_path: Path, tokenizer, template: str, steps: int) -> list[PromptItem]:
    """The prompts of ``prompts_path`` encoded with ``template``; none to train ``steps`` > 0 on fails."""
    rows = read_table(prompts_path)
    if not rows and steps > 0:
        raise ValueError(
            f"RL has no prompts to train on ({prompts_path} is empty): check the curation counts "
            "(quarantined, contaminated, selected) in the run table"
        )
    return [
        PromptItem(
            prompt_id=r["prompt_id"],
            text=r["problem"],
            answer=r["answer"],
            prompt_tokens=encode_problem(tokenizer, template, r["problem"]),
            level=r.get("level"),
        )
        for r in rows
    ]


def _progress(bar, steps: int, on_metrics: Callable[[dict[str, float]], None] | None):
    """The drivers' ``on_step``: one progress bar tick and log line, then ``on_metrics``."""

    def on_step(m: StepMetrics) -> None:
        line = m.line(steps)
        bar.update(1)
        bar.write(line)
        LOG.info(line)
        if on_metrics is not None:
            on_metrics(m.as_dict())

    return on_step


def make_driver(model_dir: Path, prompts, reward, params: ObjectiveParams, run: RLSections, **hooks):
    """The driver ``run.rl.uses_ray()`` picks (``LaminarRuntime`` or ``LocalDriver``); ``hooks``: its
    keyword arguments besides the config (device, state_dir, source, on_step, evaluate)."""
    if run.rl.uses_ray():
        from training.rl.drivers.ray import LaminarRuntime

        return LaminarRuntime(Path(model_dir), prompts, reward, params, run, **hooks)
    from training.rl.drivers.local import LocalDriver

    return LocalDriver(Path(model_dir), prompts, reward, params, run, **hooks)


def save_rl_model(driver, model_dir: Path, tokenizer, out_dir: Path) -> None:
    """The trained policy into ``out_dir``: the adapter for a LoRA run on Ray (not the merged model),
    else the driver's final model."""
    from training.lora import adapter_from_state, save_trained

    if driver.rl.uses_ray() and is_adapter_dir(model_dir):
        adapter_from_state(model_dir, driver.final_state, out_dir)
    else:
        save_trained(driver.final_model.to("cpu"), tokenizer, out_dir)


def rl_start(model_dir: Path, lora: LoraConfig | None, scratch: Path, seed: int) -> Path:
    """The folder RL's roles start from: an adapter folder exactly when ``lora`` is on for rl (a fresh
    adapter on a full model, written to ``scratch``), else a full model (an adapter merged into
    ``scratch``)."""
    from training.lora import fresh_adapter, full_model

    on = lora is not None and lora.on("rl")
    if on and not is_adapter_dir(model_dir):
        return fresh_adapter(model_dir, lora, scratch / "adapter", seed=seed)
    if not on and is_adapter_dir(model_dir):
        return full_model(model_dir, scratch / "merged")
    return model_dir


def write_rl_records(result: RLResult, out_dir: Path, reward: Reward) -> None:
    """The run's records beside its model: ``history.jsonl`` (no timings), ``consumed.json``,
    ``rewards.parquet``, ``reward.json`` (the reward's components: ``Reward.spec``) and
    ``reward_terms.parquet`` (every response's score per reward component)."""
    import polars as pl

    with open(out_dir / "reward.json", "w") as f:
        json.dump(reward.spec(), f, indent=1, sort_keys=True)

    with open(out_dir / "history.jsonl", "w") as f:
        for m in result.history:
            row = {k: v for k, v in m.as_dict().items() if k not in TIMING_KEYS}
            f.write(json.dumps(row, sort_keys=True) + "\n")
    with open(out_dir / "consumed.json", "w") as f:
        json.dump(dict(sorted(result.consumed.items())), f, indent=1)
    pl.DataFrame(
        result.rewards,
        schema={"step": pl.Int64, "prompt_id": pl.Utf8, "mean_reward": pl.Float64, "n": pl.Int64},
        orient="row",
    ).with_columns(idx=pl.int_range(pl.len(), dtype=pl.Int64), origin=pl.lit("rl")).select(
        "step", "idx", "prompt_id", "mean_reward", "n", "origin"
    ).write_parquet(out_dir / "rewards.parquet")
    pl.DataFrame(
        result.terms,
        schema={
            "step": pl.Int64,
            "prompt_id": pl.Utf8,
            "sample_idx": pl.Int64,
            "component": pl.Utf8,
            "value": pl.Float64,
        },
        orient="row",
    ).with_columns(idx=pl.int_range(pl.len(), dtype=pl.Int64)).write_parquet(out_dir / "reward_terms.parquet")


def write_runtime_report(runtime, out_dir: Path) -> None:
    """The Laminar runtime's timeline (JSON and PNG) and its run summary (``runtime.json``)."""
    from evaluation.timeline import plot_timeline, summarize_timeline

    with open(out_dir / "timeline.json", "w") as f:
        json.dump(runtime.timeline, f)
    summary = {**runtime.summary, "timeline": summarize_timeline(runtime.timeline)}
    with open(out_dir / "runtime.json", "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True, default=str)
    plot_timeline(runtime.timeline, out_dir / "timeline.png", title=f"rl.mode={runtime.mode.name}")
