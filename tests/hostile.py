"""The two ways a hostile input may end, shared by every tests/e2e/test_hostile_*.py table.

A row ends in exit code 2 with exactly one line on stderr naming what was wrong (no traceback),
or in its documented verdict (0 faithful, 1 flagged, with the summary line). Nothing may exit 1
without a verdict, 0 without a judgement, or 3 (an internal error).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refused:
    """Exit 2, one line on stderr containing ``fragment``."""

    fragment: str


@dataclass(frozen=True)
class Verdict:
    """Exit ``code`` (0 or 1) with ``summary`` in the printed report."""

    code: int
    summary: str


def assert_outcome(expected: Refused | Verdict, code: int, out: str, err: str) -> None:
    """The row's exit code, stdout and stderr end as ``expected`` says."""
    assert "Traceback" not in out + err, (code, out, err)
    if isinstance(expected, Refused):
        assert code == 2, (code, out, err)
        assert len(err.strip().splitlines()) == 1, err
        assert expected.fragment in err, err
    else:
        assert code == expected.code, (code, out, err)
        assert expected.summary in out, out
        assert code in (0, 1)
