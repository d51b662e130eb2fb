"""CSV: one row per tensor with every statistic, the run's facts repeated on each row; every text
from the report with its control characters escaped (``names.shown``)."""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Any

from ..report import Cause, CrossReport, Report, SweepReport, TensorResult
from .names import shown

# A tensor's cause is a record of its own: its fields are columns of their own, cause_kind, cause_words, ...
CAUSE_FIELDS = [f.name for f in dataclasses.fields(Cause)]


def _cell(value: Any, joiner: str = "x") -> Any:
    if value is None:
        return ""
    return joiner.join(map(str, value)) if isinstance(value, list) else value


def csv_text(report: Report, agreement: dict[tuple[str, str], list[Any]] | None = None) -> str:
    """One row per tensor with every statistic; run facts repeated on each row. ``agreement``
    (a cross-framework report's): AGREEMENT_FIELDS' values by (framework, tensor), as columns."""
    report = shown(report)
    buffer = io.StringIO()
    tensor_fields = [f.name for f in dataclasses.fields(TensorResult) if f.name != "cause"]
    run_fields = ["case", "framework", "device", "accum_steps", "seed", "inject"]
    extra = AGREEMENT_FIELDS if agreement is not None else []
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(run_fields + tensor_fields + [f"cause_{name}" for name in CAUSE_FIELDS] + extra)
    for t in report.tensors:
        values = [getattr(report, f) for f in run_fields] + [getattr(t, f) for f in tensor_fields]
        causes = [_cell(getattr(t.cause, name, None), "; ") for name in CAUSE_FIELDS]
        agrees = agreement.get((report.framework, t.name), [""] * len(extra)) if agreement is not None else []
        writer.writerow([_cell(v) for v in values] + causes + [_cell(v) for v in agrees])
    return buffer.getvalue()


# A cross-framework report's rows also say how each framework's manual sum agrees with the
# others': the worst pair that includes it (its verdict, ratio to the agreement bound and the
# other framework) and the framework that alone disagrees with all the others, if one does.
AGREEMENT_FIELDS = ["agreement_verdict", "agreement_ratio", "agreement_worst_with", "odd_one_out"]


def _agreement_columns(report: CrossReport) -> dict[tuple[str, str], list[Any]]:
    """AGREEMENT_FIELDS' values by (framework, tensor)."""
    worst: dict[tuple[str, str], tuple[float, str, str]] = {}
    for record, pair in zip(report.agreement, report.pairs()):
        for framework, other in (pair, pair[::-1]):
            key = (framework, record.name)
            ratio = record.ratio if record.verdict != "non-finite" else float("inf")
            if key not in worst or ratio > worst[key][0]:
                worst[key] = (ratio, record.verdict, other)
    odd = {o.name: o.framework or "none singled out" for o in report.odd_one_out}
    return {key: [verdict, ratio, other, odd.get(key[1], "")] for key, (ratio, verdict, other) in worst.items()}


def csv_rows(report: Report | CrossReport | SweepReport) -> str:
    """Every report's tensor rows under one header; a cross-framework report's rows with its
    agreement columns."""
    report = shown(report)
    reports = [report] if isinstance(report, Report) else report.reports
    agreement = _agreement_columns(report) if isinstance(report, CrossReport) else None
    return "".join(csv_text(r, agreement) if i == 0 else csv_text(r, agreement).split("\n", 1)[1]
                   for i, r in enumerate(reports))
