"""The rules a setting's value is read by, the same from the command line, the pytest plugin and
the Python API: each takes the value as given and returns it checked, or raises ValueError saying
what is wrong and what to write instead."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any, Callable

from .choices import FAULT_KINDS, SEED_LIMIT

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
EXAMPLE = "e.g. 512M, 2G, 1.5GiB or 1000000000"


def byte_count(value: Any) -> int:
    """A number of bytes from an integer or a text: 1000000, 512M, 2G, 1.5GiB (K, M, G, T and KiB,
    MiB, GiB, TiB count in 1024s; KB, MB, GB, TB in 1000s). Raises ValueError saying what to write."""
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value == int(value):
        number = int(value)
    elif isinstance(value, str) and (found := _BYTES.match(value)) and found.group(2).lower() in _UNITS:
        count = float(found.group(1)) * _UNITS[found.group(2).lower()]
        number = math.floor(count) if count >= 1024 or count == int(count) else None  # no fractions of a byte
    else:
        number = None
    if number is None or number < 1:
        raise ValueError(f"{value!r} is not a number of bytes ({EXAMPLE})")
    return number


def positive_int(value: Any) -> int:
    number = _int_or_none(value)
    if number is None or number < 1:
        raise ValueError(f"{value!r} is not a positive integer (e.g. 32)")
    return number


def non_negative_int(value: Any) -> int:
    number = _int_or_none(value)
    if number is None or number < 0:
        raise ValueError(f"{value!r} is not a non-negative integer (e.g. 0)")
    return number


def seed_value(value: Any) -> int:
    number = _int_or_none(value)
    if number is None or not 0 <= number < SEED_LIMIT:
        raise ValueError(f"{value!r} is not a seed (an integer from 0 to 2**32 - 1, e.g. 0)")
    return number


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        return int(value)
    return None


def positive_float(value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else -1.0
    except (TypeError, ValueError):
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise ValueError(f"{value!r} is not a positive number (e.g. 1e-3)")
    return number


def text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{value!r} is not a non-empty text")
    return value


def comma_list(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A parser for a comma list whose items ``parse`` takes one by one."""

    def parse_list(value: str) -> list[Any]:
        items = [item.strip() for item in value.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"{value!r} is not a comma list (e.g. 16,32)")
        return [parse(item) for item in items]

    return parse_list


def device_text(value: Any) -> str:
    """cpu, gpu, cuda, gpu:N or cuda:N."""
    kind, _, index = text(value).partition(":")
    if kind not in ("cpu", "gpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"unknown device {value!r}; use cpu, gpu, cuda or cuda:N")
    return value


def device_kind(device: str) -> str:
    """"cpu" or "gpu" (a CUDA device by any of its names)."""
    return "cpu" if device == "cpu" else "gpu"


def framework_names(value: Any) -> tuple[str, ...]:
    """One framework name, or several (a comma text, a list)."""
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(item, str) and item.strip() for item in items):
        raise ValueError(f"{value!r} is not a framework name or a comma list of them (NAME or NAME,NAME)")
    return tuple(item.strip() for item in items)


def case_argument(value: Any) -> Any:
    """A case's name or file (a Case object is taken as it is, before any check)."""
    if isinstance(value, (str, Path)) and str(value):
        return value
    raise ValueError(f"{value!r} is not a case name or a case file")


def fault_text(value: Any) -> Any:
    """KIND[:PARAM] (a Fault object is taken as it is, before any check)."""
    if isinstance(value, str) and value:
        return value
    raise ValueError(f"{value!r} is not a fault (KIND[:PARAM], KIND one of {', '.join(FAULT_KINDS)})")
