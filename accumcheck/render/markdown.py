"""GitHub-flavoured markdown for every report kind (a CI job summary, a bug report)."""

from __future__ import annotations

from ..report import CrossReport, Report, ReportDiff, StackReport, SweepReport
from .text import (
    STACK_COLUMNS,
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
    stack_header_lines,
    stack_rows,
    summary_line,
    sweep_summary,
    tensor_details,
)


def markdown(report: Report) -> str:
    """A GitHub-flavoured markdown report: header, table, flagged details, summary."""
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
        row = [f"`{t.title}`", t.kind, shape_text(t), num(t.max_abs_grad), verdict,
               *([cause_words(t).replace("|", "\\|")] if causes else []), num(t.ratio), num(t.max_abs_diff),
               num(t.max_ulps), str(t.classic_mismatched), num(t.condition), num(t.err_native), num(t.err_manual),
               t.nearer]
        out.append("| " + " | ".join(row) + " |")
    shown = noteworthy(report)
    if shown:
        out += ["", "```"] + [line for t in shown for line in tensor_details(t)] + ["```"]
    out += ["", f"**{summary_line(report)}**", ""]
    return "\n".join(out)


def cross_markdown(cross: CrossReport) -> str:
    out = [markdown(r) for r in cross.reports]
    out.append(f"## {' vs '.join(cross.frameworks)}: manual accumulations")
    out.append("")
    a, b = cross.frameworks if len(cross.frameworks) == 2 else ("a", "b")
    out.append(f"| tensor | a vs b | kind | verdict | ratio to bound | max abs diff | ulps "
               f"| float32 error {a} | float32 error {b} |")
    out.append("|---|---|---|---|---:|---:|---:|---:|---:|")
    for row, pair in zip(cross.agreement, cross.pairs()):
        verdict = f"**{row.verdict}**" if row.flagged else row.verdict
        out.append(f"| `{row.name}` | {' vs '.join(pair)} | {row.kind} | {verdict} "
                   f"| {num(row.ratio)} | {num(row.max_abs_diff)} | {num(row.max_ulps)} | {num(row.float32_err_a)} "
                   f"| {num(row.float32_err_b)} |")
    out += [""] + [f"- {line}" for line in forward_lines(cross)] + ["", f"**{cross_summary(cross)}**", ""]
    return "\n".join(out)


def sweep_markdown(sweep: SweepReport) -> str:
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
        out.append("| " + " | ".join(cells + [", ".join(row["flagged"]) or "-"]) + " |")
    out += ["", f"**{sweep_summary(sweep)}**", ""]
    return "\n".join(out)


def diff_markdown(diff: ReportDiff) -> str:
    out = [f"- A: {diff.names[0]}: {describe(diff.a)}", f"- B: {diff.names[1]}: {describe(diff.b)}", "",
           "| tensor | kind | verdict A | verdict B | ratio A | ratio B |", "|---|---|---|---|---:|---:|"]
    for c in diff.common:
        mark = "**" if c.changed else ""
        out.append(f"| `{c.name}` | {c.kind} | {mark}{c.verdict_a}{mark} | {mark}{c.verdict_b}{mark} "
                   f"| {num(c.ratio_a)} | {num(c.ratio_b)} |")
    return "\n".join(out + [""] + [f"- {e}" for e in diff_extra_lines(diff)] + ["", f"**{diff_summary(diff)}**", ""])


def stack_markdown(report: StackReport) -> str:
    """A training stack's check as markdown: its facts, one row an optimizer step, the summary."""
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
