"""One self-contained HTML file for sharing a reproduction: tables, details and the plots inlined.
Every text from a report is escaped twice over: its control characters by ``names.shown``, its
markup by ``html.escape``."""

from __future__ import annotations

import base64
import html
from typing import Any

from ..report import CrossReport, Report, SweepReport, TensorResult
from .names import shown
from .plots import growth, heatmaps, png_bytes, scatter
from .wording import (
    cause_words,
    cross_summary,
    forward_lines,
    has_causes,
    header_lines,
    noteworthy,
    num,
    summary_line,
    tensor_details,
)

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       color: #1b1b1b; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border-bottom: 1px solid #ddd; padding: 0.3em 0.7em; text-align: right; }
th { background: #f3f3f3; } td.name, th.name, td.text { text-align: left; font-family: monospace; }
th.text { text-align: left; } td { white-space: nowrap; } td.cause { white-space: normal; min-width: 11em; }
.wide { overflow-x: auto; }
.flagged { color: #b00020; font-weight: bold; } .ok { color: #1b7f3b; font-weight: bold; }
.marginal { color: #b00020; font-weight: normal; } .suspicious { color: #a05a00; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.meta { color: #555; font-size: 0.9em; }
"""


def _img(fig: Any, alt: str) -> str:
    data = base64.b64encode(png_bytes(fig)).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _summary(text: str, flagged: bool) -> str:
    return f'<p class="{"flagged" if flagged else "ok"}">{html.escape(text)}</p>'


def _verdict_class(t: TensorResult) -> str:
    """The verdict cell's classes: flagged (a marginal one not in bold), suspicious, or none."""
    if t.flagged:
        return "text flagged marginal" if t.severity == "marginal" else "text flagged"
    return "text suspicious" if t.verdict == "suspicious" else "text"


def _tensor_table(report: Report) -> str:
    causes = has_causes(report)
    head = ("tensor", "kind", "shape", "max|g|", "verdict", *(("cause",) if causes else ()), "ratio to bound",
            "max|A−B|", "ulps", "rtol/atol fails", "cond S/|E|", "err native", "err manual", "nearer", "share of norm")
    rows = []
    for t in report.tensors:
        cls = _verdict_class(t)
        # the cause in the verdict's colour, never in bold
        tint = " marginal" if t.flagged and t.cause else " suspicious" if t.verdict == "suspicious" and t.cause else ""
        cause = [f'<td class="text cause{tint}">{html.escape(cause_words(t))}</td>'] if causes else []
        cells = [f'<td class="name">{html.escape(t.title)}</td>', f'<td class="text">{html.escape(t.kind)}</td>',
                 f'<td class="text">{"x".join(map(str, t.shape))}</td>', f"<td>{num(t.max_abs_grad)}</td>",
                 f'<td class="{cls}">{html.escape(t.label)}</td>', *cause] + \
                [f"<td>{v}</td>" for v in (num(t.ratio), num(t.max_abs_diff), num(t.max_ulps), t.classic_mismatched,
                                           num(t.condition), num(t.err_native), num(t.err_manual))] + \
                [f'<td class="text">{html.escape(t.nearer)}</td>', f"<td>{100 * t.norm_share:.3g}%</td>"]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    header = "".join(f'<th class="name">{h}</th>' if i == 0 else f'<th class="text">{h}</th>' if h in ("verdict", "cause")
                     else f"<th>{h}</th>" for i, h in enumerate(head))
    # a wide table scrolls inside its own box, not the page
    return f'<div class="wide"><table><thead><tr>{header}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>'


def _report_section(report: Report, plots: bool = True) -> str:
    parts = [f"<h2>{html.escape(report.case)}: {html.escape(report.framework)} on {html.escape(report.device)}, "
             f"N = {report.accum_steps}</h2>",
             '<div class="meta">' + "<br>".join(html.escape(line) for line in header_lines(report)) + "</div>",
             _summary(summary_line(report), bool(report.exit_code)), _tensor_table(report)]
    shown = noteworthy(report)
    if shown:
        parts.append("<pre>" + html.escape("\n".join(line for t in shown for line in tensor_details(t))) + "</pre>")
    if plots:
        parts.append(_img(scatter(report), f"error against bound, {report.case}"))
        maps = heatmaps(report)
        if maps is not None:
            parts.append(_img(maps, f"where the differences sit, {report.case}"))
    return "\n".join(parts)


def _sweep_section(sweep: SweepReport) -> str:
    rows = sweep.rows()
    kinds = sorted({k for row in rows for k in row["kinds"]})
    head = "<tr><th>N</th><th>bound</th><th>√N</th>" + "".join(
        f"<th>{k}: native</th><th>{k}: manual</th><th>{k}: |A−B|</th>" for k in map(html.escape, kinds)
    ) + "<th>flagged</th></tr>"
    body = []
    for row in rows:
        cells = [f"<td>{row['N']}</td>", f"<td>{num(row['bound'])}</td>", f"<td>{num(row['sqrt_N'])}</td>"]
        for k in kinds:
            entry = row["kinds"].get(k, {})
            cells += [f"<td>{num(entry.get(m))}</td>" for m in ("native", "manual", "difference")]
        cells.append(f'<td class="text">{html.escape(", ".join(row["flagged"])) or "-"}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return ("<h2>Growth with N (worst tensor of each kind, in units of u·S)</h2>"
            f"<table><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"
            + _img(growth(sweep.reports), "error growth with N"))


def html_report(report: Report | SweepReport | CrossReport) -> str:
    """The report as one HTML document with everything inlined."""
    report = shown(report)
    if isinstance(report, SweepReport):
        first = report.reports[0]
        title = f"accumcheck sweep: {first.case}, {first.framework}"
        flagged = bool(report.flagged)
        text = (f"FLAGGED at N = {sorted({n for n, _ in report.flagged})}: "
                f"{', '.join(sorted({name for _, name in report.flagged}))}" if flagged
                else f"OK at every N ({', '.join(str(r.accum_steps) for r in report.reports)})")
        body = [_summary(text, flagged), _sweep_section(report), _report_section(report.reports[-1])]
    elif isinstance(report, CrossReport):
        title = f"accumcheck: {' vs '.join(report.frameworks)}, {report.reports[0].case}"
        body = [_summary(cross_summary(report), bool(report.exit_code))]
        body += [_report_section(r, plots=False) for r in report.reports]
        rows = "".join(f'<tr><td class="name">{html.escape(a.name)}</td>'
                       f'<td class="text">{html.escape(" vs ".join(pair))}</td>'
                       f'<td class="text">{html.escape(a.kind)}</td>'
                       f'<td class="text{" flagged" if a.flagged else ""}">{html.escape(a.verdict)}</td>'
                       f'<td>{num(a.ratio)}</td>'
                       f"<td>{num(a.max_abs_diff)}</td><td>{num(a.max_ulps)}</td></tr>"
                       for a, pair in zip(report.agreement, report.pairs()))
        body.append("<h2>Manual accumulations compared</h2><table><thead><tr><th class='name'>tensor</th>"
                    "<th>frameworks</th><th>kind</th><th>verdict</th><th>ratio</th><th>max|diff|</th><th>ulps</th>"
                    f"</tr></thead><tbody>{rows}</tbody></table>")
        body.append("".join(f"<p>{html.escape(line)}</p>" for line in forward_lines(report)))
    else:
        title = f"accumcheck: {report.case}, {report.framework}"
        body = [_report_section(report)]
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>\n" + "\n".join(body) + "\n</body></html>\n")
