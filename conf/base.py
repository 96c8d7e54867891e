"""The base of every config model and the one-line errors made from pydantic's.

A config section is a pydantic v2 model (:class:`Section`): unknown keys are refused
(``extra="forbid"``), every float must be finite, and a field's allowed names and bounds sit on the
field (``Literal[...]``, ``Annotated[int, Positive, Batch]`` with the constraints below). Each
cross-field rule is one ``model_validator`` on the model that owns it, raising :func:`rule` with the
keys it names written ``@key`` (``@rl.steps`` on the root, ``@steps`` on a section): the error then
names the full dotted key. :func:`config_error` turns pydantic's first error into one line naming
the key, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import dataclass
from typing import Any

from annotated_types import Ge, Gt, Interval, Le, Lt, MaxLen
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

__all__ = ["Ge", "Gt", "Interval", "Le", "Lt", "MaxLen"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what to change."""


# ---- constraints declared on fields ---------------------------------------------------------------
Positive = Gt(0)
NonNegative = Ge(0)
NonPositive = Le(0)
"""A penalty."""
Fraction = Interval(ge=0, lt=1)
Share = Interval(gt=0, le=1)
Unit = Interval(ge=0, le=1)


@dataclass(frozen=True)
class Why:
    """Why a field has its bounds: added to the error (``Annotated[int, Ge(2), Why("...")]``)."""

    text: str


def AtMost(limit: int) -> Le:  # noqa: N802 - reads as a constraint, like Gt and Le
    """An upper limit of a number field (``Annotated[int, Positive, AtMost(65_536)]``): sizes, counts,
    steps and seconds far past any real use are refused before anything runs."""
    return Le(limit)


# Upper limits shared by many fields: far past any real use, low enough that a typo cannot ask for
# an allocation, a loop or a wait without end.
Steps = AtMost(1_000_000)
"""Optimizer steps, warm-up steps, step intervals."""
Tokens = AtMost(131_072)
"""Token lengths (generation limits, sequence lengths)."""
Batch = AtMost(65_536)
"""Batch sizes, prompts per step, concurrent sequences."""
Samples = AtMost(1_024)
"""Samples per prompt, group sizes, workers, turns, layers and heads."""
Prompts = AtMost(10_000_000)
"""Counts of prompts, problems or trials."""
Threads = AtMost(1_024)
Seed = AtMost(2**31 - 1)
Seconds = AtMost(86_400)
"""Time limits: one day."""
Megabytes = AtMost(1_048_576)
"""Sizes in MB: one TiB."""

MAX_ITEMS = 256
"""Items of a list field that declares no ``MaxLen``."""
MAX_CHARS = 4096
"""Characters of a string (and of each string in a list) that declares no ``MaxLen`` (PATH_MAX)."""
MAX_INT = 2**31 - 1
"""The magnitude of an integer field that declares no upper limit."""


def _declared(cls: type[BaseModel], name: str) -> tuple[int | None, bool]:
    """(the ``MaxLen`` a field declares, whether it declares an upper limit)."""
    meta = cls.model_fields[name].metadata
    most = next((m.max_length for m in meta if isinstance(m, MaxLen)), None)
    capped = any(isinstance(m, (Le, Lt)) or getattr(m, "le", None) is not None for m in meta)
    return most, capped


def _check_size(value: Any, most: int | None, capped: bool) -> None:
    """The bounds every value has, declared or not (checked on the raw value, before its type)."""
    if isinstance(value, list):
        limit = most or MAX_ITEMS
        if len(value) > limit:
            raise PydanticCustomError("too_many", "too many items", {"n": len(value), "most": limit})
        for i, item in enumerate(value):
            try:
                _check_size(item, None, capped)
            except PydanticCustomError as err:  # name the item: data.levels[3]
                ctx = dict(err.context or {})
                ctx["at"] = [i, *ctx.get("at", [])]
                raise PydanticCustomError(err.type, err.message_template, ctx) from None
    elif isinstance(value, str):
        limit = most or MAX_CHARS
        if len(value) > limit:
            raise PydanticCustomError("too_many_chars", "too long", {"n": len(value), "most": limit})
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT and not capped:
        raise PydanticCustomError("int_range", "out of range", {"most": MAX_INT, "value": value})


def rule(message: str) -> PydanticCustomError:
    """The error of a cross-field rule; ``@key`` in ``message`` becomes the full dotted key."""
    return PydanticCustomError("rule", "{message}", {"message": message})


class Section(BaseModel):
    """A config section: unknown keys refused, floats finite, every value bounded in size. A section
    holds its sub-sections' defaults as ``Field(default_factory=Sub.model_construct)``: defaults are
    trusted as written (a rule that reads the machine, such as a tracking backend being installed,
    runs on what a config sets, which the loader always passes in full)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        coerce_numbers_to_str=True,
        protected_namespaces=(),
        defer_build=True,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name in cls.model_fields:
            _check_size(value, *_declared(cls, info.field_name))
        return value


class Params(Section):
    """A component's parameters: a frozen section."""

    model_config = ConfigDict(frozen=True)


TAGGED: dict[str, type[BaseModel]] = {}
"""A union's tag (``kind:...``, the second part of an error's location) -> the model it selects."""


# ---- pydantic's errors as one line -----------------------------------------------------------------
TYPE_ERRORS = re.compile(r"_(type|parsing|from_float|fraction)$|^(model|dict|list)_(type|attributes_type)$")


def _key(loc: tuple) -> str:
    """A dotted key from pydantic's location; union tags (``kind:...``) are skipped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith("kind:") and part not in ("function-after", "function-before"):
            out += f".{part}" if out else str(part)
    return out


def _fields_at(root: type[BaseModel], loc: tuple) -> tuple[type[BaseModel] | None, Any]:
    """(the model that holds the last key of ``loc``, that key's FieldInfo), best effort."""
    model: Any = root
    info = None
    for part in loc:
        if str(part).startswith("kind:"):
            model = TAGGED.get(str(part), model)
            continue
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return (model if isinstance(model, type) and issubclass(model, BaseModel) else None), None
        info = model.model_fields[part]
        holder, model = model, _inner_model(info.annotation)
    return (holder if info is not None else root), info


def _inner_model(annotation: Any) -> Any:
    """The model a field's annotation holds (through lists, Optional and Annotated), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _bounds(info: Any) -> dict[str, Any]:
    """The numeric bounds a field declares (on itself or on its list's items)."""
    out: dict[str, Any] = {}
    metas = list(getattr(info, "metadata", ()))
    annotation = getattr(info, "annotation", None)
    for arg in typing.get_args(annotation):  # list[Annotated[float, ...]]
        metas += list(getattr(arg, "__metadata__", ()))
    for m in metas:
        if isinstance(m, Interval):
            out["interval"] = True
        for name in ("gt", "ge", "lt", "le"):
            if getattr(m, name, None) is not None:
                out[name] = getattr(m, name)
    return out


def _is_float(info: Any) -> bool:
    annotation = getattr(info, "annotation", None)
    return annotation is float or float in typing.get_args(annotation)


def _num(x: Any) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return f"{x:,}" if isinstance(x, int) else str(x)


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bound_message(key: str, value: Any, kind: str, bounds: dict[str, Any], ctx: dict) -> str:
    if bounds.get("interval"):
        low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"])
        high = ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"])
        return f"{key}={value} must be in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    if kind == "less_than_equal" and ctx["le"] == 0:
        return f"{key}={value} must be <= 0 (a penalty); set {key} to zero or a negative value"
    if kind == "less_than_equal":
        limit = _num(ctx["le"])
        return f"{key}={value} is above the limit of {limit}; set {key} to at most {limit}"
    if kind == "greater_than":
        hint = f"; set {key} to a positive value" if ctx["gt"] == 0 else ""
        return f"{key}={value} must be > {_num(ctx['gt'])}{hint}"
    if kind == "greater_than_equal":
        hint = f"; set {key} to zero or a positive value" if ctx["ge"] == 0 else ""
        return f"{key}={value} must be >= {_num(ctx['ge'])}{hint}"
    return f"{key}={value} must be < {_num(ctx['lt'])}"


def _unknown(key: str, holder: type[BaseModel] | None, hint: str) -> str:
    name = key.rsplit(".", 1)[-1]
    known = list(holder.model_fields) if holder is not None else []
    close = difflib.get_close_matches(name, known, n=1)
    full = key[: len(key) - len(name)] + close[0] if close else ""
    guess = f" (did you mean {full!r}?)" if close else ""
    what = getattr(holder, "unknown_key_hint", None)
    if what:  # a component's parameters
        own = ", ".join(holder.param_names()) or "none besides weight"
        return f"{key} is not {what}{guess}; its parameters: {own}"
    return f"unknown config key '{key}'{guess}: check the spelling ({hint} prints every key)"


def message_of(err: dict, root: type[BaseModel], hint: str = "`laminar config`") -> str:
    """One line for one pydantic error of a model rooted at ``root``."""
    loc, kind, ctx, value = tuple(err.get("loc", ())), err["type"], err.get("ctx") or {}, err.get("input")
    key = _key(loc) + "".join(f"[{i}]" for i in ctx.get("at", ()))
    holder, info = _fields_at(root, loc)
    if kind == "rule":
        prefix = f"{key}." if key else ""
        return re.sub(r"@(?=[A-Za-z_])", prefix, str(ctx["message"])).replace("@ ", f"{key} ")
    if kind == "extra_forbidden":
        return _unknown(key, holder, hint)
    if kind == "too_many":
        return f"{key} lists {ctx['n']:,} items; it takes at most {ctx['most']:,}"
    if kind == "too_many_chars":
        return f"{key} is {ctx['n']:,} characters long; it takes at most {ctx['most']:,}"
    if kind == "int_range":
        return f"{key}={ctx['value']} is out of range; an integer key takes at most {ctx['most']:,}"
    if kind == "finite_number":
        return f"{key}={value} is not a finite number; set {key} to a finite value"
    if kind == "literal_error":
        names = ", ".join(re.findall(r"'([^']*)'", ctx.get("expected", "")))
        return f"{key}={_shown(value)} is not supported; set {key} to one of: {names}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        shown = float(value) if _is_float(info) and isinstance(value, int) else value
        why = next((m.text for m in getattr(info, "metadata", ()) if isinstance(m, Why)), None)
        text = _bound_message(key, _shown(shown), kind, _bounds(info), ctx)
        return f"{text}; {why}" if why else text
    if kind == "missing":
        return f"{key} is required; set it (`laminar config` shows every key)"
    if kind.startswith("union_tag") or kind in ("benchmark", "component"):  # a tagged union's item
        return f"{key}={_shown(value)}: {err['msg']}"
    why = err["msg"][0].lower() + err["msg"][1:]
    if TYPE_ERRORS.search(kind):
        return (
            f"config key '{key}': {why} (got {_shown(value)}); give {key} a value of the type its default has"
        )
    return f"config key '{key}': {why}"


def config_error(err: ValidationError, root: type[BaseModel], hint: str = "`laminar config`") -> ConfigError:
    """The first of pydantic's errors as a :class:`ConfigError` of one line."""
    first = err.errors(include_url=False)[0]
    return ConfigError(message_of(first, root, hint))


def validated(model: Any, data: Any, hint: str = "`laminar config`") -> Any:
    """``model.model_validate(data)``, its first error a one-line :class:`ConfigError`."""
    check = getattr(model, "model_validate", None) or model.validate_python
    try:
        return check(data)
    except ValidationError as err:
        raise config_error(err, model, hint) from None
