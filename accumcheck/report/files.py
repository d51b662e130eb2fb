"""Report files: read any report kind (of this schema or an older one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import AccumcheckError
from ..files import MAX_REPORT_BYTES, read_text
from . import schema
from .cross import CrossReport
from .single import Report
from .stack import StackReport
from .sweep import SweepReport
from .trajectory import TrajectoryReport
from .values import SCHEMA_VERSION, FieldError, FieldTypeError, shown

KINDS: dict[str, type] = {"report": Report, "cross": CrossReport, "sweep": SweepReport, "trajectory": TrajectoryReport,
         "stack": StackReport}
_NAMES = {"report": "", "cross": " cross-framework", "sweep": " sweep", "trajectory": " trajectory", "stack": " training-stack"}


def report_from_data(data: Any, source: str = "<report>") -> Any:
    """The report ``data`` (a JSON object) holds, of whichever kind it names, every field checked
    against the schema (``accumcheck.report.schema``). Reports of schema version 1 (accumcheck
    0.1.0) are upgraded. Raises AccumcheckError, naming the field, when it is none."""
    if not isinstance(data, dict):
        raise AccumcheckError(f"{source}: not an accumcheck report (top level is not an object)")
    version = data.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:
        raise AccumcheckError(f"{source}: report schema_version {version} is not supported by this accumcheck, which "
                              f"reads up to {SCHEMA_VERSION}: the report was written by a newer accumcheck; upgrade "
                              "accumcheck to read it (pip install --upgrade accumcheck)")
    if type(version) is not int or version not in (1, SCHEMA_VERSION):
        raise AccumcheckError(f"{source}: report schema_version {shown(version)} is not supported "
                              f"(this accumcheck reads versions 1 and {SCHEMA_VERSION}); "
                              "re-run the comparison with this version")
    kind = data.get("kind", "report")
    if not isinstance(kind, str) or kind not in KINDS:
        raise AccumcheckError(f"{source}: unknown report kind {shown(kind)} (known: {', '.join(KINDS)}); "
                              f"{schema.NEWER}")
    try:
        schema.check_data(data)
        report = KINDS[kind].from_dict(data, source)
    except FieldTypeError as exc:
        raise AccumcheckError(f"{source}: {exc.path + ': ' if exc.path else ''}not an accumcheck{_NAMES[kind]} "
                              f"report ({exc.problem})") from None
    except FieldError as exc:
        raise AccumcheckError(f"{source}: {exc}; {exc.fix or schema.FIX}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise AccumcheckError(f"{source}: not an accumcheck{_NAMES[kind]} report ({shown(str(exc))[1:-1]})") from None
    empty = _emptiness(report)
    if empty:
        raise AccumcheckError(f"{source}: an empty{_NAMES[kind]} report ({empty}); nothing was judged, so there is "
                              "no verdict to show: rerun the comparison")
    try:
        schema.check(report)
    except FieldError as exc:
        raise AccumcheckError(f"{source}: {exc}; {exc.fix or schema.FIX}") from None
    return report


def _emptiness(report: Any) -> str | None:
    """What an empty report lacks (a comparison always judges at least one tensor), or None."""
    if isinstance(report, Report):
        return None if report.tensors else "no tensors"
    if isinstance(report, (CrossReport, SweepReport)):
        if not report.reports:
            return "no reports"
        return next(filter(None, map(_emptiness, report.reports)), None)
    if isinstance(report, TrajectoryReport) and (report.steps < 1 or not report.losses):
        return "no optimizer steps"
    if isinstance(report, StackReport) and not report.steps and not report.micro_batches_seen:
        return "no optimizer steps and no micro-batches"
    return None


def load_report(path: str | Path) -> Any:
    """Read a report written with ``--format json`` (any kind), strictly (``report_from_data``).
    Raises AccumcheckError, in one line naming the field where one is to blame, when it cannot."""
    path = Path(path)
    try:
        data = json.loads(read_text(path, "report", MAX_REPORT_BYTES), parse_int=schema.parse_int)
    except RecursionError:
        raise AccumcheckError(f"{path}: nests too deeply to be an accumcheck report; "
                              "pass a report written with --format json") from None
    except json.JSONDecodeError as exc:
        raise AccumcheckError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); "
                              "pass a report written with --format json") from None
    return report_from_data(data, str(path))
