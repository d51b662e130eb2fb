"""``accumcheck sweep``: the same comparison at several N, and how the errors grow with N."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Sequence

from .report import Report, _encode


@dataclass
class SweepReport:
    """One Report per number of accumulation steps, in the order run."""

    reports: list[Report]
    kind: str = "sweep"
    schema_version: int = 1

    @property
    def exit_code(self) -> int:
        return max((r.exit_code for r in self.reports), default=0)

    @property
    def flagged(self) -> list[tuple[int, str]]:
        return [(r.accum_steps, t.name) for r in self.reports for t in r.flagged]

    def rows(self) -> list[dict[str, Any]]:
        from .plots import growth_rows

        return growth_rows(self.reports)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["reports"] = [r.to_dict() for r in self.reports]
        data["growth"] = self.rows()
        return _encode(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<report>") -> "SweepReport":
        return cls(reports=[Report.from_dict(r, source) for r in data["reports"]])


def sweep(case: Any, steps: Sequence[int], **options: Any) -> SweepReport:
    """``accumcheck.compare(case, accum_steps=N, **options)`` for each N in ``steps``. A
    double-step fault needs a running total, so at N = 1 it runs without it (the report says so)."""
    from .api import compare

    reports = []
    for n in steps:
        run_options = dict(options)
        skipped = n < 2 and str(run_options.get("inject") or "").startswith("double-step")
        if skipped:
            run_options["inject"] = None
        report = compare(case, accum_steps=n, **run_options)
        if skipped:
            report.settings["inject_skipped"] = f"{options['inject']}: no running total at N = 1"
        reports.append(report)
    return SweepReport(reports)
