"""The README's first command and a sweep, piped as a user pipes them (through ``cat``, into a CI
log) with COLUMNS set to 80, 100 and 120: every line fits, every tensor name of the default case
stands whole on one line with its verdict beside it, no header or word is cut, and a legend says
what the columns mean."""

import os
import subprocess
import sys

import pytest
from conftest import needs_torch
from rich.cells import cell_len

from accumcheck.case.reading import builtin_cases

WIDTHS = (80, 100, 120)
CASE = "embed-attention"  # the default case
NAMES = [p.name for p in next(c for c in builtin_cases() if c.name == CASE).parameters()]
TABLE_HEADERS = ["tensor", "kind", "shape", "max|g|", "verdict", "ratio", "max|A-B|", "ulps", "tol fails", "cond"]
SWEEP_HEADERS = ["kind", "N", "bound", "√N", "native", "manual", "|A-B|", "flagged"]
LEGEND = ["max|g|:", "ratio:", "max|A-B|:", "ulps:", "tol fails:", "cond:"]


def piped(columns: int, *args: str) -> subprocess.CompletedProcess:
    """The installed console script with its stdout piped, COLUMNS set as a shell exports it."""
    exe = os.path.join(os.path.dirname(sys.executable), "accumcheck")
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          timeout=600)


def check_fits(out: str, columns: int) -> list[str]:
    lines = out.splitlines()
    too_wide = [line for line in lines if cell_len(line) > columns]
    assert not too_wide, f"wider than {columns}: {too_wide}"
    assert "…" not in out  # nothing cut short
    return lines


def header_rows(lines: list[str], first: str) -> list[list[str]]:
    """The header row of each part of a table (a part repeats the names' column)."""
    return [line.split("  ") for line in lines if line.split()[:1] == [first]]


def words_of(rows: list[list[str]]) -> set[str]:
    return {cell.strip() for row in rows for cell in row if cell.strip()}


@needs_torch
@pytest.mark.parametrize("columns", WIDTHS)
def test_compare_fits_the_width_with_every_name_and_verdict_whole(columns):
    result = piped(columns, "compare")
    assert result.returncode == 0, result.stderr
    lines = check_fits(result.stdout, columns)
    assert words_of(header_rows(lines, "tensor")) >= set(TABLE_HEADERS)  # every header, none cut
    for name in NAMES:
        rows = [line.split() for line in lines if name in line.split()]
        assert rows, f"{name} is not whole on any line"
        assert all(row[0] == name for row in rows)  # a row's first cell: the name, unbroken
        assert any("identical" in row for row in rows)  # the verdict word whole, on the name's row
    assert all(entry in " ".join(result.stdout.split()) for entry in LEGEND)  # the legend, wrapped or not
    assert lines[-1] == "OK: all 12 tensors faithful (12 identical)"


@needs_torch
@pytest.mark.parametrize("columns", WIDTHS)
def test_sweep_fits_the_width_with_every_header_and_kind_whole(columns):
    result = piped(columns, "sweep", "--case", CASE, "--accum-steps", "1,2,4")
    assert result.returncode == 0, result.stderr
    lines = check_fits(result.stdout, columns)
    assert words_of(header_rows(lines, "kind")) == set(SWEEP_HEADERS)
    # each kind opens its section on its N = 1 row (kind, N, bound, √N, native, manual, |A-B|, flagged);
    # its N = 2 and 4 rows follow without the kind
    cells = [line.split() for line in lines]
    assert sorted(row[0] for row in cells if len(row) == 8 and row[1] == "1") == ["bias", "embedding", "norm", "weight"]
    assert sorted(row[0] for row in cells if len(row) == 7 and row[0] in ("2", "4")) == ["2"] * 4 + ["4"] * 4
    assert all(entry in " ".join(result.stdout.split()) for entry in ("bound:", "√N:", "native:", "|A-B|:"))
    assert lines[-1] == "OK at every N (1, 2, 4); errors below the bound throughout"
