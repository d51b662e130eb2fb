"""CSV: one row per tensor with every statistic, the run's facts repeated on each row."""

from __future__ import annotations

import csv
import dataclasses
import io

from ..report import CrossReport, Report, SweepReport, TensorResult


def csv_text(report: Report) -> str:
    """One row per tensor with every statistic; run facts repeated on each row."""
    buffer = io.StringIO()
    tensor_fields = [f.name for f in dataclasses.fields(TensorResult)]
    run_fields = ["case", "framework", "device", "accum_steps", "seed", "inject"]
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(run_fields + tensor_fields)
    for t in report.tensors:
        values = [getattr(report, f) for f in run_fields] + [getattr(t, f) for f in tensor_fields]
        writer.writerow(["x".join(map(str, v)) if isinstance(v, list) else ("" if v is None else v) for v in values])
    return buffer.getvalue()


def csv_rows(report: Report | CrossReport | SweepReport) -> str:
    """Every report's tensor rows under one header (a cross-framework report's agreement lives
    in json and markdown)."""
    reports = [report] if isinstance(report, Report) else report.reports
    return "".join(csv_text(r) if i == 0 else csv_text(r).split("\n", 1)[1] for i, r in enumerate(reports))
