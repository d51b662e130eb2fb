"""Names as printed: whatever a report, a case file or a user's model calls a tensor, a case or a
model reaches the reader as visible characters, never as a terminal's instruction.

``printable`` writes every character a terminal would act on or hide (C0 and C1 controls with ESC
and BEL, DEL, bidirectional overrides, zero-width and other format characters, line separators,
unpaired surrogates) as a Python escape, ``\\x1b`` or ``\\u202e``, and doubles the backslash, so two
different names never print alike. ``shown`` gives a copy of a report (of any kind) whose every
string has passed through it: each renderer draws that copy, so no renderer prints a raw name.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TypeVar

T = TypeVar("T")

# Set on the copies ``shown`` makes: a copy passed to another renderer is not escaped twice.
_SHOWN = "_accumcheck_shown"


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch == "\\":
        return "\\\\"
    if ch.isprintable():
        return ch
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every non-printing character written as its Python escape and each backslash
    doubled: visible characters only, and different texts stay different."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(map(_escape, text))


def shown(value: T) -> T:
    """``value`` (a report, a record of one, a list or dict of them) with every string in it
    made ``printable``; a copy, the original untouched. A copy that is already shown is returned
    as it is."""
    if isinstance(value, str):
        return printable(value)  # type: ignore[return-value]
    if isinstance(value, list):
        if value and isinstance(value[0], (int, float)):
            return value  # a row of figures (a heatmap's): nothing to escape
        return [shown(v) for v in value]  # type: ignore[return-value]
    if type(value) is tuple:
        return tuple(shown(v) for v in value)  # type: ignore[return-value]
    if isinstance(value, dict):
        return {shown(k): shown(v) for k, v in value.items()}  # type: ignore[return-value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if vars(value).get(_SHOWN):
            return value
        out = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(out, field.name, shown(getattr(value, field.name)))
        vars(out)[_SHOWN] = True
        return out
    return value


__all__ = ["printable", "shown"]
