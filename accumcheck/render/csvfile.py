"""CSV: one row per tensor with every statistic, the run's facts repeated on each row."""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Any

from ..report import Cause, CrossReport, Report, SweepReport, TensorResult

# A tensor's cause is a record of its own: its fields are columns of their own, cause_kind, cause_words, ...
CAUSE_FIELDS = [f.name for f in dataclasses.fields(Cause)]


def _cell(value: Any, joiner: str = "x") -> Any:
    if value is None:
        return ""
    return joiner.join(map(str, value)) if isinstance(value, list) else value


def csv_text(report: Report) -> str:
    """One row per tensor with every statistic; run facts repeated on each row."""
    buffer = io.StringIO()
    tensor_fields = [f.name for f in dataclasses.fields(TensorResult) if f.name != "cause"]
    run_fields = ["case", "framework", "device", "accum_steps", "seed", "inject"]
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(run_fields + tensor_fields + [f"cause_{name}" for name in CAUSE_FIELDS])
    for t in report.tensors:
        values = [getattr(report, f) for f in run_fields] + [getattr(t, f) for f in tensor_fields]
        causes = [_cell(getattr(t.cause, name, None), "; ") for name in CAUSE_FIELDS]
        writer.writerow([_cell(v) for v in values] + causes)
    return buffer.getvalue()


def csv_rows(report: Report | CrossReport | SweepReport) -> str:
    """Every report's tensor rows under one header (a cross-framework report's agreement lives
    in json and markdown)."""
    reports = [report] if isinstance(report, Report) else report.reports
    return "".join(csv_text(r) if i == 0 else csv_text(r).split("\n", 1)[1] for i, r in enumerate(reports))
