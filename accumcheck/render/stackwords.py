"""The words of a training stack's report (``accumcheck stack``, ``accumcheck.integrations``): the
run's facts before its table, and one row an optimizer step, shared by the console table and the
markdown."""

from __future__ import annotations

from ..report import StackReport
from ..report.single import FullBatchResult, factor_text
from .names import shown
from .wording import num

STACK_COLUMNS = ("step", "micro-batches", "items", "verdict", "factor", "max rel diff", "why")


def stack_header_lines(report: StackReport) -> list[str]:
    """The facts of a training-stack run a reader needs before its table."""
    report = shown(report)
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items())
    tolerance = (f"(tolerance {report.tolerance:g} of the largest window gradient)" if report.precision == "float64"
                 else f"against the window's gradient in {report.reference_dtype}, within the round-off of the run's "
                      "dtypes")
    return [f"{report.stack}: {report.model}, N = {report.accum_steps}, checked in {report.precision} {tolerance}; "
            f"{versions}",
            *report.notes, *([reference_line(report)] if any(s.reference_note for s in report.steps) else []),
            report.counts_text() + (f"; never stepped on: {len(report.unstepped)}" if report.unstepped
                                    else "; every micro-batch seen reached an optimizer step")]


def reference_line(report: StackReport) -> str:
    """How each step's reference (its window's gradient) was computed: "reference: micro-batch by
    micro-batch, the window's normalisation (...) at steps 0-3; window as one batch (one
    micro-batch) at step 4". Said where a step says why (a stack that only ever joins its windows,
    Gluon's and Keras's, says so in its notes)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for s in report.steps:
        groups.setdefault((s.reference, s.reference_note), []).append(s.step)
    parts = []
    for (reference, note), steps in groups.items():
        where = "at every step" if len(groups) == 1 else f"at step{'s' * (len(steps) > 1)} {_steps(steps)}"
        parts.append(f"{reference}{f' ({note})' if note else ''} {where}")
    return "reference: " + ("; ".join(parts) if parts else "none computed")


def _steps(steps: list[int]) -> str:
    """Step numbers as runs: "0-3, 5"."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def stack_rows(report: StackReport) -> list[list[str]]:
    """One row an optimizer step, in STACK_COLUMNS' order."""
    report = shown(report)
    rows = []
    for s in report.steps:
        r = s.result
        items = "-" if not r.item_counts else "/".join(map(str, r.item_counts))
        factor = "-" if r.equivalent or r.factor is None else (
            f"{factor_text(r.factor)}" + (f" ({r.matches})" if r.matches else "") if r.constant else
            _term_factors(r) if r.terms and r.main_factor is not None else
            f"{factor_text(r.factor_min)}..{factor_text(r.factor_max)}")
        cause = r.explanation if s.verdict == "precision-loss" else _cause(r)
        if s.update is not None and not s.update.one_update:  # what the step did, first where it explains the rest
            first = s.update.findings[0]
            cause = first if s.verdict == "update" or s.update.explains_gradient else f"{cause}; {first}"
        rows.append([str(s.step), s.window_text, items, s.verdict, factor, num(r.max_relative_difference), cause])
    return rows


def _term_factors(result: FullBatchResult) -> str:
    """A step fitted as the rest of the loss and its terms: "1.00 + 0.250" (the rest's factor, then
    each term's over its micro-batches' sum)."""
    return " + ".join(factor_text(x) for x in [result.main_factor, *(t.factor for t in result.terms)])


def _cause(result: FullBatchResult) -> str:
    """The cause an explanation ends on, without its figures: its sentences read "what: matches
    what (figures): cause" and "not a constant factor: factors (worst): cause, as ...; ..."."""
    if result.equivalent:
        return "the window's gradient"
    if result.terms:  # "head: the rest ...; the term ...": every part
        return result.explanation.split(": ", 1)[-1]
    return result.explanation.split(": ", 2)[-1].split(";")[0].split(", as ")[0]
