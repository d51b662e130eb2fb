"""Renderers: every report kind as a terminal table (rich), markdown, CSV, JSON or one HTML file,
and its pictures (matplotlib). Rendering never computes: every figure comes from the report.

``text`` holds the plain lines the others share; ``table``, ``markdown``, ``csvfile``, ``html`` and
``plots`` draw them. ``names`` makes every name from a report, a case file or a model printable
(control characters escaped) for all of them; ``fit`` lays the terminal's tables out in its width.
"""

from __future__ import annotations

from typing import Any

from ..errors import AccumcheckError
from ..report import CrossReport, Report, ReportDiff, StackReport, SweepReport, TrajectoryReport
from .csvfile import csv_rows
from .html import html_report
from .markdown import cross_markdown, diff_markdown, markdown, stack_markdown, sweep_markdown
from .table import render_console, table_text

FORMATS = ("table", "json", "markdown", "csv", "html")
_MARKDOWN = {Report: markdown, CrossReport: cross_markdown, SweepReport: sweep_markdown, ReportDiff: diff_markdown,
             StackReport: stack_markdown}
# The kinds not drawn in every format, and the formats they are drawn in.
_ONLY = {TrajectoryReport: ("table", "json"), ReportDiff: ("table", "markdown"),
         StackReport: ("table", "json", "markdown")}
_KIND_NAMES = {TrajectoryReport: "a trajectory report", ReportDiff: "a diff", StackReport: "a training-stack report"}


def render(report: Any, fmt: str) -> str:
    """The report (of any kind) as text in ``fmt``, one of FORMATS. Raises AccumcheckError for a
    format this kind of report is not drawn in."""
    only = _ONLY.get(type(report))
    if only is not None and fmt not in only:
        raise AccumcheckError(f"--format {fmt}: {_KIND_NAMES[type(report)]} is written as {' or '.join(only)}; "
                              f"use --format {only[0]}")
    if fmt == "json":
        return report.to_json()
    if fmt == "markdown":
        return _MARKDOWN[type(report)](report)
    if fmt == "csv":
        return csv_rows(report)
    if fmt == "html":
        return html_report(report)
    return table_text(report)


__all__ = ["FORMATS", "render", "render_console", "table_text"]
