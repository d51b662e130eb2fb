"""The one JSON codec every report kind shares: dataclasses to plain data and back.

JSON has no inf or nan: they travel as the strings "inf", "-inf" and "nan", and come back as
floats wherever the field is typed float. Nested dataclasses, lists and dicts of them are rebuilt
from the field types, so a report class needs no reading code of its own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any

from . import legacy

FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
SCHEMA_VERSION = 2


def encode(obj: Any) -> Any:
    """Plain JSON-ready data: dataclasses as dicts, tuples as lists, inf and nan as words."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj


def decode(cls: type, data: Any) -> Any:
    """An instance of dataclass ``cls`` from ``encode``'s output. Raises TypeError or KeyError
    when the data does not fit the class."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} expects an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    return cls(**{name: _value(hints[name], value) for name, value in data.items()})


def _value(hint: Any, value: Any) -> Any:
    """``value`` as the field type ``hint`` wants it. Raises TypeError where it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value) if len(inner) == 1 else value
    if hint is float:
        value = FLOAT_WORDS.get(value, value) if isinstance(value, str) else value
        return _expect(value, (int, float), "a number")
    if hint in (int, str, bool):
        return _expect(value, hint, hint.__name__)
    if dataclasses.is_dataclass(hint):
        return decode(hint, value)
    if origin is list:
        return [_value(args[0], v) for v in _expect(value, list, "a list")] if args else _expect(value, list, "a list")
    if origin is dict:
        value = _expect(value, dict, "an object")
        return {k: _value(args[1], v) for k, v in value.items()} if args else value
    return value


def _expect(value: Any, kinds: Any, what: str) -> Any:
    if isinstance(value, bool) and kinds is not bool or not isinstance(value, kinds):
        raise TypeError(f"expected {what}, got {value!r}"[:200])
    return value


class Serialised:
    """A report kind's JSON: ``to_dict``, ``to_json`` and ``from_dict`` (which reads this schema
    version and, upgraded, version 1)."""

    kind: str
    schema_version: int

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<report>") -> Any:
        """Raises TypeError or KeyError when ``data`` is not this kind of report, or of a schema
        version this accumcheck does not read."""
        version = data.get("schema_version")
        if version == 1:
            data = legacy.upgrade(data)
        elif version != SCHEMA_VERSION:
            raise TypeError(f"schema_version {version!r} is not one this accumcheck reads (1, {SCHEMA_VERSION})")
        return decode(cls, data)
