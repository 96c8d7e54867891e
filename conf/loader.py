"""Compose the Hydra config tree, merge it into the typed schema and validate it.

Everything here runs before the workspace is touched: a typo fails with a message naming the key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from conf.schema import BenchmarkFileConfig, Config, ConfigError, validate

CONF_DIR = Path(__file__).resolve().parent


def _explain_composition(err: Exception, overrides: Sequence[str]) -> str:
    text = f"{err} {err.__cause__ or ''}"
    typed = re.search(r"Error merging override ([^=\s]+)=", text)
    if typed:
        key = typed.group(1).lstrip("+~")
        why = str(err.__cause__ or err).strip().splitlines()[0]
        return (
            f"config key '{key}': {why}; give {key} a value of the type its default has "
            "(`laminar config` shows it)"
        )
    inner = re.search(r"Key '([^']+)' not in '(\w+)'", str(err.__cause__ or ""))
    over = re.search(r"Could not override '([^']+)'", text)
    listed = over and any(
        o.split("=", 1)[0].lstrip("+~") == over.group(1) and o.split("=", 1)[-1].lstrip().startswith("[")
        for o in overrides
    )
    if inner and listed:  # a key inside a list item (reward.components, data.sources)
        return (
            f"config key '{over.group(1)}': an item has the key {inner.group(1)!r}, which {inner.group(2)} "
            "does not have; check the spelling (`laminar config` prints every key)"
        )
    missing = re.search(r"override '([^']+)'", text) or re.search(r"Key '([^']+)' is not in struct", text)
    if missing:
        key = missing.group(1)
        return f"unknown config key '{key}': check the spelling (`laminar config` prints every key)"
    group = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if group:
        name, option = group.groups()
        options = sorted(p.stem for p in (CONF_DIR / name).glob("*.yaml"))
        return f"unknown option {name}={option}: choose one of {', '.join(options)}"
    return f"cannot compose config from overrides {list(overrides)}: {err}"


def _unknown_keys(node: Any, schema: Any, prefix: str = "") -> list[str]:
    """Keys in the composed config that the schema does not have (``+key=...`` appends them)."""
    from dataclasses import fields, is_dataclass

    known = {f.name: f for f in fields(schema)}
    found = []
    for key in node.keys():
        if key not in known:
            found.append(prefix + str(key))
        elif is_dataclass(known[key].default_factory() if callable(known[key].default_factory) else None):
            found += _unknown_keys(node[key], type(known[key].default_factory()), f"{prefix}{key}.")
    return found


OPEN_KEYS = ("env.params",)
"""Mappings whose keys the schema cannot know (a plug-in's own parameters, validated by its ``Params``
model in ``tasks.preflight``): ``env.params.max_value=50`` adds a key there without Hydra's ``+``."""


def _schema_node():
    """The schema as Hydra's base node, with the mappings of ``OPEN_KEYS`` open to new keys."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(Config)
    for key in OPEN_KEYS:
        OmegaConf.set_struct(OmegaConf.select(node, key), False)
    return node


MAX_KEY_CHARS = 256
"""Characters of an override's key (the longest real key has under 60)."""
MAX_OVERRIDE_CHARS = 8192
"""Characters of one override (a long text or list belongs in a config group's YAML file)."""
MAX_OVERRIDE_ITEMS = 512
"""Commas in one override: Hydra's parser takes time quadratic in a list's items (50,000 took minutes);
the schema's own limits (``conf.schema.MaxLen``) are lower still."""


MAX_OVERRIDE_DEPTH = 16
"""Nesting of lists and mappings in one override (Hydra's parser recurses per level)."""


def _depth(text: str) -> int:
    depth = most = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth -= 1
    return most


def check_override_sizes(overrides: Sequence[str]) -> None:
    """Each override within ``MAX_KEY_CHARS``, ``MAX_OVERRIDE_CHARS``, ``MAX_OVERRIDE_DEPTH`` and
    ``MAX_OVERRIDE_ITEMS``, checked before Hydra parses anything; the error shows at most the key's
    first 40 characters."""
    for o in overrides:
        if not isinstance(o, str):
            raise ConfigError(f"override {o!r} is not a string; give key=value")
        key = o.split("=", 1)[0]
        shown = key if len(key) <= 40 else key[:40] + "..."
        if len(key) > MAX_KEY_CHARS:
            raise ConfigError(
                f"override key '{shown}' is {len(key):,} characters long; a config key has at most "
                f"{MAX_KEY_CHARS} (`laminar config` prints every key)"
            )
        if len(o) > MAX_OVERRIDE_CHARS:
            raise ConfigError(
                f"override {shown}=... is {len(o):,} characters long; an override takes at most "
                f"{MAX_OVERRIDE_CHARS:,}"
            )
        if _depth(o) > MAX_OVERRIDE_DEPTH:
            raise ConfigError(
                f"override {shown}=... nests lists or mappings {_depth(o):,} deep; an override takes at "
                f"most {MAX_OVERRIDE_DEPTH}"
            )
        if o.count(",") >= MAX_OVERRIDE_ITEMS:
            raise ConfigError(
                f"override {shown}=... lists {o.count(',') + 1:,} items; an override takes at most "
                f"{MAX_OVERRIDE_ITEMS}"
            )


def load_config(overrides: Sequence[str] = ()) -> Config:
    """Hydra overrides (``key=value``, ``group=option``) -> a validated :class:`Config`.

    Raises :class:`ConfigError` naming the offending key and what to change.
    """
    check_override_sizes(overrides)
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from hydra.core.config_store import ConfigStore

    # The schema is the base of config.yaml's defaults list: every key exists and is typed at compose time.
    ConfigStore.instance().store(name="laminar_schema", node=_schema_node())
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            raw = compose(config_name="config", overrides=list(overrides))
    except HydraException as err:
        raise ConfigError(_explain_composition(err, overrides)) from None
    except (OSError, RecursionError) as err:  # a group option no file name can be, nesting past the stack
        why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ConfigError(f"cannot compose config from the overrides: {why}") from None
    unknown = _unknown_keys(raw, Config)
    if unknown:
        raise ConfigError(
            f"unknown config key '{unknown[0]}': check the spelling (`laminar config` prints every key)"
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        msg = str(err).splitlines()[0]
        if "not in struct" in str(err) or type(err).__name__ == "ConfigKeyError":
            raise ConfigError(
                f"unknown config key '{key}': check the spelling (`laminar config` prints every key)"
            ) from None
        raise ConfigError(
            f"config key '{key}': {msg}; give {key} a value of the type its default has"
        ) from None
    assert isinstance(cfg, Config)
    cfg.eval.benchmarks = [_benchmark_spec(i, b) for i, b in enumerate(cfg.eval.benchmarks)]
    return check_source_names(validate(cfg))


def _benchmark_spec(i: int, item: Any) -> Any:
    """An ``eval.benchmarks`` mapping as a typed :class:`BenchmarkFileConfig` (a name stays as it is)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(item, Mapping):
        return item
    try:
        spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BenchmarkFileConfig), dict(item)))
    except OmegaConfBaseException as err:
        key = f"eval.benchmarks[{i}].{getattr(err, 'full_key', None) or '?'}"
        if "not in struct" in str(err) or type(err).__name__ == "ConfigKeyError":
            fields = ", ".join(f.name for f in dataclasses.fields(BenchmarkFileConfig))
            raise ConfigError(f"unknown config key '{key}': a benchmark file spec takes {fields}") from None
        raise ConfigError(f"config key '{key}': {str(err).splitlines()[0]}") from None
    if spec.name and not SOURCE_NAME.fullmatch(spec.name):
        raise ConfigError(
            f"eval.benchmarks[{i}].name={spec.name!r} is not an identifier: use letters, digits, _ and - "
            "(it names the benchmark's scores and catalog rows)"
        )
    return spec


SOURCE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def check_source_names(cfg: Config) -> Config:
    """Each ``data.sources[].name`` is an identifier: it names a folder inside the dataset artifact
    (``sources/<name>/``), so a name such as ``../..`` never reaches outside it."""
    for i, src in enumerate(cfg.data.sources):
        if not isinstance(src.name, str) or not SOURCE_NAME.fullmatch(src.name):
            raise ConfigError(
                f"data.sources[{i}].name={src.name!r} is not an identifier: use letters, digits, _ and - "
                "(starting with a letter or _, at most 64 characters), e.g. name: my_pool"
            )
    return cfg


def to_dict(cfg: Any) -> dict:
    """A config dataclass (or subtree) as plain JSON-ready data."""
    return asdict(cfg)


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def deepspeed_config(name: str) -> dict:
    """The DeepSpeed JSON that ``trainer.deepspeed`` names: ``conf/deepspeed/<name>.json`` or a path."""
    import json

    path = CONF_DIR / "deepspeed" / f"{name}.json"
    if not path.exists():
        path = Path(name)
    if not path.is_file():
        options = sorted(p.stem for p in (CONF_DIR / "deepspeed").glob("*.json"))
        raise ConfigError(
            f"trainer.deepspeed={name!r}: no such config; choose one of {', '.join(options)} "
            "or give the path of a DeepSpeed JSON file"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"trainer.deepspeed={name!r}: {path} is not valid JSON ({err})") from None
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"trainer.deepspeed={name!r}: zero_optimization.stage={stage} must be 0-3")
    return cfg
