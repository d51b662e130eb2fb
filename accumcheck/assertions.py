"""``assert_faithful``: the assertion for tests, with a message in torch.testing's shape."""

from __future__ import annotations

from .render.names import shown
from .render.wording import cross_summary, num, summary_line, tensor_details
from .report import CrossReport, Report, StackReport


class AccumulationMismatch(AssertionError):
    """Raised by assert_faithful; the message names every flagged tensor and its numbers."""


def failure_message(report: Report | CrossReport | StackReport) -> str:
    """The text assert_faithful raises with: what was flagged, then torch.testing-style lines
    (mismatched elements, greatest differences and where) plus the bound, ratio, ulps, gradient
    magnitude and the mode nearer the float64 sum, then the command that reproduces the run. Names
    are printed with control characters escaped (``render.names``)."""
    report = shown(report)
    if isinstance(report, StackReport):
        where = f"{report.stack}, {report.model}, N = {report.accum_steps}"
        lines = [f"The training stack's optimizer steps are not their windows' gradients ({where}): {report.summary()}",
                 ""]
        lines += [f"step {s.step} (micro-batches {s.window_text}): {s.verdict}: {s.result.explanation}"
                  for s in report.flagged]
        return "\n".join(lines + ["", f"Reproduce: {report.reproduce}"])
    if isinstance(report, CrossReport):
        lines = [f"Frameworks disagree: {cross_summary(report)}", ""]
        for r in report.reports:
            if r.flagged:
                lines.append(failure_message(r))
        for a, pair in zip(report.agreement, report.pairs()):
            if not a.flagged:
                continue
            lines.append(f"{a.name} ({a.kind}), {' vs '.join(pair)}: {a.verdict}, {num(a.ratio)}x the agreement bound "
                         f"{num(a.bound_at_worst)} at index {tuple(a.worst_index)}; greatest absolute difference "
                         f"{num(a.max_abs_diff)} at index {tuple(a.max_abs_diff_index)} ({num(a.max_ulps)} ulps)")
        lines.append(f"Reproduce: {report.reproduce_command()}")
        return "\n".join(lines)
    where = f"case {report.case}, {report.framework} on {report.device}, N = {report.accum_steps}"
    lines = [f"Gradient accumulation is not faithful ({where}): {summary_line(report)}", ""]
    for t in report.failing:  # the flagged tensors, and the suspicious ones where they fail the run
        lines += [line.strip() for line in tensor_details(t)] + [""]
    lines.append(f"Reproduce: {report.reproduce_command()}")
    return "\n".join(lines)


def assert_faithful(report: Report | CrossReport | StackReport) -> None:
    """Pass when no tensor is flagged (and, for a CrossReport, the frameworks agree); raise
    AccumulationMismatch (an AssertionError) with ``failure_message(report)`` otherwise."""
    __tracebackhide__ = True
    if report.exit_code:
        raise AccumulationMismatch(failure_message(report))
