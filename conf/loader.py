"""Compose the Hydra config tree and validate it into the typed schema (``conf.schema``).

Everything here runs before the workspace is touched: a typo fails with a message naming the key.
Hydra composes (groups, recipes, overrides) over a base node made from the schema's defaults, so an
override of a key the schema lacks fails in Hydra with a "did you mean"; the composed tree is then
validated once by the pydantic models, whose first error becomes one line (``conf.base``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from conf.base import validated
from conf.schema import Config, ConfigError

CONF_DIR = Path(__file__).resolve().parent


def _did_you_mean(key: str, root: type[BaseModel]) -> str:
    """`` (did you mean 'rl.steps'?)`` for a near miss of a key of ``root``'s models, else ``""``."""
    *parents, name = key.split(".")
    model: Any = root
    for part in parents:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        model = getattr(field, "annotation", None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    close = difflib.get_close_matches(name, list(model.model_fields), n=1)
    return f" (did you mean {'.'.join([*parents, close[0]])!r}?)" if close else ""


def _explain_composition(
    err: Exception, overrides: Sequence[str], root: type[BaseModel] = Config, hint: str = "`laminar config`"
) -> str:
    text = f"{err} {err.__cause__ or ''}"
    typed = re.search(r"Error merging override ([^=\s]+)=", text)
    if typed:
        key = typed.group(1).lstrip("+~")
        why = str(err.__cause__ or err).strip().splitlines()[0]
        return f"config key '{key}': {why}; give {key} a value of the type its default has ({hint} shows it)"
    inner = re.search(r"Key '([^']+)' not in '(\w+)'", str(err.__cause__ or ""))
    over = re.search(r"Could not override '([^']+)'", text)
    listed = over and any(
        o.split("=", 1)[0].lstrip("+~") == over.group(1) and o.split("=", 1)[-1].lstrip().startswith("[")
        for o in overrides
    )
    if inner and listed:  # a key inside a list item (reward.components, data.sources)
        return (
            f"config key '{over.group(1)}': an item has the key {inner.group(1)!r}, which {inner.group(2)} "
            f"does not have; check the spelling ({hint} prints every key)"
        )
    missing = re.search(r"override '([^']+)'", text) or re.search(r"Key '([^']+)' is not in struct", text)
    if missing:
        key = missing.group(1)
        guess = _did_you_mean(key, root)
        return f"unknown config key '{key}'{guess}: check the spelling ({hint} prints every key)"
    group = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if group:
        name, option = group.groups()
        options = sorted(p.stem for p in (CONF_DIR / name).glob("*.yaml"))
        return f"unknown option {name}={option}: choose one of {', '.join(options)}"
    return f"cannot compose config from overrides {list(overrides)}: {err}"


OPEN_KEYS = ("env.params", "round_overrides")
"""Mappings whose keys the schema cannot know (a plug-in's own parameters, validated by its ``Params``
model in ``tasks.preflight``): ``env.params.max_value=50`` adds a key there without Hydra's ``+``."""


def schema_node(root: type[BaseModel], open_keys: Sequence[str] = ()) -> Any:
    """``root``'s defaults as Hydra's base node. Lists of sections (``reward.components``,
    ``data.sources``) and the mappings of ``open_keys`` stay open to keys Hydra cannot know (an
    item's own, a plug-in's): the models check those."""
    from omegaconf import ListConfig, OmegaConf

    node = OmegaConf.create(root.model_construct().model_dump())

    def open_lists(n: Any) -> None:
        for key in n:
            child = n._get_node(key)
            if isinstance(child, ListConfig):
                OmegaConf.set_struct(child, False)
            elif OmegaConf.is_dict(child):
                open_lists(child)

    open_lists(node)
    for key in open_keys:
        OmegaConf.set_struct(OmegaConf.select(node, key), False)
    return node


def compose_validated(
    config_name: str,
    root: type[BaseModel],
    overrides: Sequence[str],
    open_keys: Sequence[str] = (),
    hint: str = "`laminar config`",
) -> Any:
    """Hydra's composition of ``conf/<config_name>.yaml`` with ``overrides`` over ``root``'s defaults
    (stored as ``<config_name>_schema``), validated into ``root``; a :class:`ConfigError` of one line
    naming the key otherwise."""
    check_override_sizes(overrides)
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    name = "laminar_schema" if config_name == "config" else f"{config_name}_schema"
    ConfigStore.instance().store(name=name, node=schema_node(root, open_keys))
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            raw = compose(config_name=config_name, overrides=list(overrides))
    except HydraException as err:
        raise ConfigError(_explain_composition(err, overrides, root, hint)) from None
    except (OSError, RecursionError) as err:  # a group option no file name can be, nesting past the stack
        why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise ConfigError(f"cannot compose config from the overrides: {why}") from None
    return validated(root, OmegaConf.to_container(raw, resolve=True), hint)


MAX_KEY_CHARS = 256
"""Characters of an override's key (the longest real key has under 60)."""
MAX_OVERRIDE_CHARS = 8192
"""Characters of one override (a long text or list belongs in a config group's YAML file)."""
MAX_OVERRIDE_ITEMS = 512
"""Commas in one override: Hydra's parser takes time quadratic in a list's items (50,000 took minutes);
the schema's own limits (``MaxLen`` on a field) are lower still."""


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
    return compose_validated("config", Config, overrides, OPEN_KEYS)


def to_dict(cfg: BaseModel) -> dict:
    """A config model (or section) as plain JSON-ready data."""
    return cfg.model_dump(mode="json")


def to_yaml(cfg: BaseModel) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))


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
