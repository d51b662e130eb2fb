"""Tables that fit the console: no header, verdict or number is ever cut, and a row's name is never
split inside a word.

A table is given as columns, each with its cells and a rank. The columns that name a row (``key``)
open every part; the others join the first part in rank order while it fits the width, and those
that do not fit go on in a second part (then a third), each opened by the names again. Only prose
columns (``wrap``: a cause in a few words, a description) wrap, at their spaces. A name longer than
its room is shortened from the middle, keeping its start and its end, with a split that keeps the
names apart. rich lays each part out; this module only chooses what goes where. A command line
wider than the width splits between its options (``command_lines``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

MIN_NAME = 16  # the narrowest a name column is shortened to
ELLIPSIS = "…"


@dataclass
class Col:
    """One column: its header (lines split by a newline), its cells, and where it goes."""

    header: str
    cells: list[Text]
    justify: str = "right"
    rank: int = 5  # lower ranks join the first part first; rank 0 always sits beside the names
    wrap: bool = False  # prose: wraps at its spaces; otherwise each cell stays whole on one line
    key: bool = False  # names the row: opens every part
    group: str = ""  # the columns of one group go into the same part

    def natural(self) -> int:
        """The width that shows every cell on one line."""
        return max([cell_len(line) for text in (Text(self.header), *self.cells) for line in text.plain.split("\n")])

    def narrowest(self) -> int:
        """The width it can take without cutting a word (prose) or a cell (the rest)."""
        if not self.wrap:
            return self.natural()
        words = [w for text in (Text(self.header), *self.cells) for w in text.plain.split()]
        return max([cell_len(w) for w in words], default=1)


def _head(text: str, cells: int) -> str:
    out, used = [], 0
    for ch in text:
        used += cell_len(ch)
        if used > cells:
            break
        out.append(ch)
    return "".join(out)


def _tail(text: str, cells: int) -> str:
    return _head(text[::-1], cells)[::-1]


def _cut(names: Sequence[str], width: int) -> list[str] | None:
    """Each name longer than ``width`` cells cut to its start, an ellipsis and its end, the cut
    placed (the middle preferred) where it keeps different names different; None where no place does."""
    room = max(width - 1, 2)
    middle = room // 2
    distinct = len(set(names))
    for head in sorted(range(1, room), key=lambda h: (abs(h - middle), -h)):
        cut = [n if cell_len(n) <= width else _head(n, head) + ELLIPSIS + _tail(n, room - head) for n in names]
        if len(set(cut)) == distinct:
            return cut
    return None


def shorten(names: Sequence[str], width: int) -> list[str]:
    """The names shortened from the middle to ``width`` cells, or to the fewest cells past it at
    which the names stay different from each other (two names are never shown alike)."""
    longest = max(map(cell_len, names), default=0)
    for cells in range(width, longest):
        cut = _cut(names, cells)
        if cut is not None:
            return cut
    return list(names)


def _shortened(col: Col, width: int) -> Col:
    names = shorten([c.plain for c in col.cells], width)
    cells = [cell if cell.plain == name else Text(name, style=cell.style) for cell, name in zip(col.cells, names)]
    return Col(col.header, cells, col.justify, col.rank, col.wrap, col.key, col.group)


@dataclass
class Layout:
    """How a table's parts are made: an empty table with its look (``make(part)``), the rows'
    styles, and the rows after which a section ends."""

    make: Callable[[int], Table]
    row_styles: list[str] = field(default_factory=list)
    sections: set[int] = field(default_factory=set)
    _extra: dict[int, int] = field(default_factory=dict, repr=False)

    def extra(self, columns: int) -> int:
        """The width a part's padding, edges and separators take beside its columns' content, as
        rich measures a part of ``columns`` columns one cell wide."""
        if columns not in self._extra:
            probe = self.make(1)
            for _ in range(columns):
                probe.add_column(width=1)
            console = Console(width=10_000, file=io.StringIO())
            self._extra[columns] = Measurement.get(console, console.options, probe).maximum - columns
        return self._extra[columns]

    def width(self, columns: Sequence[Col]) -> int:
        """The narrowest these columns fit in, nothing cut."""
        return sum(c.narrowest() for c in columns) + self.extra(len(columns))

    def table(self, part: int, columns: Sequence[Col]) -> Table:
        table = self.make(part)
        for c in columns:
            # min_width: rich never narrows a column below its content (prose: its longest word);
            # the header escaped: a framework's name in it is not markup
            table.add_column(escape(c.header), justify=c.justify, no_wrap=not c.wrap, min_width=c.narrowest(),
                             overflow="fold")
        rows = len(columns[0].cells) if columns else 0
        for i in range(rows):
            style = self.row_styles[i] if i < len(self.row_styles) else ""
            table.add_row(*(c.cells[i] for c in columns), style=style, end_section=i in self.sections)
        return table


def fitted(columns: Sequence[Col], width: int | None, layout: Layout) -> list[Table]:
    """The table in as many parts as ``width`` needs (one when None: every column)."""
    columns = list(columns)
    if width is None:
        return [layout.table(0, columns)]
    keys = [c for c in columns if c.key]
    others = [c for c in columns if not c.key]
    units: list[list[Col]] = []
    for c in sorted(others, key=lambda c: c.rank):
        same = next((u for u in units if c.group and u[0].group == c.group), None)
        if same is not None:
            same.append(c)
        else:
            units.append([c])
    essential = [c for c in others if c.rank == 0]
    if keys:  # the names give way first: shortened until they fit beside the essential columns
        room = width - (layout.width(keys + essential) - keys[0].narrowest())
        if room < keys[0].natural():
            keys[0] = _shortened(keys[0], max(room, MIN_NAME))
    parts: list[list[Col]] = []
    while units:
        chosen: list[Col] = []
        for unit in list(units):
            if not chosen or layout.width(keys + chosen + unit) <= width:
                chosen += unit
                units.remove(unit)
        parts.append(chosen)
    order = {id(c): i for i, c in enumerate(columns)}
    keyed = [keys + sorted(part, key=lambda c: order.get(id(c), 0)) for part in parts] or [keys]
    return [layout.table(i, part) for i, part in enumerate(keyed)]


def command_lines(line: str, width: int) -> list[str]:
    """A line ending on an ``accumcheck`` command, split between its options with a shell's line
    continuation where it is wider than ``width``: copied whole, it still runs."""
    at = line.find("accumcheck ")
    if len(line) <= width or at < 0 or "(" in line[at:]:
        return [line]
    units: list[str] = []
    for word in line[at:].split(" "):
        if word.startswith("--") or not units:
            units.append(word)
        else:
            units[-1] += " " + word
    lines, current = [], line[:at] + units[0]
    for unit in units[1:]:
        if len(current) + 1 + len(unit) + 2 <= width:
            current += " " + unit
        else:
            lines.append(current + " \\")
            current = "    " + unit
    return lines + [current]


__all__ = ["Col", "Layout", "command_lines", "fitted", "shorten"]
