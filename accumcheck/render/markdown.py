"""GitHub-flavoured markdown for every report kind (a CI job summary, a bug report). Names are
printed through ``names.shown`` and set in code spans that their own backticks and bars cannot end."""

from __future__ import annotations

import re

from ..report import CrossReport, Report, ReportDiff, StackReport, SweepReport
from .names import shown
from .stackwords import STACK_COLUMNS, stack_header_lines, stack_rows
from .wording import (
    cause_words,
    cross_summary,
    describe,
    diff_extra_lines,
    diff_summary,
    forward_lines,
    has_causes,
    header_lines,
    noteworthy,
    num,
    shape_text,
    summary_line,
    sweep_summary,
    tensor_details,
)


def _code(text: str) -> str:
    """``text`` as a code span in a table cell: fenced by more backticks than it holds in a row, its
    bars escaped (a table's cells end at a bar, even in code)."""
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _block(lines: list[str]) -> list[str]:
    """Lines in a fenced block that no line of theirs can close."""
    fence = "`" * max(3, max((len(run) + 1 for line in lines for run in re.findall("`+", line)), default=3))
    return [fence, *lines, fence]


def markdown(report: Report) -> str:
    """A GitHub-flavoured markdown report: header, table, flagged details, summary."""
    report = shown(report)
    out = [f"## accumcheck: {report.case} ({report.framework}, {report.device}, N = {report.accum_steps})", ""]
    out += [f"- {line}" for line in header_lines(report)] + [""]
    causes = has_causes(report)
    cols = ["tensor", "kind", "shape", "max abs grad", "verdict", *(["cause"] if causes else []), "ratio to bound",
            "max abs diff", "ulps", "rtol/atol mismatches", "cond S/abs(E)", "err native", "err manual", "nearer"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---" if c in ("tensor", "kind", "shape", "verdict", "cause", "nearer") else "---:"
                              for c in cols) + "|")
    for t in report.tensors:
        # flagged in bold, suspicious in italics; a cell's own | would end it
        verdict = f"**{t.label}**" if t.flagged else f"*{t.label}*" if t.verdict == "suspicious" else t.label
        row = [_code(t.title), _cell(t.kind), shape_text(t), num(t.max_abs_grad), _cell(verdict),
               *([_cell(cause_words(t))] if causes else []), num(t.ratio), num(t.max_abs_diff),
               num(t.max_ulps), str(t.classic_mismatched), num(t.condition), num(t.err_native), num(t.err_manual),
               t.nearer]
        out.append("| " + " | ".join(row) + " |")
    detailed = noteworthy(report)
    if detailed:
        out += [""] + _block([line for t in detailed for line in tensor_details(t)])
    out += ["", f"**{summary_line(report)}**", ""]
    return "\n".join(out)


def cross_markdown(cross: CrossReport) -> str:
    cross = shown(cross)
    out = [markdown(r) for r in cross.reports]
    out.append(f"## {' vs '.join(cross.frameworks)}: manual accumulations")
    out.append("")
    a, b = cross.frameworks if len(cross.frameworks) == 2 else ("a", "b")
    out.append(f"| tensor | a vs b | kind | verdict | ratio to bound | max abs diff | ulps "
               f"| float32 error {a} | float32 error {b} |")
    out.append("|---|---|---|---|---:|---:|---:|---:|---:|")
    for row, pair in zip(cross.agreement, cross.pairs()):
        verdict = f"**{row.verdict}**" if row.flagged else row.verdict
        out.append(f"| {_code(row.name)} | {_cell(' vs '.join(pair))} | {_cell(row.kind)} | {_cell(verdict)} "
                   f"| {num(row.ratio)} | {num(row.max_abs_diff)} | {num(row.max_ulps)} | {num(row.float32_err_a)} "
                   f"| {num(row.float32_err_b)} |")
    out += [""] + [f"- {line}" for line in forward_lines(cross)] + ["", f"**{cross_summary(cross)}**", ""]
    return "\n".join(out)


def sweep_markdown(sweep: SweepReport) -> str:
    sweep = shown(sweep)
    rows = sweep.rows()
    kinds = sorted({k for row in rows for k in row["kinds"]})
    first = sweep.reports[0]
    out = [f"## accumcheck sweep: {first.case} ({first.framework}, {first.device})", "",
           "Worst error of each tensor kind against the float64 sum E, in units of u·S "
           "(the bound is γ(N−1)/u ≈ N − 1; typical round-off grows like √N).", ""]
    cols = ["N", "bound", "√N"] + [f"{k} {m}" for k in kinds for m in ("native", "manual", "abs(A-B)")] + ["flagged"]
    out.append("| " + " | ".join(cols) + " |")
    out.append("|" + "|".join("---:" for _ in cols[:-1]) + "|---|")
    for row in rows:
        cells = [str(row["N"]), num(row["bound"]), num(row["sqrt_N"])]
        for k in kinds:
            entry = row["kinds"].get(k, {})
            cells += [num(entry.get(m)) for m in ("native", "manual", "difference")]
        out.append("| " + " | ".join(cells + [_cell(", ".join(row["flagged"])) or "-"]) + " |")
    out += ["", f"**{sweep_summary(sweep)}**", ""]
    return "\n".join(out)


def diff_markdown(diff: ReportDiff) -> str:
    diff = shown(diff)
    out = [f"- A: {diff.names[0]}: {describe(diff.a)}", f"- B: {diff.names[1]}: {describe(diff.b)}", "",
           "| tensor | kind | verdict A | verdict B | ratio A | ratio B |", "|---|---|---|---|---:|---:|"]
    for c in diff.common:
        mark = "**" if c.changed else ""
        verdicts = " | ".join(f"{mark}{_cell(v)}{mark}" for v in (c.verdict_a, c.verdict_b))
        out.append(f"| {_code(c.name)} | {_cell(c.kind)} | {verdicts} | {num(c.ratio_a)} | {num(c.ratio_b)} |")
    return "\n".join(out + [""] + [f"- {e}" for e in diff_extra_lines(diff)] + ["", f"**{diff_summary(diff)}**", ""])


def stack_markdown(report: StackReport) -> str:
    """A training stack's check as markdown: its facts, one row an optimizer step, the summary."""
    report = shown(report)
    out = [f"## accumcheck stack: {report.stack} ({report.model}, N = {report.accum_steps})", ""]
    out += [f"- {line}" for line in stack_header_lines(report)] + [""]
    out.append("| " + " | ".join(STACK_COLUMNS) + " |")
    out.append("|" + "|".join("---:" if c in ("step", "factor", "max rel diff") else "---" for c in STACK_COLUMNS) + "|")
    for row in stack_rows(report):
        row[3] = row[3] if row[3] == "faithful" else f"**{row[3]}**"
        out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    out += ["", f"**{report.summary()}**", ""]
    if report.reproduce:
        out += [f"Reproduce: `{report.reproduce}`", ""]
    return "\n".join(out)
