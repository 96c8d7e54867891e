"""What several stage modules share: the artifact names, ``produce`` (a body's new artifact), the
prompt template, the cache-key parts of shared config sections, the plug-in lists and the catalog
row helpers. Library code a stage runs is imported by the stage's own module (its imports are its
source fingerprint: ``tasks.cache.stage_modules``), never only here."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import Config, SandboxConfig
from core.artifacts import ArtifactRef
from core.catalog import dumps, insert_many
from tasks.records import StageContext, StageResult

if TYPE_CHECKING:
    from duckdb import DuckDBPyConnection as Connection

MODEL, DATASET, EVAL = "model", "dataset", "eval"
PROMPTS, ATTEMPTS, RFT_DATA, SELECTION = "prompts", "attempts", "rft_data", "selection"
COMPARISONS, REWARD_MODEL = "comparisons", "reward_model"


def eval_name(stage: str) -> str:
    """The evaluation stage of ``stage``'s model (``tasks.stages.evaluate.stage_for``)."""
    return f"eval_{stage}"


def produce(
    ctx: StageContext, kind: str, fn: Callable[[Path], dict], meta: dict | None = None
) -> tuple[ArtifactRef, dict]:
    """Run ``fn`` into a new artifact of ``kind``; ``meta`` (which ``fn`` may fill) goes into its manifest."""
    with ctx.store.create(kind, meta) as pending:
        metrics = fn(pending.dir)
    assert pending.ref is not None
    return pending.ref, metrics


def template(cfg: Config) -> str:
    """The prompt template of the training pool: the bare problem for the synthetic task, the
    \\boxed{} instruction of the benchmarks for real pools (a chat template wraps either), unless
    ``data.template`` names another."""
    from data_curation.synthetic import PROMPT_TEMPLATE
    from evaluation.benchmarks import DEFAULT_TEMPLATE

    if cfg.data.template is not None:
        return cfg.data.template
    return PROMPT_TEMPLATE if cfg.data.source == "arith" else DEFAULT_TEMPLATE


def file_benchmarks(cfg: Config) -> dict:
    """The file benchmarks of ``eval.benchmarks``, read (name -> ``evaluation.benchmarks.FileBenchmark``)."""
    from data_curation.benchmark_files import load_file_benchmarks

    return load_file_benchmarks(cfg.eval.benchmark_files().values())


def reward_model_components(ctx: StageContext) -> list:
    """The learned reward model as an evaluation scorer, built like RL's ``reward_model`` component
    (its normalisation and clip), when the stage reads a reward model; else none."""
    from rewards.compose import REWARD_MODEL as NAME
    from rewards.compose import build_component

    ref = ctx.inputs.get(REWARD_MODEL)
    if ref is None:
        return []
    spec = next(c for c in ctx.cfg.reward.components if c.name == NAME)
    return [build_component(spec, ref.path, template(ctx.cfg))]


# ---- cache-key parts of shared config sections -----------------------------------------------------


def numerics(c: Config) -> dict:
    """What a stage that trains or samples with torch adds to its key: the thread count it computes
    with (``threads=0`` resolved to torch's default), since float results depend on it."""
    from generation.setup import resolve_threads

    return {"torch_threads": resolve_threads(c.threads)}


def lora_key(c: Config, stage: str) -> dict:
    """What ``model.lora`` adds to a training stage's key: nothing when the stage trains every weight
    (the keys of runs without LoRA stay as they were), else the adapter's settings."""
    lo = c.model.lora
    if not lo.on(stage):
        return {}
    return {"lora": {k: v for k, v in lo.model_dump().items() if k not in ("enabled", "stages")}}


def select_config(c: Config) -> dict:
    """``curation.select`` as select and RL see it: ``history_prompts`` reaches them through the
    history's content (difficulty_rft's artifact), so it is not part of their keys."""
    return {k: v for k, v in c.curation.select.model_dump().items() if k != "history_prompts"}


def drop_defaults(section, *names: str) -> dict:
    """``section.model_dump()`` without the named fields while they hold their defaults: fields added
    after a section's keys were first written leave those keys unchanged until they are set."""
    out = section.model_dump()
    fields = type(section).model_fields
    for name in names:
        if out[name] == fields[name].get_default(call_default_factory=True):
            del out[name]
    return out


def verdict_key(c: Config) -> dict:
    """The run's verdict, for stages that judge with it (difficulty, DART, the pool's held-out set);
    absent while it is the built-in ``math_verify`` (the keys from before verdicts unchanged). A
    plug-in's source enters through ``Stage.plugins``."""
    v = c.reward.verdict()
    if v.is_builtin() and v.name == "math_verify":
        return {}
    verdict = {"name": v.name, "target": v.target, "params": v.given(), "threshold": v.threshold}
    return {"verdict": verdict, **sandbox_key(c)}


def reward_key(c: Config) -> list[dict]:
    """The reward RL trains on (``rewards.compose.Reward.spec``: each component's name, weight,
    whether it is the correctness verdict and its resolved parameters), with the overlong component
    the objective's preset adds (``rl.algorithm=dapo``): what ``laminar lineage`` prints."""
    from rewards.compose import Reward
    from training.rl.loop import rl_reward
    from training.rl.stage import objective_params

    return rl_reward(Reward.of(None, c.reward), objective_params(c.rl)).spec()


def reward_model_key(c: Config) -> dict:
    """The reward model's scoring settings, for stages that score with it; absent without one."""
    spec = [s for s in reward_key(c) if s["name"] == "reward_model"]
    return {"reward_model": spec[0]["params"]} if spec else {}


def env_key(c: Config) -> dict:
    """The environment, for stages that sample episodes; absent for single-turn (keys unchanged), and
    its tool latency absent while off and its version rule while ``turn`` (keys of environments from
    before them unchanged)."""
    if c.env.is_default():
        return {}
    env = drop_defaults(c.env, "version_rule")
    if c.env.tool_latency.is_off():
        del env["tool_latency"]
    return {"env": env}


def sandbox_key(c: Config) -> dict:
    """The sandbox settings, for the stages where code may run (code tests, tools, code benchmarks);
    absent at their defaults (keys from before them unchanged)."""
    return {} if c.sandbox == SandboxConfig() else {"sandbox": c.sandbox.model_dump()}


def episodes_key(c: Config) -> dict:
    """The environment curation samples episodes in, with the sandbox its tools run under; absent for
    single-turn (keys unchanged)."""
    return {} if c.env.is_default() else {**env_key(c), **sandbox_key(c)}


def uses_reward_model(c: Config) -> bool:
    """``Stage.when`` of the reward-model stages: ``reward.components`` names ``reward_model``."""
    return c.reward.uses_reward_model()


def benchmark_hashes(cfg: Config, names: Iterable[str]) -> dict[str, str]:
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


# ---- plug-ins by import path (``Stage.plugins``) ---------------------------------------------------


def reward_targets(specs) -> list[str]:
    from rewards.registry import is_plugin, target_of

    return [target_of(s) for s in specs if is_plugin(s)]


def verdict_plugins(cfg: Config) -> list[str]:
    """The run's verdict, when it is a plug-in (difficulty and DART judge with it)."""
    return reward_targets([cfg.reward.verdict()])


def curation_plugins(cfg: Config) -> list[str]:
    """The run's verdict and, for episodes, the environment: difficulty and DART judge with the
    verdict and sample whole episodes in ``env`` when it is not single-turn."""
    return [*verdict_plugins(cfg), *env_plugins(cfg)]


def env_plugins(cfg: Config) -> list[str]:
    """The environment, when ``env.target`` names one by import path (stages that sample episodes)."""
    from core.plugins import is_target

    target = getattr(cfg.env, "target", None)
    return [target] if target and is_target(target) and not cfg.env.is_default() else []


# ---- catalog rows (``Stage.record`` hooks write inside the runner's transaction) -------------------


__all__ = ["dumps", "insert_many"]  # for the record hooks: the catalog's helpers are no stage's code


def insert_parquet(con: Connection, table: str, columns: str, ref: ArtifactRef, file: str) -> None:
    """Rows of one of the artifact's parquet files into ``table``, keyed by the artifact's sha."""
    con.execute(
        f"INSERT INTO {table} SELECT ?, {columns} FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file(file))],
    )


def record_history(con: Connection, ref: ArtifactRef, file: str) -> None:
    """HIVE's reward history rows (``reward_history``) from one of the artifact's parquet files."""
    con.execute(
        "INSERT INTO reward_history SELECT ?, origin, step, idx, prompt_id, mean_reward, n, now() "
        "FROM read_parquet(?) ON CONFLICT DO NOTHING",
        [ref.sha256, str(ref.file(file))],
    )


def record_checkpoint(
    con: Connection, ctx: StageContext, res: StageResult, key: str, stage: str, step: int | None
) -> None:
    """The ``checkpoints`` row of the stage's model (its base: the stage's model input, if any)."""
    ref = res.artifacts[MODEL]
    base = ctx.inputs.get(MODEL)
    con.execute(
        "INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT DO NOTHING",
        [ref.sha256, stage, step, base.sha256 if base else None, key],
    )


# ---- presentation and external inputs ----------------------------------------------------------------


def coverage_note(v: dict, short: bool = False) -> str:
    """``evaluation.report.coverage_note``: a headline's note on the problems an evaluation covered."""
    from evaluation.report import coverage_note as note

    return note(v, short=short)


def folder_hash(path: str) -> str:
    """sha256 of a folder outside the store (``core.artifacts.hash_tree``; ``~`` expanded)."""
    from core.artifacts import hash_tree

    return hash_tree(Path(path).expanduser())
