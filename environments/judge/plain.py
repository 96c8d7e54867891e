"""Plain data across the sandbox's wall: ``encode`` turns a value of plain Python types into JSON
text's values and ``decode`` turns them back. Standard library only: this file is also shipped into
the sandbox beside the judge's scripts (``environments.judge.scripts``).

Plain types: None, bool, int, float, complex, str, bytes, and list, tuple, dict, set and frozenset
of plain values. A subclass of one (``collections.Counter``, a named tuple, an ``int`` subclass) is
coerced to its base type, so its own ``__eq__`` never reaches a comparison; anything else
(a function, a generator, an object with an always-true ``__eq__``) is ``NotPlain``.

Wire format: None, bool, str, small int and finite float as themselves; a list as a JSON array;
every other type as a one-key object: ``{"t": [...]}`` tuple, ``{"d": [[k, v], ...]}`` dict,
``{"s": [...]}`` set, ``{"fs": [...]}`` frozenset, ``{"i": "0x..."}`` int past 2**53,
``{"f": "inf"}`` non-finite float, ``{"c": [re, im]}`` complex, ``{"b": "hex"}`` bytes."""

from __future__ import annotations

import math

MAX_DEPTH = 64
"""Deepest nesting ``encode`` and ``decode`` accept (a deeper value is not plain data)."""
BIG = 2**53


class NotPlain(ValueError):
    """A value that is not plain data; ``reason``: its type's name (or ``too_deep``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode(x, depth: int = 0):
    """``x`` as JSON-able values (module docstring); raises ``NotPlain``."""
    if depth > MAX_DEPTH:
        raise NotPlain("too_deep")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if -BIG < x < BIG else {"i": hex(x)}
    if t is float:
        return x if math.isfinite(x) else {"f": repr(x)}
    if t is list:
        return [encode(v, depth + 1) for v in x]
    if t is tuple:
        return {"t": [encode(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [encode(v, depth + 1) for v in x]}
    if t is complex:
        return {"c": [encode(x.real, depth + 1), encode(x.imag, depth + 1)]}
    if t is bytes:
        return {"b": x.hex()}
    return encode(_coerce(x), depth)


def _coerce(x):
    """A subclass of a plain type as a value of the base type, read through the base's own methods."""
    for base in (bool, int, float, complex, str, bytes):
        if isinstance(x, base):
            return base(x) if base is not int else int.__index__(x)
    if isinstance(x, dict):
        return {k: v for k, v in dict.items(x)}
    for base in (list, tuple, set, frozenset):
        if isinstance(x, base):
            return base(base.__iter__(x))
    raise NotPlain(type(x).__name__[:40])


TAGS = {
    "t": lambda v, d: tuple(decode(e, d) for e in _items(v)),
    "s": lambda v, d: {decode(e, d) for e in _items(v)},
    "fs": lambda v, d: frozenset(decode(e, d) for e in _items(v)),
    "d": lambda v, d: {decode(k, d): decode(e, d) for k, e in _pairs(v)},
    "i": lambda v, d: int(_text(v), 16),
    "f": lambda v, d: float(_nonfinite(v)),
    "c": lambda v, d: complex(*(float(decode(e, d)) for e in _items(v, 2))),
    "b": lambda v, d: bytes.fromhex(_text(v)),
}


def decode(j, depth: int = 0):
    """The value ``encode`` wrote as ``j`` (parsed JSON); raises ``ValueError`` on anything else."""
    if depth > MAX_DEPTH:
        raise ValueError("plain data nested too deep")
    t = type(j)
    if j is None or t is bool or t is str or t is int:
        return j
    if t is float:
        return j if math.isfinite(j) else _bad(j)
    if t is list:
        return [decode(e, depth + 1) for e in j]
    if t is dict and len(j) == 1:
        ((tag, v),) = j.items()
        if tag in TAGS:
            try:
                return TAGS[tag](v, depth + 1)
            except TypeError as e:  # an unhashable key or member
                raise ValueError(f"bad plain data: {e}") from None
    return _bad(j)


def _items(v, n: int | None = None) -> list:
    if type(v) is not list or (n is not None and len(v) != n):
        _bad(v)
    return v


def _pairs(v) -> list:
    return [p for p in _items(v) if _items(p, 2)]


def _text(v) -> str:
    return v if type(v) is str and len(v) < 100_000 else _bad(v)


def _nonfinite(v) -> str:
    return v if v in ("inf", "-inf", "nan") else _bad(v)


def _bad(j):
    raise ValueError(f"not plain data: {str(j)[:60]!r}")
