"""The DAG: the stage table (``STAGES``, in DAG order) and the operations on the graph.

Each ``Stage`` declaration says what the stage reads (its upstream stages' outputs), which config and
which library code enter its cache key, the body that makes its artifacts (``tasks.bodies``), the
catalog rows it records (``tasks.recording``) and its one-line headline. Every stage selection
(``laminar rerun STAGE``, ``laminar run --until STAGE``) is computed from the declared inputs, never
from a list of names, and every stage's inputs are resolved by ``stage_inputs``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from conf.schema import Config, SandboxConfig
from core.artifacts import ArtifactRef
from core.catalog import Catalog, dumps
from core.workspace import Workspace
from tasks import recording
from tasks.bodies import (
    ATTEMPTS,
    COMPARISONS,
    DATASET,
    MODEL,
    PROMPTS,
    REWARD_MODEL,
    RFT_DATA,
    SELECTION,
    base_model_body,
    dart_body,
    data_body,
    decontam_benchmarks,
    decontaminate_body,
    difficulty_body,
    difficulty_rft_body,
    eval_body,
    history_prompts,
    ingest_body,
    preferences_body,
    reward_model_body,
    rft_body,
    rl_body,
    select_body,
    template,
    verifiability,
    warmup_body,
)
from tasks.cache import CacheKey
from tasks.records import Stage

# ---- what enters each stage's cache key ------------------------------------------------------------


def _numerics(c: Config) -> dict:
    """What a stage that trains or samples with torch adds to its key: the thread count it computes
    with (``threads=0`` resolved to torch's default), since float results depend on it."""
    from generation.setup import resolve_threads

    return {"torch_threads": resolve_threads(c.threads)}


def _lora_key(c: Config, stage: str) -> dict:
    """What ``model.lora`` adds to a training stage's key: nothing when the stage trains every weight
    (the keys of runs without LoRA stay as they were), else the adapter's settings."""
    lo = c.model.lora
    if not lo.on(stage):
        return {}
    return {"lora": {k: v for k, v in asdict(lo).items() if k not in ("enabled", "stages")}}


def _select_config(c: Config) -> dict:
    """``curation.select`` as select and RL see it: ``history_prompts`` reaches them through the
    history's content (difficulty_rft's artifact), so it is not part of their keys."""
    return {k: v for k, v in asdict(c.curation.select).items() if k != "history_prompts"}


def _drop_defaults(section, *names: str) -> dict:
    """``asdict(section)`` without the named fields while they hold their defaults: fields added after
    a section's keys were first written leave those keys unchanged until they are set."""
    out = asdict(section)
    defaults = {
        f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(section)
    }
    for name in names:
        if out[name] == defaults[name]:
            del out[name]
    return out


def data_key(c: Config) -> dict:
    """``data`` as it is; ``demo_full_stop_rate`` and ``template`` only when set (the default keys stay
    as they were); never ``allow_empty`` (it changes no byte of the dataset: ingest reads it)."""
    out = _drop_defaults(c.data, "demo_full_stop_rate", "template")
    del out["allow_empty"]
    return out


def ingest_key(c: Config) -> dict:
    """``allow_empty`` only when set: an empty pool kept by one run is no cache hit for another."""
    return {
        **asdict(c.curation.dedup),
        "max_prompt_chars": c.data.max_prompt_chars,
        "verifiability": verifiability(c),
        "templates": asdict(c.curation.templates),
        **({"allow_empty": True} if c.data.allow_empty else {}),
    }


def decontaminate_key(c: Config) -> dict:
    return {**asdict(c.curation.decontam), "benchmarks": decontam_benchmarks(c)}


def base_model_key(c: Config) -> dict:
    """The model fields less ``lora`` (adapters never change the base)."""
    return {k: v for k, v in asdict(c.model).items() if k != "lora"}


def warmup_key(c: Config) -> dict:
    return {
        **asdict(c.sft),
        "template": template(c),
        **_numerics(c),
        **_lora_key(c, "warmup"),
        **_env_key(c),
        **_sandbox_key(c),
    }


def eval_key(c: Config) -> dict:
    own = {"template": c.data.template} if c.data.template is not None else {}
    return {
        **asdict(c.eval),
        **_numerics(c),
        **_env_key(c),
        **_reward_model_key(c),
        **_sandbox_key(c),
        **_verdict_key(c),
        **own,
    }


def _verdict_key(c: Config) -> dict:
    """The run's verdict, for stages that judge with it (difficulty, DART, the pool's held-out set);
    absent while it is the built-in ``math_verify`` (the keys from before verdicts unchanged). A
    plug-in's source enters through ``Stage.plugins``."""
    v = c.reward.verdict()
    if v.is_builtin() and v.name == "math_verify":
        return {}
    verdict = {"name": v.name, "target": v.target, "params": v.given(), "threshold": v.threshold}
    return {"verdict": verdict, **_sandbox_key(c)}


def _reward_model_key(c: Config) -> dict:
    """The reward model's scoring settings, for stages that score with it; absent without one."""
    spec = [s for s in reward_key(c) if s["name"] == "reward_model"]
    return {"reward_model": spec[0]["params"]} if spec else {}


def _env_key(c: Config) -> dict:
    """The environment, for stages that sample episodes; absent for single-turn (keys unchanged), and
    its tool latency absent while off and its version rule while ``turn`` (keys of environments from
    before them unchanged)."""
    if c.env.is_default():
        return {}
    env = _drop_defaults(c.env, "version_rule")
    if c.env.tool_latency.is_off():
        del env["tool_latency"]
    return {"env": env}


def _sandbox_key(c: Config) -> dict:
    """The sandbox settings, for the stages where code may run (code tests, tools, code benchmarks);
    absent at their defaults (keys from before them unchanged)."""
    return {} if c.sandbox == SandboxConfig() else {"sandbox": asdict(c.sandbox)}


def _difficulty_key(c: Config, max_prompts: int) -> dict:
    return {
        **asdict(c.curation.difficulty),
        "max_prompts": max_prompts,
        "template": template(c),
        "verifier_timeout_s": c.eval.verifier_timeout_s,
        **_numerics(c),
        **_verdict_key(c),
    }


def difficulty_key(c: Config) -> dict:
    return _difficulty_key(c, c.curation.difficulty.max_prompts)


def difficulty_rft_key(c: Config) -> dict:
    return _difficulty_key(c, history_prompts(c))


def dart_key(c: Config) -> dict:
    """``select`` only when the reward model ranks (the key of verifier selection is as it was), then
    with the reward model's scoring settings."""
    dart = asdict(c.curation.dart)
    if not dart_ranks(c):
        del dart["select"]
    return {
        **dart,
        "max_new_tokens": c.curation.difficulty.max_new_tokens,
        "template": template(c),
        "verifier_timeout_s": c.eval.verifier_timeout_s,
        **_numerics(c),
        **(_reward_model_key(c) if dart_ranks(c) else {}),
        **_verdict_key(c),
    }


def dart_ranks(c: Config) -> bool:
    """Whether DART keeps the reward model's top-ranked responses (``curation.dart.select``)."""
    return c.curation.dart.select == "reward_model"


def rft_key(c: Config) -> dict:
    return {**asdict(c.curation.rft), "template": template(c), **_numerics(c), **_lora_key(c, "rft")}


def preferences_key(c: Config) -> dict:
    keys = ("prompts", "samples", "temperature", "max_new_tokens", "annotators", "flip", "rubric")
    return {
        **{k: getattr(c.reward_model, k) for k in keys},
        "template": template(c),
        "decontam": asdict(c.curation.decontam),
        "benchmarks": decontam_benchmarks(c),
        **_numerics(c),
    }


def reward_model_key(c: Config) -> dict:
    keys = ("backbone", "path", "steps", "batch_size", "lr", "heldout_share", "max_len")
    return {**{k: getattr(c.reward_model, k) for k in keys}, **_numerics(c)}


def uses_reward_model(c: Config) -> bool:
    return c.reward.uses_reward_model()


def select_key(c: Config) -> dict:
    return {**_select_config(c), "min_prompts": c.rl.prompts_per_step}


def rl_key(c: Config) -> dict:
    return {
        **_drop_defaults(c.rl, "loss", "loss_params"),
        "verifier_timeout_s": c.eval.verifier_timeout_s,
        **({"teacher": asdict(c.teacher)} if c.teacher.path else {}),  # OPD (issue 54)
        "template": template(c),
        **_numerics(c),
        **_lora_key(c, "rl"),
        "select": _select_config(c),
        **({"cluster": asdict(c.cluster)} if c.rl.uses_ray() else {}),
        **({"trainer": asdict(c.trainer)} if not c.trainer.is_default() else {}),
        "rollout": asdict(c.rollout),  # both drivers sample with the rollout engine
        **({"eval": asdict(c.eval)} if c.rl.eval_every else {}),
        "reward": reward_key(c),
        **_env_key(c),
        **_sandbox_key(c),
    }


def reward_key(c: Config) -> list[dict]:
    """The reward RL trains on (``rewards.compose.Reward.spec``: each component's name, weight,
    whether it is the correctness verdict and its resolved parameters), with the overlong component
    the objective's preset adds (``rl.algorithm=dapo``): what ``laminar lineage`` prints."""
    from rewards.compose import Reward
    from training.rl.loop import rl_reward
    from training.rl.stage import objective_params

    return rl_reward(Reward.of(None, c.reward), objective_params(c.rl)).spec()


# ---- inputs from outside the store (``Stage.external``) ---------------------------------------------


def model_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    from core.artifacts import hash_tree

    return {"model.path": hash_tree(Path(cfg.model.path).expanduser())} if cfg.model.kind == "hf" else {}


def teacher_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    """The OPD teacher's folder (``teacher.path=DIR``); nothing for the self-teacher or without one."""
    from core.artifacts import hash_tree

    path = cfg.teacher.path
    return {"teacher.path": hash_tree(Path(path).expanduser())} if path and path != "self" else {}


def reward_model_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    """The folders ``reward_model.path`` and a ``reward_model.backbone`` other than the warm-up model."""
    from core.artifacts import hash_tree

    c, out = cfg.reward_model, {}
    if c.path is not None:
        out["reward_model.path"] = hash_tree(Path(c.path).expanduser())
    if c.backbone != "warmup":
        out["reward_model.backbone"] = hash_tree(Path(c.backbone).expanduser())
    return out


def _benchmark_hashes(cfg: Config, names: Iterable[str]) -> dict[str, str]:
    """``benchmark:<name>`` -> sha256 of the vendored file, or of a file benchmark's file or folder."""
    from core.artifacts import hash_file
    from data_curation.sources import source_hashes
    from evaluation.benchmarks import benchmark_path
    from evaluation.stages import HELDOUT

    files = cfg.eval.benchmark_files()
    own = {k.removeprefix("source:"): v for k, v in source_hashes(files.values()).items()}
    return {
        f"benchmark:{b}": own[b] if b in files else hash_file(benchmark_path(b))
        for b in names
        if b != HELDOUT
    }


def benchmark_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    return _benchmark_hashes(cfg, cfg.eval.benchmark_names())


def decontam_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    return _benchmark_hashes(cfg, decontam_benchmarks(cfg))


def source_files(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    from data_curation.sources import source_hashes

    return source_hashes(cfg.data.sources)


def history_fingerprint(cfg: Config, catalog: Catalog | None = None) -> dict[str, str]:
    """With ``curation.select.history=workspace`` the selection depends on every RL reward recorded
    in the catalog: its fingerprint enters the key, so new history reruns ``select``."""
    if cfg.curation.select.history != "workspace" or catalog is None:
        return {}
    rows = catalog.query(
        "SELECT source_sha, count(*) AS n FROM reward_history WHERE origin = 'rl' "
        "GROUP BY source_sha ORDER BY source_sha"
    )
    return {"history:workspace": hashlib.sha256(dumps(rows).encode()).hexdigest()}


# ---- plug-ins by import path (``Stage.plugins``) -------------------------------------------------------


def _reward_targets(specs) -> list[str]:
    from rewards.registry import is_plugin, target_of

    return [target_of(s) for s in specs if is_plugin(s)]


def verdict_plugins(cfg: Config) -> list[str]:
    """The run's verdict, when it is a plug-in (difficulty and DART judge with it)."""
    return _reward_targets([cfg.reward.verdict()])


def env_plugins(cfg: Config) -> list[str]:
    """The environment, when ``env.target`` names one by import path (stages that sample episodes)."""
    from core.plugins import is_target

    target = getattr(cfg.env, "target", None)
    return [target] if target and is_target(target) and not cfg.env.is_default() else []


def rl_plugins(cfg: Config) -> list[str]:
    """Every reward component that is a plug-in (the verdict among them), a custom loss, the
    environment, and the held-out set's evaluation plug-ins with in-run evaluation."""
    loss = [cfg.rl.loss] if cfg.rl.loss else []
    evals = eval_plugins(cfg) if cfg.rl.eval_every else []
    return [*_reward_targets(cfg.reward.components), *loss, *env_plugins(cfg), *evals]


def eval_plugins(cfg: Config) -> list[str]:
    """The verdicts and ``score_with`` components of the benchmarks (the run's verdict judges the
    pool's held-out set), and the environment."""
    from conf.schema import RewardComponentConfig
    from evaluation.stages import HELDOUT

    specs = [cfg.reward.verdict()] if HELDOUT in cfg.eval.benchmark_names() else []
    for b in cfg.eval.benchmark_files().values():
        specs += [RewardComponentConfig(name=n) for n in (b.verdict_name(), *b.score_with)]
    return [*_reward_targets(specs), *env_plugins(cfg)]


# ---- headlines (``Stage.headline``) -------------------------------------------------------------------


def data_headline(m: dict) -> str:
    pool = (
        f"pool {int(m['pool_prompts'])}  heldout {int(m['heldout_prompts'])}  " if "pool_prompts" in m else ""
    )
    return pool + f"sources {int(m['sources'])}"


def ingest_headline(m: dict) -> str:
    return (
        f"rows {m['rows_in']:.0f}  ingested {m['ingested']:.0f}  quarantined {m['quarantined']:.0f}  "
        f"duplicates {m['duplicates_exact']:.0f}+{m['duplicates_near']:.0f} near" + unverifiable_detail(m)
    )


def unverifiable_detail(m: dict) -> str:
    """`` (unverifiable answers 12: proof 3, multi part 9)`` from ingest's counts; "" for none."""
    if not m.get("unverifiable"):
        return ""
    kinds = ", ".join(
        f"{k.removeprefix('unverifiable_').replace('_', ' ')} {v:.0f}"
        for k, v in m.items()
        if k.startswith("unverifiable_")
    )
    return f" (unverifiable answers {m['unverifiable']:.0f}: {kinds})"


def decontaminate_headline(m: dict) -> str:
    detail = (
        f" ({m['contaminated_ngram']:.0f} n-gram, {m['contaminated_paraphrase']:.0f} paraphrase)"
        if "contaminated_paraphrase" in m
        else ""
    )
    return f"clean {m['clean']:.0f}  contaminated {m['contaminated']:.0f}" + detail


def base_model_headline(m: dict) -> str:
    return f"params {int(m['parameters']):,}"


def warmup_headline(m: dict) -> str:
    return f"loss {m['sft_loss_first']:.3f} -> {m['sft_loss_ema']:.3f}"


def eval_headline(m: dict) -> str:
    from evaluation.report import coverage_note

    return "  ".join(
        f"{b} acc {v['accuracy']:.3f}{coverage_note(v, short=True)}"
        + "".join(f" {k} {v[k]:.3f}" for k in v if k.startswith("rm_best@"))
        + (f" ({v['certificate']})" if v.get("certificate", "clean") != "clean" else "")
        for b, v in m.items()
        if isinstance(v, dict)
    )


def difficulty_headline(m: dict) -> str:
    return (
        f"prompts {m['prompts_sampled']:.0f}  pass {m['mean_pass_rate']:.3f}  edge {m['learning_edge']:.0f}  "
        f"all-correct {m['all_correct']:.0f}  all-wrong {m['all_wrong']:.0f}"
    )


def dart_headline(m: dict) -> str:
    rejected = (
        f"  ({m['rejected_arithmetic']:.0f} right answers with a false step turned down)"
        if m.get("rejected_arithmetic")
        else ""
    )
    if "rm_kept_verified" in m:  # curation.dart.select=reward_model
        return (
            f"{m.get('trials', 0):.0f} trials  {m['rft_examples']:.0f} responses ranked top by the reward "
            f"model ({m['rm_kept_verified']:.0%} of them verified)"
        )
    return f"{m.get('trials', 0):.0f} trials  {m['rft_examples']:.0f} correct responses" + rejected


def rft_headline(m: dict) -> str:
    loss = (
        f"  loss {m['rft_loss_first']:.3f} -> {m['rft_loss_ema']:.3f}"
        if m.get("rft_steps")
        else "  (passed through)"
    )
    return f"{m['rft_examples']:.0f} examples" + loss


def preferences_headline(m: dict) -> str:
    agree = f"  agreement {m['agreement']:.3f}" if "agreement" in m else ""
    return (
        f"comparisons {m['comparisons']:.0f}  quarantined {m['quarantined']:.0f}  "
        f"duplicates {m['duplicates']:.0f}  rubric share {m['rubric_share']:.2f}" + agree
    )


def reward_model_headline(m: dict) -> str:
    base = (
        f"longer {m['baseline_longer_wins_accuracy']:.3f}, "
        f"shorter {m['baseline_shorter_wins_accuracy']:.3f}, "
        f"policy log-prob {m['baseline_policy_logprob_accuracy']:.3f}"
    )
    ceiling = f", ceiling {m['agreement_ceiling']:.3f}" if "agreement_ceiling" in m else ""
    return f"held-out accuracy {m['rm_heldout_accuracy']:.3f}  ({base}{ceiling})"


def select_headline(m: dict) -> str:
    return f"selected {m['selected']:.0f} of {m['candidates']:.0f}"


def rl_headline(m: dict) -> str:
    if not m.get("steps"):
        return ""
    return (
        f"reward {m['reward_first']:.3f} -> {m['reward_last5']:.3f} (last 5)  "
        f"{m.get('generated', 0):.0f} rollouts"
    )


# ---- the table ------------------------------------------------------------------------------------------

_EVAL_MODULES = ("evaluation.stages", "data_curation.synthetic", "generation.setup", "tasks.certificate")
_SAMPLING_MODULES = (
    "data_curation.sampling",
    "generation.setup",
    "rewards.verifier",
    "data_curation.synthetic",
    "evaluation.benchmarks",
)
_TRAINING_MODULES = ("generation.setup", "training.lora", "generation.adapter")


def _eval_stage(name: str, model_stage: str) -> Stage:
    """Held-out and benchmark accuracy of ``model_stage``'s model."""
    return Stage(
        name=name,
        inputs={
            MODEL: (model_stage, MODEL),
            DATASET: ("data", DATASET),
            REWARD_MODEL: ("reward_model", MODEL),
        },
        config=eval_key,
        modules=_EVAL_MODULES,
        body=eval_body,
        record=recording.record_eval,
        headline=eval_headline,
        external=benchmark_files,
        plugins=eval_plugins,
    )


STAGES: tuple[Stage, ...] = (
    Stage(
        name="data",
        inputs={},
        config=data_key,
        modules=("data_curation.synthetic", "data_curation.sources"),
        body=data_body,
        record=recording.record_data,
        headline=data_headline,
        external=source_files,
    ),
    Stage(
        name="ingest",
        inputs={DATASET: ("data", DATASET)},
        config=ingest_key,
        modules=(
            "data_curation.ingest",
            "data_curation.sources",
            "data_curation.dedup",
            "data_curation.templates",
            "data_curation.verifiability",
        ),
        body=ingest_body,
        record=recording.record_ingest,
        headline=ingest_headline,
    ),
    Stage(
        name="decontaminate",
        inputs={PROMPTS: ("ingest", PROMPTS), DATASET: ("data", DATASET)},
        config=decontaminate_key,
        modules=("data_curation.decontaminate", "evaluation.stages"),
        body=decontaminate_body,
        record=recording.record_decontaminate,
        headline=decontaminate_headline,
        external=decontam_files,
    ),
    Stage(
        name="base_model",
        inputs={},
        config=base_model_key,
        modules=("training.base", "generation.setup"),
        body=base_model_body,
        record=recording.record_base_model,
        headline=base_model_headline,
        external=model_files,
    ),
    Stage(
        name="warmup",
        inputs={MODEL: ("base_model", MODEL), PROMPTS: ("decontaminate", PROMPTS)},
        config=warmup_key,
        modules=("training.warmup", *_TRAINING_MODULES),
        body=warmup_body,
        record=recording.record_warmup,
        headline=warmup_headline,
        plugins=env_plugins,
    ),
    # The learned reward model (reward=reward_model): annotators rate the warm-up model's responses.
    Stage(
        name="preferences",
        inputs={MODEL: ("warmup", MODEL), PROMPTS: ("decontaminate", PROMPTS), DATASET: ("data", DATASET)},
        config=preferences_key,
        # evaluation.stages: the benchmark items and file hashes the prompts are checked against, as in
        # decontaminate (tasks.bodies.decontam_args)
        modules=(
            "data_curation.annotators",
            "data_curation.preferences",
            "evaluation.stages",
            *_SAMPLING_MODULES,
        ),
        body=preferences_body,
        record=recording.record_preferences,
        headline=preferences_headline,
        external=decontam_files,
        when=uses_reward_model,
    ),
    Stage(
        name="reward_model",
        inputs={MODEL: ("warmup", MODEL), COMPARISONS: ("preferences", COMPARISONS)},
        config=reward_model_key,
        modules=(
            "training.reward_model",
            "rewards.reward_model",
            "data_curation.preferences",
            "generation.setup",
        ),
        body=reward_model_body,
        record=recording.record_reward_model,
        headline=reward_model_headline,
        external=reward_model_files,
        when=uses_reward_model,
    ),
    _eval_stage("eval_warmup", "warmup"),
    Stage(
        name="difficulty",
        inputs={MODEL: ("warmup", MODEL), PROMPTS: ("decontaminate", PROMPTS)},
        config=difficulty_key,
        modules=_SAMPLING_MODULES,
        body=difficulty_body,
        record=recording.record_difficulty,
        headline=difficulty_headline,
        plugins=verdict_plugins,
    ),
    Stage(
        name="dart",
        inputs={
            MODEL: ("warmup", MODEL),
            PROMPTS: ("decontaminate", PROMPTS),
            ATTEMPTS: ("difficulty", ATTEMPTS),
            REWARD_MODEL: ("reward_model", MODEL),
        },
        config=dart_key,
        modules=(*_SAMPLING_MODULES, "data_curation.dart"),
        body=dart_body,
        record=recording.record_dart,
        headline=dart_headline,
        reads={REWARD_MODEL: dart_ranks},
        plugins=verdict_plugins,
    ),
    Stage(
        name="rft",
        inputs={MODEL: ("warmup", MODEL), RFT_DATA: ("dart", RFT_DATA)},
        config=rft_key,
        modules=("training.rft", *_TRAINING_MODULES),
        body=rft_body,
        record=recording.record_rft,
        headline=rft_headline,
    ),
    _eval_stage("eval_rft", "rft"),
    # HIVE selects from the pass rates of the model RL starts from (the RFT model, often much better than
    # the warm-up model whose pass rates steered DART): stale rates put solved prompts on the "edge".
    Stage(
        name="difficulty_rft",
        inputs={MODEL: ("rft", MODEL), PROMPTS: ("decontaminate", PROMPTS)},
        config=difficulty_rft_key,
        modules=_SAMPLING_MODULES,
        body=difficulty_rft_body,
        record=recording.record_difficulty,
        headline=difficulty_headline,
        plugins=verdict_plugins,
    ),
    Stage(
        name="select",
        inputs={PROMPTS: ("decontaminate", PROMPTS), ATTEMPTS: ("difficulty_rft", ATTEMPTS)},
        config=select_key,
        modules=("data_curation.hive",),
        body=select_body,
        record=recording.record_select,
        headline=select_headline,
        external=history_fingerprint,
    ),
    Stage(
        name="rl",
        inputs={
            MODEL: ("rft", MODEL),
            SELECTION: ("select", SELECTION),
            DATASET: ("data", DATASET),
            REWARD_MODEL: ("reward_model", MODEL),
        },
        config=rl_key,
        modules=(
            "training.rl.stage",
            "training.rl.drivers.local",
            "training.rl.drivers.ray",
            "training.rl.actors",
            "training.rl.trainer",
            "training.rl.teacher",
            "generation.setup",
            "data_curation.hive",
            "rewards.verifier",
            "rewards.components",
            "rewards.compose",
            "rewards.reward_model",
            "evaluation.stages",
            "training.lora",
            "generation.adapter",
        ),
        body=rl_body,
        record=recording.record_rl,
        headline=rl_headline,
        plugins=rl_plugins,
        external=teacher_files,
    ),
    _eval_stage("eval_rl", "rl"),
)
STAGE_BY_NAME = {s.name: s for s in STAGES}

EVAL_STAGE = Stage(
    name="eval",
    inputs={MODEL: ("", MODEL), DATASET: ("", DATASET)},
    config=eval_key,
    modules=_EVAL_MODULES,
    body=eval_body,
    record=recording.record_adhoc_eval,
    headline=eval_headline,
    external=benchmark_files,
    plugins=eval_plugins,
)
"""``laminar eval`` on any checkpoint: not part of the DAG (its inputs come from the command line:
a checkpoint and the latest data artifact, which may be absent), same body and key scheme as the
DAG's eval stages."""


# ---- operations on the graph --------------------------------------------------------------------------


class UnknownStage(ValueError):
    pass


DEFAULT_CONFIG = Config()
"""The config the graph operations assume when given none: its stages are the default run's."""


def _live(cfg: Config | None) -> Config:
    return cfg if cfg is not None else DEFAULT_CONFIG


def stages_of(cfg: Config | None = None) -> list[Stage]:
    """The stages that run under ``cfg`` (None: the default config), in DAG order."""
    return [s for s in STAGES if s.active(_live(cfg))]


def check_stages(names: Iterable[str], cfg: Config | None = None) -> list[str]:
    names = list(names)
    known = [s.name for s in stages_of(cfg)]
    unknown = [n for n in names if n not in known]
    if unknown:
        gated = [n for n in unknown if n in STAGE_BY_NAME]
        why = (
            f"stage {', '.join(gated)} runs only when reward.components names reward_model "
            "(reward=reward_model)"
            if gated
            else f"unknown stage {', '.join(unknown)}"
        )
        raise UnknownStage(f"{why}; stages are {', '.join(known)}")
    return names


def upstream_of(names: Iterable[str], cfg: Config | None = None) -> set[str]:
    """``names`` and every stage they read from under ``cfg`` (None: the default config), transitively."""
    todo, seen = check_stages(names, cfg), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(src for src, _ in active_inputs(STAGE_BY_NAME[name], _live(cfg)).values())
    return seen


def downstream_of(names: Iterable[str], cfg: Config | None = None) -> set[str]:
    """``names`` and every stage that reads from them under ``cfg`` (None: the default config),
    transitively (whatever the order of STAGES)."""
    seen = set(check_stages(names, cfg))
    changed = True
    while changed:
        changed = False
        for stage in stages_of(cfg):
            reads = active_inputs(stage, _live(cfg)).values()
            if stage.name not in seen and any(src in seen for src, _ in reads):
                seen.add(stage.name)
                changed = True
    return seen


def in_dag_order(names: Iterable[str]) -> list[str]:
    wanted = set(names)
    return [s.name for s in STAGES if s.name in wanted]


@dataclass(frozen=True)
class Selection:
    """What one ``laminar run``/``rerun`` executes: ``stages`` (None: all of them) and ``force``."""

    stages: list[str] | None
    force: list[str]

    def stages_to_run(self, cfg: Config | None = None) -> list[Stage]:
        """The selected stages that run under ``cfg`` (None: the default config)."""
        return [s for s in stages_of(cfg) if self.stages is None or s.name in self.stages]


def select(
    until: str | None = None, force: Sequence[str] = (), rerun: str | None = None, cfg: Config | None = None
) -> Selection:
    """``until``: only that stage and its upstream. ``rerun``: that stage and its downstream are forced,
    their upstream comes from cache, and stages that neither feed nor follow it are left out. The
    graph is the one ``cfg`` runs (None: the default config's)."""
    force = check_stages(force, cfg)
    stages: set[str] | None = None
    if rerun is not None:
        forced = downstream_of([rerun], cfg)
        force = sorted(set(force) | forced)
        stages = upstream_of(forced, cfg)
    if until is not None:
        up = upstream_of([until], cfg)
        stages = up if stages is None else stages & up
    if stages is not None:
        force = [f for f in force if f in stages]
    return Selection(in_dag_order(stages) if stages is not None else None, in_dag_order(force))


def active_inputs(stage: Stage, cfg: Config | None) -> dict[str, tuple[str, str]]:
    """``stage.inputs`` less those from stages that do not run under ``cfg`` (``Stage.when``) and those
    the stage does not read under it (``Stage.reads``; with no ``cfg``, it may)."""
    return {
        n: (src, out)
        for n, (src, out) in stage.inputs.items()
        if STAGE_BY_NAME[src].active(cfg) and (cfg is None or stage.reads.get(n, _always)(cfg))
    }


def _always(cfg: Config) -> bool:
    return True


def stage_inputs(
    stage: Stage, produced: Mapping[str, Mapping[str, ArtifactRef]], cfg: Config | None = None
) -> dict[str, ArtifactRef] | None:
    """The stage's input artifacts under ``cfg``, from ``produced`` (upstream stage -> its artifacts by
    output name); None when an upstream stage or one of its outputs is missing. With no ``cfg``, an
    input from a stage that runs only under some configs is taken when it was produced."""
    inputs = active_inputs(stage, cfg)
    optional = {n for n, (src, _) in inputs.items() if cfg is None and STAGE_BY_NAME[src].when is not None}
    try:
        return {
            name: produced[src][out]
            for name, (src, out) in inputs.items()
            if name not in optional or src in produced
        }
    except KeyError:
        return None


def missing_upstream(
    stage: Stage, produced: Mapping[str, Mapping[str, ArtifactRef]], cfg: Config | None = None
) -> list[str]:
    """The upstream stages of ``stage`` (under ``cfg``) absent from ``produced``, sorted."""
    return sorted({src for src, _ in active_inputs(stage, cfg).values() if src not in produced})


def stage_key(
    stage: Stage, cfg: Config, inputs: Mapping[str, ArtifactRef], ws: Workspace | None = None
) -> CacheKey:
    return stage.key(cfg, inputs, ws.catalog if ws is not None else None)


def stage_headline(stage: str, metrics: dict) -> str:
    """The stage's one-line metric summary; empty when its metrics lack what the line shows."""
    try:
        return STAGE_BY_NAME[stage].headline(metrics)
    except (KeyError, TypeError, ValueError):
        return ""
