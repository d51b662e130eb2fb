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


class FieldError(TypeError):
    """A report field that does not fit the schema; ``path`` names it (``tensors[0].verdict``, or
    "" for the whole report), ``problem`` says how and ``fix`` (where given) what to do."""

    def __init__(self, path: str, problem: str, fix: str | None = None):
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path, self.problem, self.fix = path, problem, fix


class FieldTypeError(FieldError):
    """A field of the wrong type, missing or unknown: the data is not this kind of report."""


def field_path(path: str, name: str | int) -> str:
    """``path`` one step deeper: a field by name (``.name``), a list item by index (``[0]``); a name
    that is not a plain word is shown as ``key_path`` shows it."""
    if isinstance(name, int):
        return f"{path}[{name}]"
    if not (name.isascii() and name.isidentifier()):
        return key_path(path, name)
    return f"{path}.{name}" if path else name


def key_path(path: str, key: Any) -> str:
    """``path`` into an object's entry ``key``, shown as Python writes it (control characters
    escaped) and cut short."""
    return f"{path}[{repr(key[:50] + '...' if isinstance(key, str) and len(key) > 50 else key)}]"


def decode(cls: type, data: Any, path: str = "") -> Any:
    """An instance of dataclass ``cls`` from ``encode``'s output (found at ``path`` of a report).
    Raises FieldTypeError, naming the field, when the data does not fit the class's types."""
    if not isinstance(data, dict):
        raise FieldTypeError(path, f"{cls.__name__} expects an object, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    unknown = sorted(str(k) for k in set(data) - names)
    if unknown:
        raise FieldTypeError(field_path(path, unknown[0]), f"{cls.__name__} has no field {unknown[0]!r}")
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        more = f", and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FieldTypeError(field_path(path, missing[0]), f"{cls.__name__} lacks field {missing[0]!r}{more}")
    return cls(**{name: _value(hints[name], value, field_path(path, name)) for name, value in data.items()})


def _value(hint: Any, value: Any, path: str) -> Any:
    """``value`` as the field type ``hint`` wants it. Raises FieldTypeError where it does not fit."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value, path) if len(inner) == 1 else value
    if hint is float:
        value = FLOAT_WORDS.get(value, value) if isinstance(value, str) else value
        return _expect(value, (int, float), "a number", path)
    if hint in (int, str, bool):
        return _expect(value, hint, hint.__name__, path)
    if dataclasses.is_dataclass(hint):
        return decode(hint, value, path)
    if origin is list:
        items = _expect(value, list, "a list", path)
        return [_value(args[0], v, field_path(path, i)) for i, v in enumerate(items)] if args else items
    if origin is dict:
        value = _expect(value, dict, "an object", path)
        return {k: _value(args[1], v, key_path(path, k)) for k, v in value.items()} if args else value
    return value


def _expect(value: Any, kinds: Any, what: str, path: str) -> Any:
    if isinstance(value, bool) and kinds is not bool or not isinstance(value, kinds):
        raise FieldTypeError(path, f"expected {what}, got {shown(value)}")
    return value


def shown(value: Any) -> str:
    """``value`` for a message: as Python writes it (control characters escaped), cut short."""
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return f"an object of {len(value)} entries"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value[:80] if isinstance(value, str) else value)
    return text if len(text) <= 80 else text[:76] + " ..."


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
        """This kind of report from ``data``, its types checked (``accumcheck.report.load_report``
        and ``report_from_data`` check its values too). Raises FieldTypeError naming the field that
        does not fit, or TypeError for a schema version this accumcheck does not read."""
        version = data.get("schema_version")
        if version == 1:
            data = legacy.upgrade(data)
        elif version != SCHEMA_VERSION:
            raise TypeError(f"schema_version {version!r} is not one this accumcheck reads (1 to {SCHEMA_VERSION})")
        return decode(cls, data)
