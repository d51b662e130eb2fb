"""Terminal tables (rich) for every report kind, drawn on a live console or into text."""

from __future__ import annotations

import io
from typing import Any, Callable

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..case.definition import Case
from ..report import CrossReport, Report, ReportDiff, StackReport, SweepReport, TensorResult, TrajectoryReport
from .fit import Col, Layout, command_lines, fitted
from .legend import legend
from .names import printable, shown
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

_STYLE = {"identical": "green", "round-off": "cyan", "suspicious": "yellow", "precision-loss": "bold yellow",
          "diverged": "bold red", "non-finite": "bold magenta", "no-gradient": "dim", "overflow": "magenta"}


def verdict_style(t: TensorResult) -> str:
    """The verdict's colour; a marginal flagged tensor is drawn in it, not in bold."""
    style = _STYLE.get(t.verdict, "")
    return style.replace("bold ", "") if t.severity == "marginal" else style


# ----------------------------------------------------------------------------- lines around the tables


def _prose(console: Console, lines: list[str], style: str = "", indent: int = 2) -> None:
    """Lines of prose. On a console of its own width (a terminal, a pipe) each wraps at its spaces,
    its further lines indented under it, and a reproduce command splits between its options with a
    shell's line continuation; in a file (``table_text``) each line stays whole."""
    for line in lines:
        text = Text(line, style=style)
        if console.soft_wrap:
            console.print(text, soft_wrap=True)
            continue
        width = console.width
        if line.startswith("reproduce: accumcheck "):
            console.print(Text("\n".join(command_lines(line, width)), style=style), soft_wrap=True)
            continue
        lead = len(line) - len(line.lstrip(" ")) + indent
        parts = [part.copy() for part in text.wrap(console, max(width - lead, 20))]
        for part in parts:
            part.rstrip()
        console.print(Text("\n").join(parts[:1] + [Text(" " * lead) + part for part in parts[1:]]), soft_wrap=True)


def _summary(console: Console, line: str, failing: bool) -> None:
    """The summary, the last line: whole however long (for logs and grep), after a blank line."""
    console.print()
    console.print(Text(line, style="bold red" if failing else "bold green"), soft_wrap=True)


def _tables(console: Console, columns: list[Col], layout: Layout, own: dict[str, str] | None = None) -> None:
    """The table in as many parts as the console's width needs, then its one-line legend, wrapped
    to the width."""
    for table in fitted(columns, console.width, layout):
        console.print(table)
    words = legend([c.header for c in columns], own)
    if words:
        console.print(Text(words, style="dim"), soft_wrap=False)


def _cells(values: list[str], style: str = "") -> list[Text]:
    return [Text(v, style=style) for v in values]


# ----------------------------------------------------------------------------- one report


def _heavy(collapse: bool = False, title: str | None = None) -> Layout:
    def make(part: int) -> Table:
        return Table(box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False, collapse_padding=collapse,
                     title=Text(title) if title and part == 0 else None)
    return Layout(make)


def tensor_columns(report: Report) -> list[Col]:
    """The per-parameter table's columns: one row a tensor, the verdict and the numbers behind it;
    a cause column where some tensor's difference has a cause fitted. Beside the name, whatever
    the width: the verdict and the ratio."""
    ts = report.tensors
    columns = [
        Col("tensor", _cells([t.title for t in ts]), "left", key=True),
        Col("kind", _cells([t.kind for t in ts]), "left", rank=2),
        Col("shape", _cells([shape_text(t) for t in ts]), "left", rank=6),
        Col("max|g|", _cells([num(t.max_abs_grad) for t in ts]), rank=4),
        Col("verdict", [Text(t.label, style=verdict_style(t)) for t in ts], "left", rank=0),
    ]
    if has_causes(report):  # a few words, wrapped at their spaces where the width is short
        columns.append(Col("cause", [Text(cause_words(t), style=verdict_style(t).replace("bold ", "") if t.cause
                                          else "dim") for t in ts], "left", rank=1, wrap=True))
    return columns + [
        Col("ratio", _cells([num(t.ratio) for t in ts]), rank=0),
        Col("max|A-B|", _cells([num(t.max_abs_diff) for t in ts]), rank=7),
        Col("ulps", _cells([num(t.max_ulps) for t in ts]), rank=3),
        Col("tol fails", _cells([str(t.classic_mismatched) for t in ts]), rank=8),
        Col("cond", _cells([num(t.condition) for t in ts]), rank=5),
    ]


def rich_table(report: Report) -> Table:
    """The per-parameter table with every column (where the width allows it: ``render_table``
    splits it)."""
    report = shown(report)
    # A cause column takes room: the columns sit two spaces apart then, not three.
    return fitted(tensor_columns(report), None, _heavy(collapse=has_causes(report)))[0]


def _rank_columns(report: Report) -> list[Col]:
    ranks = report.data_parallel.ranks
    worst = [max((t.rank_local_ratios[r.rank] for t in report.tensors if t.rank_local_ratios), default=0.0)
             for r in ranks]
    return [Col("rank", _cells([str(r.rank) for r in ranks]), key=True),
            Col("host", _cells([r.host for r in ranks]), "left", rank=2),
            Col("verdict", [Text("FLAGGED", style="bold red") if r.flagged else Text("faithful", style="green")
                            for r in ranks], "left", rank=0),
            Col("own total, worst ratio", _cells([num(w) for w in worst]), rank=0),
            Col("flagged tensors", _cells([", ".join(r.flagged) or "-" for r in ranks]), "left", rank=1, wrap=True)]


def render_table(report: Report, console: Console) -> None:
    """Header, per-parameter table and its legend, details of flagged and ill-conditioned tensors,
    summary."""
    report = shown(report)
    _prose(console, header_lines(report), style="dim")
    _tables(console, tensor_columns(report), _heavy(collapse=has_causes(report)))
    if report.data_parallel is not None and not report.data_parallel.ranks_agree:
        console.print()
        _tables(console, _rank_columns(report), _heavy(title="per rank"))
    shown_details = noteworthy(report)
    if shown_details:
        console.print()
    for t in shown_details:
        style = "red" if t.flagged else "yellow" if t.verdict == "suspicious" else ""
        _prose(console, tensor_details(t), style=style)
    _summary(console, summary_line(report), bool(report.exit_code))


# ----------------------------------------------------------------------------- frameworks compared


def agreement_columns(cross: CrossReport) -> list[Col]:
    """One row a tensor and pair of frameworks, the pair named "a vs b"."""
    rows = list(zip(cross.agreement, cross.pairs()))
    a, b = cross.frameworks if len(cross.frameworks) == 2 else ("a", "b")
    styles = ["bold red" if row.flagged else ("green" if row.verdict == "identical" else "cyan") for row, _ in rows]
    return [
        Col("tensor", _cells([row.name for row, _ in rows]), "left", key=True),
        Col("a vs b", _cells([" vs ".join(pair) for _, pair in rows]), "left", key=True),
        Col("kind", _cells([row.kind for row, _ in rows]), "left", rank=2),
        Col("verdict", [Text(row.verdict, style=style) for (row, _), style in zip(rows, styles)], "left", rank=0),
        Col("ratio", _cells([num(row.ratio) for row, _ in rows]), rank=0),
        Col("max|diff|", _cells([num(row.max_abs_diff) for row, _ in rows]), rank=4),
        Col("ulps", _cells([num(row.max_ulps) for row, _ in rows]), rank=3),
        Col(f"fp32 err {a}", _cells([num(row.float32_err_a) for row, _ in rows]), rank=5, group="fp32"),
        Col(f"fp32 err {b}", _cells([num(row.float32_err_b) for row, _ in rows]), rank=5, group="fp32"),
    ]


AGREEMENT_LEGEND = {"ratio": "|B_a − B_b| over the bound above (past 1: the frameworks disagree)",
                    "ulps": "that distance in float32 units in the last place"}


def agreement_table(cross: CrossReport) -> Table:
    """The frameworks' manual accumulations compared, every column in one table."""
    cross = shown(cross)
    return fitted(agreement_columns(cross), None, _heavy(title=_agreement_title(cross)))[0]


def _agreement_title(cross: CrossReport) -> str:
    return f"manual accumulation: {' vs '.join(cross.frameworks)}"


def render_cross_table(cross: CrossReport, console: Console) -> None:
    cross = shown(cross)
    for report in cross.reports:
        render_table(report, console)
        console.print()
    _prose(console, [f"bound: |B_a - B_b| <= e_a + e_b + {cross.allowance:g}u * (S + S_rms,tensor + S_rms,model), "
                     "e_f = |B_f - O_f| each framework's float32 error against its own float64 run"], style="dim")
    _tables(console, agreement_columns(cross), _heavy(title=_agreement_title(cross)), AGREEMENT_LEGEND)
    _prose(console, forward_lines(cross))
    _prose(console, [f"reproduce: {cross.reproduce_command()}"], style="dim")
    _summary(console, cross_summary(cross), bool(cross.exit_code))


# ----------------------------------------------------------------------------- a sweep over N


def sweep_columns(sweep: SweepReport) -> tuple[list[Col], set[int]]:
    """One row a tensor kind and N: the bound, √N and the kind's worst errors beside each other,
    the kinds in sections; and the rows that end a section."""
    rows = sweep.rows()
    kinds = sorted({k for row in rows for k in row["kinds"]})
    cells: dict[str, list[Text]] = {h: [] for h in ("kind", "N", "bound", "√N", "native", "manual", "|A-B|",
                                                      "flagged")}
    ends = set()
    for kind in kinds:
        for i, (row, report) in enumerate(zip(rows, sweep.reports)):
            entry = row["kinds"].get(kind, {})
            flagged = [t.name for t in report.flagged if t.kind == kind]
            values = [kind if i == 0 else "", str(row["N"]), num(row["bound"]), num(row["sqrt_N"]),
                      num(entry.get("native")), num(entry.get("manual")), num(entry.get("difference"))]
            for header, value in zip(cells, values):
                cells[header].append(Text(value))
            cells["flagged"].append(Text(", ".join(flagged) or "-", style="bold red" if flagged else ""))
        ends.add(len(cells["N"]) - 1)
    columns = [Col("kind", cells["kind"], "left", key=True), Col("N", cells["N"], key=True)]
    columns += [Col(h, cells[h], rank=0) for h in ("bound", "√N", "native", "manual", "|A-B|")]
    return columns + [Col("flagged", cells["flagged"], "left", rank=1, wrap=True)], ends


def _sweep_layout(sweep: SweepReport, ends: set[int]) -> Layout:
    first = sweep.reports[0]
    layout = _heavy(title=f"{first.case}, {first.framework}: worst error of each kind, in units of u·S")
    layout.sections = ends
    return layout


def sweep_table(sweep: SweepReport) -> Table:
    sweep = shown(sweep)
    columns, ends = sweep_columns(sweep)
    return fitted(columns, None, _sweep_layout(sweep, ends))[0]


def render_sweep_table(sweep: SweepReport, console: Console) -> None:
    sweep = shown(sweep)
    columns, ends = sweep_columns(sweep)
    _tables(console, columns, _sweep_layout(sweep, ends))
    _summary(console, sweep_summary(sweep), bool(sweep.flagged))


# ----------------------------------------------------------------------------- training trajectories


def trajectory_columns(report: TrajectoryReport) -> list[Col]:
    """One row an optimizer step: each mode's loss and, each tensor kind's columns together, native's
    and the control's largest parameter difference from manual, native's over the control's band
    (the verdict's figure) and native's in float32 ulps. A report from before the control has the
    ulps alone."""
    steps = range(report.steps)
    columns = ([Col("step", _cells([str(k) for k in steps]), key=True)]
               + [Col(f"loss {m}", _cells([f"{report.losses[m][k]:.6g}" for k in steps]), rank=0, group="loss")
                  for m in report.losses])
    for kind in report.band_ratio:
        if kind in report.control_ratio:
            flagged = [report.margin is not None and report.control_ratio[kind][k] > report.margin for k in steps]
            columns += [Col(f"{kind} gap", _cells([num(report.max_diff[kind][k]) for k in steps]), rank=1, group=kind),
                        Col(f"{kind} control", _cells([num(report.control_diff[kind][k]) for k in steps]), rank=1,
                            group=kind),
                        Col(f"{kind} ×control", [Text(num(report.control_ratio[kind][k]), style="bold red" if bad
                                                      else "") for k, bad in zip(steps, flagged)], rank=1, group=kind)]
        columns.append(Col(f"{kind} ulps", _cells([num(report.band_ratio[kind][k]) for k in steps]), rank=2,
                           group=kind if kind in report.control_ratio else ""))
    return columns


def trajectory_legend(report: TrajectoryReport) -> dict[str, str]:
    """The trajectory table's own words for its column families (KIND gap, ...), for ``legend``."""
    if report.margin is None:
        return {}
    return {"KIND gap": "max |θ native − θ manual|",
            "KIND control": "max |θ control − θ manual|, the control: manual summed last micro-batch first",
            "KIND ×control": f"gap over the control's (or one float32 ulp, if wider); past {report.margin:g}: flagged"}


def _trajectory_layout(report: TrajectoryReport) -> Layout:
    title = (f"{report.case}: native vs manual, {report.optimizer} lr {report.lr:g}, N = {report.accum_steps}; "
             + ("parameter difference in float32 ulps" if report.margin is None else
                "parameter difference against the control's"))
    return Layout(lambda part: Table(title=Text(title) if part == 0 else None))


def trajectory_table(report: TrajectoryReport) -> Table:
    report = shown(report)
    return fitted(trajectory_columns(report), None, _trajectory_layout(report))[0]


def render_trajectory(report: TrajectoryReport, console: Console) -> None:
    report = shown(report)
    columns = trajectory_columns(report)
    for table in fitted(columns, console.width, _trajectory_layout(report)):
        console.print(table)
    words = legend([_family(c.header, report) for c in columns], trajectory_legend(report))
    if words:
        console.print(Text(words, style="dim"), soft_wrap=False)
    _summary(console, report.summary(), bool(report.exit_code))


def _family(header: str, report: TrajectoryReport) -> str:
    """A kind's column by its family (weight ×control -> KIND ×control), so that the legend says it once."""
    for kind in report.control_ratio:
        for family in ("gap", "control", "×control"):
            if header == f"{kind} {family}":
                return f"KIND {family}"
    return header


# ----------------------------------------------------------------------------- training stacks


def stack_columns(report: StackReport) -> tuple[list[Col], list[str]]:
    """One row an optimizer step: its window, what it applied, and how far from the window's
    gradient; and each row's style."""
    rows = stack_rows(report)
    ranks = {"step": 0, "verdict": 0, "why": 1, "factor": 2, "max rel diff": 2, "micro-batches": 3, "items": 4}
    columns = [Col(title, _cells([row[i] for row in rows]),
                   "right" if title in ("step", "factor", "max rel diff") else "left", rank=ranks[title],
                   wrap=title == "why", key=title == "step") for i, title in enumerate(STACK_COLUMNS)]
    return columns, ["" if row[3] == "faithful" else "bold red" for row in rows]


def stack_table(report: StackReport) -> Table:
    report = shown(report)
    columns, styles = stack_columns(report)
    return fitted(columns, None, Layout(lambda part: Table(box=box.SIMPLE_HEAD), styles))[0]


def render_stack(report: StackReport, console: Console) -> None:
    report = shown(report)
    _prose(console, stack_header_lines(report))
    columns, styles = stack_columns(report)
    _tables(console, columns, Layout(lambda part: Table(box=box.SIMPLE_HEAD), styles))
    _summary(console, report.summary(), bool(report.exit_code))
    if report.reproduce:
        _prose(console, [f"reproduce: {report.reproduce}"])


# ----------------------------------------------------------------------------- two reports compared


def diff_columns(diff: ReportDiff) -> tuple[list[Col], list[str]]:
    """One row a tensor in both reports, its verdicts and ratios; and each row's style."""
    common = diff.common
    return [Col("tensor", _cells([c.name for c in common]), "left", key=True),
            Col("kind", _cells([c.kind for c in common]), "left", rank=2),
            Col("verdict A", _cells([c.verdict_a for c in common]), "left", rank=0),
            Col("verdict B", _cells([c.verdict_b for c in common]), "left", rank=0),
            Col("ratio A", _cells([num(c.ratio_a) for c in common]), rank=1, group="ratio"),
            Col("ratio B", _cells([num(c.ratio_b) for c in common]), rank=1, group="ratio"),
            ], ["bold red" if c.changed else "" for c in common]


def render_diff(diff: ReportDiff, console: Console) -> None:
    """Both reports described, one row a tensor (changed verdicts in red), the summary."""
    diff = shown(diff)
    _prose(console, [f"{letter}: {name}: {describe(report)}"
                     for letter, name, report in (("A", diff.names[0], diff.a), ("B", diff.names[1], diff.b))])
    columns, styles = diff_columns(diff)
    _tables(console, columns, Layout(lambda part: Table(), styles))
    _prose(console, diff_extra_lines(diff))
    _summary(console, diff_summary(diff), bool(diff.changed))


# ----------------------------------------------------------------------------- the cases


def _case_columns(cases: list[Case]) -> list[Col]:
    params = [case.parameters() for case in cases]
    return [Col("case", _cells([printable(c.name) for c in cases]), "left", key=True),
            Col("N", _cells([str(c.accum_steps) for c in cases]), rank=0),
            Col("parameters", _cells([f"{len(p)} tensors, {sum(q.numel for q in p):,}" for p in params]), "left",
                rank=1),
            Col("description", _cells([printable(" ".join(c.description.split())) for c in cases]), "left", rank=0,
                wrap=True)]


CASES_LEGEND = {"N": "micro-steps by default", "parameters": "tensors, and values in all"}


def cases_table(cases: list[Case]) -> Table:
    """The cases: name, default N, parameter tensors and values, description."""
    return fitted(_case_columns(cases), None, Layout(lambda part: Table(show_lines=True)))[0]


def render_cases(cases: list[Case], console: Console) -> None:
    """The cases' table, fitted to the console, and its legend."""
    _tables(console, _case_columns(cases), Layout(lambda part: Table(show_lines=True)), CASES_LEGEND)


_DRAW: dict[type, Callable[[Any, Console], None]] = {
    Report: render_table, CrossReport: render_cross_table, SweepReport: render_sweep_table,
    TrajectoryReport: render_trajectory, ReportDiff: render_diff, StackReport: render_stack,
}


def render_console(report: Any, console: Console) -> None:
    """Draw any report kind on a live console (colours where it has them), fitted to its width;
    every name in it made printable."""
    _DRAW[type(report)](shown(report), console)


def table_text(report: Any, width: int = 160) -> str:
    """The table rendering of any report kind as plain text (for files): the tables fitted to
    ``width``, every other line whole."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, soft_wrap=True)
    render_console(report, console)
    return console.file.getvalue()
