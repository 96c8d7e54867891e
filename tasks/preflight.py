"""Checks that need the stage libraries or the file system, run before any write (after the
schema's own validation): a bad benchmark name or model folder fails here, not mid-pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from conf.schema import Config, ConfigError


def load_checked(overrides: Sequence[str]) -> Config:
    """The config of ``overrides``, validated by the schema and by ``preflight`` (raises ConfigError)."""
    from conf.loader import load_config

    cfg = load_config(list(overrides))
    preflight(cfg)
    return cfg


def _check_benchmark_files(cfg: Config, vendored: tuple[str, ...]) -> None:
    """Each file benchmark: a name of its own, a file that exists and rows with its fields (read now)."""
    from data_curation.benchmark_files import BenchmarkFileError, load_file_benchmark

    for i, b in enumerate(cfg.eval.benchmarks):
        if isinstance(b, str):
            continue
        if b.name in vendored:
            raise ConfigError(
                f"eval.benchmarks[{i}].name={b.name!r} is a vendored benchmark's name; give your file "
                "another name (or drop the file spec and name the vendored one)"
            )
        try:
            load_file_benchmark(b)
        except BenchmarkFileError as err:
            raise ConfigError(f"eval.benchmarks[{i}]: {err}") from None


def preflight(cfg: Config) -> None:
    from evaluation.benchmarks import BENCHMARKS
    from evaluation.code_benchmarks import CODE_BENCHMARKS
    from evaluation.stages import HELDOUT

    valid = (HELDOUT, *BENCHMARKS, *CODE_BENCHMARKS)
    unknown = [b for b in cfg.eval.benchmarks if isinstance(b, str) and b not in valid]
    if unknown:
        raise ConfigError(
            f"eval.benchmarks: unknown benchmark {unknown[0]!r}; choose from {', '.join(valid)}, "
            "or give a file spec {name: mine, path: /data/test.jsonl, ...}"
        )
    _check_benchmark_files(cfg, valid)
    valid = (*valid, *cfg.eval.benchmark_files())
    unknown = [b for b in cfg.curation.decontam.benchmarks if b not in valid]
    if unknown:
        raise ConfigError(
            f"curation.decontam.benchmarks: unknown benchmark {unknown[0]!r}; choose from {', '.join(valid)}"
        )
    if cfg.model.kind == "hf":
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.path={path} is not a save_pretrained folder (no config.json)")
        if not list(path.glob("*.safetensors")):
            raise ConfigError(
                f"model.path={path} has no *.safetensors weights; pickled weights are never loaded, "
                "convert them to safetensors first"
            )
        _check_vllm_shape(cfg, path)
    _check_sources(cfg)
    from training.rl.stage import objective_params

    try:
        params = objective_params(cfg.rl)
    except ValueError as err:
        raise ConfigError(f"rl: {err}") from None
    if params.overlong_shaping and not 0 < cfg.rl.overlong_cache_len < cfg.rl.max_new_tokens:
        raise ConfigError(
            f"rl.overlong_cache_len={cfg.rl.overlong_cache_len} must be in (0, rl.max_new_tokens="
            f"{cfg.rl.max_new_tokens}) when overlong shaping is on ({cfg.rl.algorithm})"
        )
    _check_critic(cfg, params)
    _check_reward_model(cfg)
    _check_plugins(cfg)
    _check_environment(cfg)
    if cfg.trainer.backend == "deepspeed":
        from conf.loader import deepspeed_config

        deepspeed_config(cfg.trainer.deepspeed)
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                "trainer.backend=deepspeed: the deepspeed package is not installed "
                "(it is in requirements.txt: run `make test` or `pip install -r requirements.txt`)"
            )


def _check_plugins(cfg: Config) -> None:
    """Every plug-in the run names imports, has the shape its role calls and accepts its ``params``
    (reward components and the verdict, benchmark verdicts and ``score_with``, ``rl.loss``): one
    line naming it, before any write."""
    from conf.schema import RewardComponentConfig
    from core.plugins import PluginError
    from rewards.registry import check

    checks = [(f"reward.components[{i}]", dict(s=s)) for i, s in enumerate(cfg.reward.components)]
    for i, b in enumerate(cfg.eval.benchmarks):
        if isinstance(b, str):
            continue
        verdict = dict(name=b.verdict_name(), params=dict(b.verdict_params or {}))
        checks.append((f"eval.benchmarks[{i}].verdict", verdict))
        checks += [(f"eval.benchmarks[{i}].score_with", dict(name=n)) for n in b.score_with]
    for key, spec in checks:
        try:
            check(spec["s"] if "s" in spec else RewardComponentConfig.of(**spec))
        except (PluginError, ConfigError) as err:
            raise ConfigError(f"{key}: {err}") from None
    if cfg.rl.loss is not None:
        from training.objectives import custom_loss

        try:
            custom_loss(cfg.rl.loss, tuple(sorted((cfg.rl.loss_params or {}).items())))
        except PluginError as err:
            raise ConfigError(f"rl.loss: {err}") from None


def _check_environment(cfg: Config) -> None:
    """``env.target`` and each ``envs[i].target``: a built-in or entry-point name, or an import path
    that imports, takes its ``params`` (its ``Params`` model) and has ``reset``/``step(state,
    turn)``/``close`` (or is an agent's ``async def solve(client, task)``); one line naming the key."""
    from core.plugins import PluginError
    from environments.registry import check_environment

    checks = [] if cfg.env.is_default() else [("env.target", cfg.env)]
    checks += [(f"envs[{i}].target", e) for i, e in enumerate(cfg.envs) if not e.is_default()]
    for key, env in checks:
        try:
            check_environment(env)
        except PluginError as err:
            raise ConfigError(f"{key}: {' '.join(str(err).split())}") from None


def _check_sources(cfg: Config) -> None:
    """Each ``data.sources`` entry exists and parses as its format (``ingest.check_readable``), and a
    ``data.source=files`` pool holds some rows (unless ``data.allow_empty``): a malformed or fake file
    fails here, before the dataset artifact or a run record is written."""
    from data_curation.ingest import SourceSpec, check_readable
    from data_curation.sources import resolve_source_path

    rows: list[int | None] = []
    for i, src in enumerate(cfg.data.sources):
        local = resolve_source_path(src.path)
        if local is None and src.format != "hf":
            raise ConfigError(
                f"data.sources[{i}].path={src.path!r}: no such file or folder "
                "(only format=hf may name a hub dataset)"
            )
        if local is None:
            rows.append(None)
            continue
        try:
            spec = SourceSpec(
                **{**src.model_dump(), "path": str(local), "extra_fields": tuple(src.extra_fields)}
            )
            rows.append(check_readable(spec))
        except (OSError, ValueError) as err:  # SourceError is a ValueError; its message is one line
            raise ConfigError(f"data.sources[{i}]: {' '.join(str(err).split())}") from None
    if cfg.data.source == "files" and rows and all(n == 0 for n in rows) and not cfg.data.allow_empty:
        from data_curation.ingest import empty_pool_error

        raise ConfigError(f"data.sources: {empty_pool_error(0, [])}")


def _check_vllm_shape(cfg: Config, path: Path) -> None:
    """``rollout.engine=vllm`` on the CPU with a Hugging Face model: its attention heads must be a size
    vLLM's CPU build runs (read from ``config.json``: ``head_dim``, else hidden size / heads), or the
    run would fail minutes in, at the rollout's start."""
    if cfg.rollout.engine != "vllm" or cfg.device != "cpu":
        return
    import json

    from conf.schema import vllm_cpu_refusal

    conf = json.loads((path / "config.json").read_text())
    heads = conf.get("num_attention_heads")
    head_dim = conf.get("head_dim") or (conf.get("hidden_size", 0) // heads if heads else None)
    why = vllm_cpu_refusal(head_dim) if head_dim else None
    if why:
        raise ConfigError(f"rollout.engine=vllm with model.path={path} (head_dim={head_dim}): {why}")


def _check_critic(cfg: Config, params) -> None:
    """``rl.critic_path``: only with a critic preset, a model folder whose tokenizer is the policy's."""
    path = cfg.rl.critic_path
    if path is None:
        return
    if not params.needs_critic:
        raise ConfigError(
            f"rl.critic_path={path}: rl.algorithm={cfg.rl.algorithm} (advantage={params.advantage}) has no "
            "critic; use rl.algorithm=ppo|vapo or drop rl.critic_path"
        )
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"rl.critic_path={folder} is not a save_pretrained folder (no config.json)")
    from generation.model import build_char_tokenizer, load_tokenizer
    from training.rl.critic import vocab_mismatch

    policy_tok = (
        load_tokenizer(Path(cfg.model.path).expanduser())
        if cfg.model.kind == "hf"
        else build_char_tokenizer()
    )
    why = vocab_mismatch(policy_tok, folder)
    if why:
        raise ConfigError(
            f"rl.critic_path={folder} does not fit the policy's tokenizer: {why}; use a critic trained "
            "with the policy's tokenizer or drop rl.critic_path (a copy of the policy)"
        )


def _policy_tokenizer(cfg: Config):
    from generation.model import build_char_tokenizer, load_tokenizer

    return (
        load_tokenizer(Path(cfg.model.path).expanduser())
        if cfg.model.kind == "hf"
        else build_char_tokenizer()
    )


def _check_reward_model(cfg: Config) -> None:
    """With a ``reward_model`` component: ``reward_model.path`` must be a one-label
    sequence-classification checkpoint (safetensors) and ``reward_model.backbone`` a save_pretrained
    folder, each with the policy's tokenizer (the reward model reads the policy's prompts and
    responses as tokens of its own vocabulary)."""
    if not cfg.reward.uses_reward_model():
        return
    from training.reward_model import check_reward_model_path, check_backbone_path

    c = cfg.reward_model
    checks = [("reward_model.path", c.path, check_reward_model_path)] if c.path is not None else []
    if c.backbone != "warmup":
        checks.append(("reward_model.backbone", c.backbone, check_backbone_path))
    for key, path, check in checks:
        try:
            check(Path(path).expanduser(), _policy_tokenizer(cfg))
        except ValueError as err:
            raise ConfigError(f"{key}={path}: {err}") from None


def resolved_yaml(cfg: Config) -> str:
    """The config as YAML with every ``rl`` objective key the algorithm's preset fills (null in the
    schema: "keep the preset's value") shown with the value the run will use, marked with the preset
    it comes from, so ``laminar config rl.algorithm=dapo`` shows ``clip_high: 0.28``."""
    import re

    from conf.loader import to_yaml
    from training.rl.stage import OVERRIDABLE, objective_params

    text = to_yaml(cfg)
    try:
        params = objective_params(cfg.rl)
    except ValueError:
        return text
    filled = {k: getattr(params, k) for k in OVERRIDABLE if getattr(cfg.rl, k) is None}
    lines, in_rl = [], False
    for line in text.splitlines():
        if re.match(r"^\S", line):
            in_rl = line.startswith("rl:")
        m = re.match(r"^  (\w+): null$", line) if in_rl else None
        if m and m.group(1) in filled:
            value = filled[m.group(1)]
            shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
            line = f"  {m.group(1)}: {shown}  # rl.algorithm={cfg.rl.algorithm} preset"
        lines.append(line)
    return "\n".join(lines) + "\n"
