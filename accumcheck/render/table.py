"""Terminal tables (rich) for every report kind, drawn on a live console or into text."""

from __future__ import annotations

import io
from typing import Any, Callable

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..cases import Case
from ..report import CrossReport, Report, ReportDiff, StackReport, SweepReport, TensorResult, TrajectoryReport
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

_STYLE = {"identical": "green", "round-off": "cyan", "suspicious": "yellow", "precision-loss": "bold yellow",
          "diverged": "bold red", "non-finite": "bold magenta", "no-gradient": "dim", "overflow": "magenta"}


def verdict_style(t: TensorResult) -> str:
    """The verdict's colour; a marginal flagged tensor is drawn in it, not in bold."""
    style = _STYLE.get(t.verdict, "")
    return style.replace("bold ", "") if t.severity == "marginal" else style


def rich_table(report: Report) -> Table:
    """The per-parameter table: one row a tensor, the verdict and the numbers behind it; a cause
    column where some tensor's difference has a cause fitted."""
    causes = has_causes(report)
    # A cause column takes room: the columns sit two spaces apart then, not three.
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False, collapse_padding=causes)
    # A long name (a model's own, or a tied one under all its names) folds; numbers never shrink.
    table.add_column("tensor", overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    # "ratio": worst |mode - E| / bound; "tol fails": elements outside torch.testing's rtol/atol.
    for title in ("max|g|", "verdict", *(("cause",) if causes else ()), "ratio", "max|A-B|", "ulps", "tol fails",
                  "cond"):
        # where the width is short, the cause's few words wrap at their spaces (and a long name folds)
        table.add_column(title, justify="left" if title in ("verdict", "cause") else "right", no_wrap=title != "cause")
    for t in report.tensors:
        verdict = Text(t.label, style=verdict_style(t))
        words = Text(cause_words(t), style=verdict_style(t).replace("bold ", "") if t.cause else "dim")
        cause = (words,) if causes else ()
        table.add_row(t.title, t.kind, shape_text(t), num(t.max_abs_grad), verdict, *cause, num(t.ratio),
                      num(t.max_abs_diff), num(t.max_ulps), str(t.classic_mismatched), num(t.condition))
    return table


def rank_table(report: Report) -> Table:
    """One row a rank: its verdict, the tensors it is named for, its worst own-total ratio."""
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False, title="per rank")
    for title in ("rank", "host", "verdict", "own total, worst ratio", "flagged tensors"):
        table.add_column(title, justify="right" if title.startswith(("rank", "own")) else "left")
    for r in report.data_parallel.ranks:
        worst = max((t.rank_local_ratios[r.rank] for t in report.tensors if t.rank_local_ratios), default=0.0)
        verdict = Text("FLAGGED", style="bold red") if r.flagged else Text("faithful", style="green")
        table.add_row(str(r.rank), r.host, verdict, num(worst), ", ".join(r.flagged) or "-")
    return table


def render_table(report: Report, console: Console) -> None:
    """Header, per-parameter table, details of flagged and ill-conditioned tensors, summary."""
    # soft_wrap: long lines (the reproduce command above all) stay whole, for copying.
    console.print(Text("\n".join(header_lines(report)), style="dim"), soft_wrap=True)
    console.print(rich_table(report))
    if report.data_parallel is not None and not report.data_parallel.ranks_agree:
        console.print(rank_table(report))
    for t in noteworthy(report):
        style = "red" if t.flagged else "yellow" if t.verdict == "suspicious" else ""
        console.print(Text("\n".join(tensor_details(t)), style=style), soft_wrap=True)
    style = "bold red" if report.exit_code else "bold green"
    console.print()
    console.print(Text(summary_line(report), style=style), soft_wrap=True)


def agreement_table(cross: CrossReport) -> Table:
    """One row a tensor and pair of frameworks, the pair named "a vs b"."""
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False,
                  title=f"manual accumulation: {' vs '.join(cross.frameworks)}")
    a, b = cross.frameworks if len(cross.frameworks) == 2 else ("a", "b")
    for title in ("tensor", "a vs b", "kind", "verdict", "ratio", "max|diff|", "ulps",
                  f"fp32 err {a}", f"fp32 err {b}"):
        table.add_column(title, justify="left" if title in ("tensor", "a vs b", "kind", "verdict") else "right",
                         no_wrap=title in ("tensor", "a vs b", "kind", "verdict"))
    for row, pair in zip(cross.agreement, cross.pairs()):
        style = "bold red" if row.flagged else ("green" if row.verdict == "identical" else "cyan")
        table.add_row(row.name, " vs ".join(pair), row.kind, Text(row.verdict, style=style),
                      num(row.ratio), num(row.max_abs_diff), num(row.max_ulps), num(row.float32_err_a),
                      num(row.float32_err_b))
    return table


def render_cross_table(cross: CrossReport, console: Console) -> None:
    for report in cross.reports:
        render_table(report, console)
        console.print()
    console.print(Text(f"bound: |B_a - B_b| <= e_a + e_b + {cross.allowance:g}u * (S + S_rms,tensor + S_rms,model), "
                       "e_f = |B_f - O_f| each framework's float32 error against its own float64 run", style="dim"))
    console.print(agreement_table(cross))
    for line in forward_lines(cross):
        console.print(Text(line))
    console.print(Text(f"reproduce: {cross.reproduce_command()}", style="dim"))
    console.print(Group(Text(""), Text(cross_summary(cross), style="bold red" if cross.exit_code else "bold green")))


def sweep_table(sweep: SweepReport) -> Table:
    rows = sweep.rows()
    kinds = sorted({k for row in rows for k in row["kinds"]})
    first = sweep.reports[0]
    table = Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False,
                  title=f"{first.case}, {first.framework}: worst error of each kind, in units of u·S")
    for title in ["N", "bound", "√N"] + [f"{k} {m}" for k in kinds for m in ("native", "manual", "|A-B|")] + ["flagged"]:
        table.add_column(title, justify="left" if title == "flagged" else "right")
    for row in rows:
        cells = [str(row["N"]), num(row["bound"]), num(row["sqrt_N"])]
        for k in kinds:
            entry = row["kinds"].get(k, {})
            cells += [num(entry.get(m)) for m in ("native", "manual", "difference")]
        cells.append(Text(", ".join(row["flagged"]) or "-", style="bold red" if row["flagged"] else ""))
        table.add_row(*cells)
    return table


def render_sweep_table(sweep: SweepReport, console: Console) -> None:
    console.print(sweep_table(sweep))
    console.print(Group(Text(""), Text(sweep_summary(sweep), style="bold red" if sweep.flagged else "bold green")))


def trajectory_table(report: TrajectoryReport) -> Table:
    """One row an optimizer step: each mode's loss and each tensor kind's native/manual
    parameter difference in float32 ulps."""
    table = Table(title=f"{report.case}: native vs manual, {report.optimizer} lr {report.lr:g}, "
                        f"N = {report.accum_steps}; parameter difference in float32 ulps")
    table.add_column("step", justify="right")
    for mode in report.losses:
        table.add_column(f"loss {mode}", justify="right")
    for kind in report.band_ratio:
        table.add_column(f"{kind} ulps", justify="right")
    for k in range(report.steps):
        table.add_row(str(k), *[f"{report.losses[m][k]:.6g}" for m in report.losses],
                      *[num(report.band_ratio[kind][k]) for kind in report.band_ratio])
    return table


def render_trajectory(report: TrajectoryReport, console: Console) -> None:
    console.print(trajectory_table(report))
    console.print(report.summary(), style="bold red" if report.exit_code else "bold green", soft_wrap=True)


def stack_table(report: StackReport) -> Table:
    """One row an optimizer step: its window, what it applied, and how far from the window's gradient."""
    table = Table(box=box.SIMPLE_HEAD)
    for title in STACK_COLUMNS:
        table.add_column(title, justify="right" if title in ("step", "factor", "max rel diff") else "left",
                         overflow="fold", no_wrap=title != "why")
    for row in stack_rows(report):  # Text: a model's name or a note may hold [brackets], not markup
        table.add_row(*map(Text, row), style="" if row[3] == "faithful" else "bold red")
    return table


def render_stack(report: StackReport, console: Console) -> None:
    for line in stack_header_lines(report):
        console.print(line, soft_wrap=True, markup=False)
    console.print(stack_table(report))
    console.print(report.summary(), style="bold red" if report.exit_code else "bold green", soft_wrap=True,
                  markup=False)
    if report.reproduce:
        console.print(f"reproduce: {report.reproduce}", soft_wrap=True, markup=False)


def render_diff(diff: ReportDiff, console: Console) -> None:
    """Both reports described, one row a tensor (changed verdicts in red), the summary."""
    for letter, name, report in (("A", diff.names[0], diff.a), ("B", diff.names[1], diff.b)):
        console.print(f"{letter}: {name}: {describe(report)}")
    table = Table()
    for title in ("tensor", "kind", "verdict A", "verdict B", "ratio A", "ratio B"):
        table.add_column(title, justify="right" if title.startswith("ratio") else "left", no_wrap=True)
    for c in diff.common:
        table.add_row(c.name, c.kind, c.verdict_a, c.verdict_b, num(c.ratio_a), num(c.ratio_b),
                      style="bold red" if c.changed else "")
    console.print(table)
    for line in diff_extra_lines(diff):
        console.print(line)
    console.print(diff_summary(diff), style="bold red" if diff.changed else "bold green")


def cases_table(cases: list[Case]) -> Table:
    """The cases: name, default N, parameter tensors and values, description."""
    table = Table(show_lines=True)
    for column in ("case", "N", "parameters", "description"):
        table.add_column(column, overflow="fold")
    for case in cases:
        params = case.parameters()
        table.add_row(case.name, str(case.accum_steps), f"{len(params)} tensors, {sum(p.numel for p in params):,}",
                      " ".join(case.description.split()))
    return table


_DRAW: dict[type, Callable[[Any, Console], None]] = {
    Report: render_table, CrossReport: render_cross_table, SweepReport: render_sweep_table,
    TrajectoryReport: render_trajectory, ReportDiff: render_diff, StackReport: render_stack,
}


def render_console(report: Any, console: Console) -> None:
    """Draw any report kind on a live console (colours where it has them)."""
    _DRAW[type(report)](report, console)


def table_text(report: Any, width: int = 160) -> str:
    """The table rendering of any report kind as plain text (for files)."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    render_console(report, console)
    return console.file.getvalue()
