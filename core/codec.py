"""One codec for the records that cross processes: typed records in, msgpack bytes or JSON-ready data
out, validated field by field on the way back in.

A record type is a pydantic model (the rollout protocol's messages, ``generation.protocol``) or a
dataclass (``generation.records``: the prompts, requests and trajectories an RL checkpoint holds).
``Codec(T)`` builds T's pydantic ``TypeAdapter`` once; then

- ``encode(obj) -> bytes`` / ``decode(data) -> T``: one msgpack map. Decoding runs no code named by
  the payload (msgpack holds maps, arrays, strings, numbers and bytes; nothing is ever unpickled)
  and validates every field against T: a missing or mistyped field, a bad array or an unknown kind
  raises ``CodecError`` with one line that names the field;
- ``to_plain(obj)`` / ``from_plain(data)``: the same with JSON-ready Python data (dicts, lists), which
  checkpoints write with ``json.dumps``.

Numeric sequences (token ids, log-probs) are declared ``Annotated[tuple[int, ...], Array("<i4")]``: a
tuple of Python numbers in the record, the raw little-endian bytes of that dtype in msgpack (one
``bin`` field; its length is the shape, decoded by ``numpy.frombuffer``, no per-element work), a list
in plain data. Models that derive from ``StrictModel`` are strict (an int field refuses ``True``,
``"3"`` and ``3.0``); msgpack arrays decode as tuples so that strict tuple fields accept them.

Standard library, numpy, msgpack and pydantic only: the vLLM worker's environment imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError, to_json
from pydantic_core import core_schema as cs

T = TypeVar("T")


class CodecError(ValueError):
    """Bytes or data that do not decode into the record type asked for (one line: where and why)."""


class StrictModel(BaseModel):
    """Base of the message models: strict types, immutable, unknown fields ignored (a newer peer may
    add fields)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


class Array:
    """``Annotated`` marker of a 1-D numeric sequence of one dtype (see the module docstring). Decodes
    from raw bytes of the dtype (a whole number of items) or from a list or tuple of numbers (ints
    for an integer dtype; bools are refused)."""

    def __init__(self, dtype: str):
        self.dtype = np.dtype(dtype)
        self.integer = self.dtype.kind in "iu"

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> cs.CoreSchema:
        item = cs.int_schema(strict=True) if self.integer else cs.float_schema(strict=True)
        return cs.union_schema(
            [
                cs.no_info_after_validator_function(self._from_bytes, cs.bytes_schema(strict=True)),
                cs.tuple_schema([item], variadic_item_index=0, strict=False),
            ],
            custom_error_type="array_type",
            custom_error_message=(
                f"must be raw {self.dtype.str} bytes or a list of {'ints' if self.integer else 'numbers'}"
            ),
            serialization=cs.plain_serializer_function_ser_schema(self._serialize, info_arg=True),
        )

    def _from_bytes(self, data: bytes) -> tuple:
        if len(data) % self.dtype.itemsize:
            raise ValueError(f"{len(data)} bytes is not a whole number of {self.dtype.str} items")
        return tuple(np.frombuffer(data, self.dtype).tolist())

    def _serialize(self, value: Any, info: Any) -> Any:
        if info.mode == "json":
            return list(value)
        try:
            return np.asarray(value, dtype=self.dtype).tobytes()
        except (OverflowError, ValueError, TypeError) as e:
            raise ValueError(f"cannot store {type(value).__name__} as {self.dtype.str} array: {e}") from None


_TYPE_NAMES = {
    "int_type": "int",
    "int_parsing": "int",
    "float_type": "float",
    "bool_type": "bool",
    "string_type": "str",
    "bytes_type": "bytes",
    "tuple_type": "a list",
    "list_type": "a list",
    "dict_type": "a map",
    "model_type": "a map",
    "model_attributes_type": "a map",
    "dataclass_type": "a map",
}


def explain(err: ValidationError, what: str, *, tagged: bool = False) -> str:
    """One line from pydantic's errors: ``what: [where: ]missing field 'x'`` or ``field 'x' must be
    int, got str``. ``tagged``: the type is a union discriminated by a field, whose value pydantic
    puts first in each error's location."""
    errors = err.errors(include_url=False)
    e = errors[0]
    loc = [str(x) for x in e["loc"]]
    if tagged and loc:
        what = f"{what} {loc.pop(0)}"
    kind, got = e["type"], type(e.get("input")).__name__
    ctx = e.get("ctx") or {}
    if kind == "union_tag_invalid":
        text = (
            f"unknown {ctx['discriminator'].strip(chr(39))} {ctx['tag']!r}; "
            f"known: {ctx['expected_tags'].replace(chr(39), '')}"
        )
    elif kind == "union_tag_not_found":
        text = f"needs a field {ctx['discriminator']}"
    elif kind == "missing":
        text = f"missing {_label(loc.pop())}"
    elif kind in _TYPE_NAMES:
        text = f"{f'{_label(loc.pop())} ' if loc else ''}must be {_TYPE_NAMES[kind]}, got {got}"
    elif kind == "value_error":  # a model's invariant
        text = str(ctx.get("error", e["msg"]))
    elif loc:
        m = e["msg"]
        text = f"{_label(loc.pop())}{' ' if m.startswith('must ') else ': '}{m[0].lower()}{m[1:]}"
    else:
        text = e["msg"]
    where = f"{'.'.join(loc)}: " if loc else ""
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{what}: {where}{text}{more}"


def _label(name: str) -> str:
    return f"item {name}" if name.isdigit() else f"field {name!r}"


class Codec(Generic[T]):
    """The codec of one record type (see the module docstring). ``exclude``: fields that never travel
    (process-local handles); ``tagged``: T is a union discriminated by a field (error locations)."""

    def __init__(self, tp: Any, *, name: str | None = None, exclude: set | None = None, tagged: bool = False):
        self.adapter = TypeAdapter(tp)
        self.name = name or getattr(tp, "__name__", str(tp))
        self.exclude = exclude
        self.tagged = tagged
        self.dataclass = dataclasses.is_dataclass(tp)

    # -- plain data (JSON-ready)
    def to_plain(self, obj: T) -> Any:
        return self.adapter.dump_python(obj, mode="json", exclude=self.exclude)

    def from_plain(self, data: Any) -> T:
        try:
            if not self.dataclass:
                return self.adapter.validate_python(data)
            try:  # pydantic is strict with a dataclass's fields only when it reads JSON text
                text = to_json(data, inf_nan_mode="constants")
            except PydanticSerializationError as e:
                raise CodecError(f"{self.name}: not JSON-ready data ({e})") from None
            return self.adapter.validate_json(text, strict=True)
        except ValidationError as e:
            raise CodecError(explain(e, self.name, tagged=self.tagged)) from None

    # -- msgpack
    def dump(self, obj: T) -> Any:
        """``obj`` as msgpack-ready data (arrays as bytes)."""
        try:
            return self.adapter.dump_python(obj, exclude=self.exclude)
        except PydanticSerializationError as e:
            raise CodecError(f"cannot encode {self.name}: {str(e).split(': ', 1)[-1]}") from None

    def encode(self, obj: T) -> bytes:
        return pack(self.dump(obj))

    def decode(self, data: bytes) -> T:
        return self.from_plain(unpack(data, self.name))


def pack(data: Any) -> bytes:
    """msgpack bytes of plain data (maps, sequences, str, numbers, bytes, None)."""
    return msgpack.packb(data, use_bin_type=True)


def unpack(data: bytes, what: str = "message") -> Any:
    """The plain data in msgpack bytes (arrays as tuples, map keys strings), or ``CodecError``."""
    try:
        return msgpack.unpackb(data, raw=False, use_list=False)
    except Exception as e:  # noqa: BLE001 - any undecodable payload
        raise CodecError(f"undecodable {what} ({type(e).__name__}: {e})") from None
