"""Nested mappings as flat ones: the one flattener every layer uses (config keys, metric names)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(tree: Mapping[str, Any], sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """The leaves of ``tree`` keyed by their path (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``); an empty
    mapping has no leaves. ``prefix`` is put before every key, joined with ``sep``."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, sep, key))
        else:
            out[key] = v
    return out
