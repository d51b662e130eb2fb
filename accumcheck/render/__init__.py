"""Renderers: every report kind as a terminal table (rich), markdown, CSV, JSON or one HTML file,
and its pictures (matplotlib). Rendering never computes: every figure comes from the report.

``text`` holds the plain lines the others share; ``table``, ``markdown``, ``csvfile``, ``html`` and
``plots`` draw them.
"""

from __future__ import annotations

from typing import Any

from ..report import CrossReport, Report, ReportDiff, SweepReport
from .csvfile import csv_rows
from .html import html_report
from .markdown import cross_markdown, diff_markdown, markdown, sweep_markdown
from .table import render_console, table_text

FORMATS = ("table", "json", "markdown", "csv", "html")
_MARKDOWN = {Report: markdown, CrossReport: cross_markdown, SweepReport: sweep_markdown, ReportDiff: diff_markdown}


def render(report: Any, fmt: str) -> str:
    """The report (of any kind) as text in ``fmt``, one of FORMATS."""
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
