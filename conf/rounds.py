"""Each round's config (``rounds=N``, docs/rounds.md): round 1 reads the top-level config; round k >= 2
reads it with ``round_overrides`` 2..k merged over it, in order (a setting given for round 2 holds in
rounds 3.. until another round changes it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conf.base import rule

if TYPE_CHECKING:
    from conf.schema import Config


def _merge(base: dict, patch: dict, at: str = "") -> dict:
    """``patch``'s settings over ``base`` (mappings merged key by key, other values replaced); a key
    ``base`` lacks is an error naming it."""
    out = dict(base)
    for key, value in patch.items():
        full = f"{at}{key}"
        if key not in base:
            raise KeyError(full)
        if isinstance(value, dict) and isinstance(base[key], dict):
            out[key] = _merge(base[key], value, full + ".")
        else:
            out[key] = value
    return out


def round_patch(cfg: Config, k: int) -> dict[str, Any]:
    """The settings round ``k`` changes: ``round_overrides`` 2..k merged in order (empty for round 1)."""
    patch: dict[str, Any] = {}
    for r in sorted(cfg.round_overrides):
        if r <= k:
            patch = _deep(patch, cfg.round_overrides[r])
    return patch


def _deep(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _deep(out[key], value) if nested else value
    return out


def round_config(cfg: Config, k: int) -> Config:
    """The config round ``k``'s stages read: ``cfg`` itself when no override reaches round ``k``."""
    patch = round_patch(cfg, k)
    if not patch:
        return cfg
    return _round_config(cfg, _frozen(patch))


def _frozen(obj: Any) -> Any:
    if isinstance(obj, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in obj.items()))
    if isinstance(obj, list):
        return ("__list__", tuple(_frozen(v) for v in obj))
    return obj


def _thawed(obj: Any) -> Any:
    if isinstance(obj, tuple) and obj[:1] == ("__list__",):
        return [_thawed(v) for v in obj[1]]
    if isinstance(obj, tuple):
        return {k: _thawed(v) for k, v in obj}
    return obj


_CACHE: dict[tuple[int, Any], tuple[Config, Config]] = {}


def _round_config(cfg: Config, patch: Any) -> Config:
    """Validated once per (config object, patch): stage keys ask for it often (the cache holds ``cfg``
    itself, so its id is not reused while cached)."""
    hit = _CACHE.get((id(cfg), patch))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    from conf.schema import validate

    data = cfg.model_dump()
    data["round_overrides"] = {}
    try:
        merged = _merge(data, _thawed(patch))
    except KeyError as err:
        raise ValueError(f"unknown config key '{err.args[0]}'") from None
    out = validate(merged)
    if len(_CACHE) > 256:
        _CACHE.clear()
    _CACHE[(id(cfg), patch)] = (cfg, out)
    return out


def check_round_overrides(cfg: Config) -> None:
    """Compose-time check: each overridden round is one of 2..``rounds`` and its config validates."""
    for r, patch in cfg.round_overrides.items():
        if not 2 <= r <= cfg.rounds:
            raise rule(
                f"@round_overrides.{r}: rounds are 2..rounds={cfg.rounds} (round 1 reads the top-level "
                "config; set @rounds higher or change the setting itself)"
            )
        if not isinstance(patch, dict) or not patch:
            raise rule(
                f"@round_overrides.{r} must map config keys to values, e.g. round_overrides.{r}.rl.steps=20"
            )
        if "rounds" in patch or "round_overrides" in patch or "seed" in patch:
            raise rule(f"@round_overrides.{r} cannot set rounds, round_overrides or seed")
    from conf.base import ConfigError

    for r in sorted(cfg.round_overrides):
        try:
            _round_config(cfg, _frozen(round_patch(cfg, r)))
        except (ConfigError, ValueError) as err:
            raise rule(f"@round_overrides.{r}: {err}") from None
        finally:
            _CACHE.clear()
