"""Plug-ins by import path: one mechanism for built-ins and a user's own code.

A plug-in is named in config as ``target: "package.module:attr"`` (``attr`` may be dotted:
``module:Class.factory``). A built-in is the same thing under a short name: each kind of plug-in
(reward components, environments, losses, verdicts) keeps its own table of short name -> target, and
a package may add names to a kind through the entry-point group ``laminar.<kind>``
(``[project.entry-points."laminar.rewards"] brevity = "my_pkg.rewards:brevity"``).

A plug-in declares its parameters with a ``Params`` attribute (a pydantic model or a dataclass); the
``params`` mapping given in config is validated into it, unknown keys refused. Everything that goes
wrong is a :class:`PluginError` whose message is one line naming the target.

The file a target lives in is part of the cache key of every stage that uses it and is named in
lineage with its sha256 (:func:`source_record`), so editing a plug-in reruns exactly those stages.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib
import importlib.metadata
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TARGET = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
"""``package.module:attr``: dotted identifiers either side of one colon."""


class PluginError(ValueError):
    """A plug-in that cannot be named, imported, called or configured; the message is one line that
    names the target and says what to change."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def is_target(name: str) -> bool:
    """Whether ``name`` is spelled as an import path (``module:attr``) rather than a short name."""
    return isinstance(name, str) and ":" in name


def check_target(spec: str) -> tuple[str, str]:
    """``(module, attr)`` of a well-formed target, else a ``PluginError`` naming it."""
    if not isinstance(spec, str) or not TARGET.match(spec):
        raise PluginError(f"plug-in target {spec!r} is not an import path: spell it 'package.module:attr'")
    module, attr = spec.split(":")
    return module, attr


def entry_points(kind: str) -> dict[str, str]:
    """Short name -> target that installed packages add to ``kind`` (group ``laminar.<kind>``)."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=f"laminar.{kind}")}


def resolve_name(kind: str, name: str, builtins: Mapping[str, str]) -> str:
    """The target ``name`` stands for: itself when it is an import path, else the built-in or
    entry-point short name. An unknown short name is a ``PluginError`` listing the known ones (with
    the closest first)."""
    if is_target(name):
        check_target(name)
        return name
    known = {**entry_points(kind), **builtins}
    if name in known:
        return known[name]
    close = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise PluginError(
        f"unknown {kind} {name!r}{hint}: choose one of {', '.join(sorted(known))}, "
        "or name your own as 'package.module:attr'"
    )


def load(spec: str) -> Any:
    """The object ``spec`` (``module:attr``) names, imported; a ``PluginError`` naming it when the
    module cannot be imported (with the import's own error) or has no such attribute."""
    module_name, attr = check_target(spec)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure of user code is reported in one line
        raise PluginError(f"plug-in {spec!r} cannot be imported: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"plug-in {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def source_file(spec: str) -> Path | None:
    """The file that defines ``spec``'s module (None for a built-in module without a file)."""
    module_name, _ = check_target(spec)
    module = sys.modules.get(module_name)
    if module is None:
        load(spec)
        module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    return Path(path).resolve() if path else None


def source_record(spec: str) -> dict[str, str]:
    """``{target, path, sha256}`` of the file ``spec`` lives in: what a stage's cache key and the
    lineage record of a plug-in hold. The hash is of the file's bytes as they are now."""
    path = source_file(spec)
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path and path.is_file() else ""
    return {"target": spec, "path": str(path) if path else "", "sha256": digest}


def params_model(obj: Any) -> type | None:
    """The parameters model ``obj`` declares (its ``Params`` attribute), or None."""
    return getattr(obj, "Params", None)


def validate_params(spec: str, obj: Any, params: Mapping[str, Any] | None) -> Any:
    """``params`` validated into ``obj``'s declared ``Params`` (a pydantic model or a dataclass);
    None when it declares none and none are given. Unknown keys, wrong types and the model's own
    rules are a ``PluginError`` naming the target and the field."""
    params = dict(params or {})
    model = params_model(obj)
    if model is None:
        if params:
            raise PluginError(
                f"plug-in {spec!r} declares no Params, yet params {sorted(params)} were given: "
                "add a Params model to it or drop them"
            )
        return None
    if dataclasses.is_dataclass(model):
        known = {f.name for f in dataclasses.fields(model)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise PluginError(f"plug-in {spec!r}: unknown params {unknown}; it takes {sorted(known)}")
        try:
            return model(**params)
        except (TypeError, ValueError) as e:
            raise PluginError(f"plug-in {spec!r}: bad params: {e}") from None
    validate = getattr(model, "model_validate", None)
    if validate is None:
        raise PluginError(f"plug-in {spec!r}: Params must be a pydantic model or a dataclass")
    from pydantic import ValidationError

    try:
        forbid = model.model_config.get("extra") in (None, "ignore")
        if forbid:
            unknown = sorted(set(params) - set(model.model_fields))
            if unknown:
                raise PluginError(
                    f"plug-in {spec!r}: unknown params {unknown}; it takes {sorted(model.model_fields)}"
                )
        return validate(params)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "params"
        raise PluginError(f"plug-in {spec!r}: params.{where}: {first.get('msg')}") from None


def check_callable(
    spec: str, obj: Any, arity: int | None = None, *, is_async: bool | None = None
) -> Callable:
    """``obj`` when it is callable (with ``arity`` positional parameters, when given, and a
    coroutine function or not, when ``is_async`` says), else a ``PluginError`` naming ``spec``."""
    if not callable(obj):
        raise PluginError(f"plug-in {spec!r} is a {type(obj).__name__}, not something callable")
    if is_async is not None and inspect.iscoroutinefunction(obj) != is_async:
        want = "an async def" if is_async else "a plain (not async) function"
        raise PluginError(f"plug-in {spec!r} must be {want}")
    if arity is not None:
        try:
            inspect.signature(obj).bind(*([None] * arity))
        except TypeError:
            raise PluginError(
                f"plug-in {spec!r} has the wrong signature {inspect.signature(obj)}: it is called "
                f"with {arity} positional argument(s)"
            ) from None
        except ValueError:  # no signature (a builtin): let the call decide
            pass
    return obj
