"""The one JSON codec every report kind shares: dataclasses to plain data and back.

JSON has no inf or nan: they travel as the strings "inf", "-inf" and "nan", and come back as
floats wherever the field is typed float. Nested dataclasses, lists and dicts of them are rebuilt
from the field types, so a report class needs no reading code of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from typing import Any, Callable

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


# A place in a report while it is read, spelled out only for a message (``path_text``): None for the
# whole report, else (the place holding it, its field name or list index, whether it is an object's
# entry by key).
Where = tuple[Any, Any, bool] | None


def path_text(where: Where) -> str:
    """``where`` as a path: ``tensors[0].verdict``, ``losses['native'][2]``."""
    steps = []
    while where is not None:
        where, name, entry = where
        steps.append((name, entry))
    text = ""
    for name, entry in reversed(steps):
        text = key_path(text, name) if entry or not isinstance(name, (str, int)) else field_path(text, name)
    return text


def decode(cls: type, data: Any, where: Where = None) -> Any:
    """An instance of dataclass ``cls`` from ``encode``'s output (found at ``where`` in a report).
    Raises FieldTypeError, naming the field, when the data does not fit the class's types."""
    if not isinstance(data, dict):
        raise FieldTypeError(path_text(where), f"{cls.__name__} expects an object, got {shown(data)}")
    hints, names, required = _fields(cls)
    if not names.issuperset(data) or not all(name in data for name in required):
        unknown = sorted(str(k) for k in set(data) - names)
        if unknown:
            raise FieldTypeError(path_text((where, unknown[0], False)),
                                 f"{cls.__name__} has no field {unknown[0]!r}")
        missing = [name for name in required if name not in data]
        more = f", and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise FieldTypeError(path_text((where, missing[0], False)),
                             f"{cls.__name__} lacks field {missing[0]!r}{more}")
    return cls(**{name: hints[name](value, (where, name, False)) for name, value in data.items()})


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], frozenset[str], tuple[str, ...]]:
    """A dataclass's reader per field (from its type hint), its field names, and the required ones."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    required = tuple(f.name for f in fields if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    return {f.name: _reader(hints[f.name]) for f in fields}, frozenset(f.name for f in fields), required


Reader = Callable[[Any, Where], Any]


@functools.cache
def _reader(hint: Any) -> Reader:
    """A function that reads a value as the field type ``hint`` wants it, raising FieldTypeError
    where it does not fit; made once per type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            return lambda value, where: value
        read = _reader(inner[0])
        return lambda value, where: None if value is None else read(value, where)
    if hint is float:
        return _float
    if hint in (int, str, bool):
        return lambda value, where: _expect(value, hint, hint.__name__, where)
    if dataclasses.is_dataclass(hint):
        return lambda value, where: decode(hint, value, where)
    if origin is list and args:
        item = _reader(args[0])
        return lambda value, where: [item(v, (where, i, False)) for i, v in enumerate(_expect(value, list, "a list",
                                                                                               where))]
    if origin is list:
        return lambda value, where: _expect(value, list, "a list", where)
    if origin is dict and args and args[1] is not Any:
        entry = _reader(args[1])
        return lambda value, where: {k: entry(v, (where, k, True))
                                     for k, v in _expect(value, dict, "an object", where).items()}
    if origin is dict:
        return lambda value, where: dict(_expect(value, dict, "an object", where))
    return lambda value, where: value


def _float(value: Any, where: Where) -> Any:
    if type(value) is float:
        return value
    value = FLOAT_WORDS.get(value, value) if isinstance(value, str) else value
    return _expect(value, (int, float), "a number", where)


def _expect(value: Any, kinds: Any, what: str, where: Where) -> Any:
    if isinstance(value, bool) and kinds is not bool or not isinstance(value, kinds):
        raise FieldTypeError(path_text(where), f"expected {what}, got {shown(value)}")
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
