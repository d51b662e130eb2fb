"""The ``accumcheck`` command: thin over the library; draws tables and progress, maps exit codes.

Exit codes: 0 every tensor faithful, 1 something flagged, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from .errors import AccumcheckError
from .faults import FAULT_KINDS
from .backends import FRAMEWORKS
from .options import choice_list, integer, positive_int
from .render import FORMATS, cross_summary, render, render_console, summary_line
from .report import Report


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accumcheck", description="Checks native against manual gradient accumulation, "
                     "judged by floating-point error bounds.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("compare", help="run a case in native and manual mode and judge every tensor")
    run.add_argument("--framework", default="torch", type=choice_list(FRAMEWORKS), metavar="NAME[,NAME]",
                     help=f"{' or '.join(FRAMEWORKS)}; two, comma-separated, to compare them too (default: %(default)s)")
    run.add_argument("--device", default="cpu", metavar="DEV", help="cpu, gpu, cuda or cuda:N (default: %(default)s)")
    run.add_argument("--case", default="embed-attention", metavar="NAME|PATH",
                     help="a built-in case (see `accumcheck cases`) or a case .toml file (default: %(default)s)")
    run.add_argument("--accum-steps", type=positive_int, metavar="N",
                     help="micro-steps to accumulate (default: the case's own)")
    run.add_argument("--seed", type=integer, metavar="S", help="override the case's seed")
    run.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=False,
                     help="also run the whole model in float64 (default: off)")
    run.add_argument("--inject", metavar="KIND[:PARAM]",
                     help=f"perturb the native accumulation: {', '.join(FAULT_KINDS)}")
    run.add_argument("--hybridize", action=argparse.BooleanOptionalAction, default=True,
                     help="MXNet: hybridize(static_alloc=True) the Gluon block (default: on)")
    run.add_argument("--grad-norms", metavar="DIR",
                     help="also log each mode's per-layer gradient norms to TensorBoard event files in DIR")
    _add_output_options(run)

    sub.add_parser("cases", help="list the built-in cases")

    show = sub.add_parser("show", help="re-render a saved JSON report")
    show.add_argument("report", metavar="REPORT.json")
    _add_output_options(show)
    return parser


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: %(default)s)")
    parser.add_argument("--output", metavar="FILE", help="write the report to FILE (atomically) instead of stdout")


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    try:
        return {"compare": _compare, "cases": _cases, "show": _show}[args.command](args)
    except AccumcheckError as exc:
        print(f"accumcheck: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("accumcheck: interrupted", file=sys.stderr)
        return 130


def _check_output(path: str | None) -> None:
    """Fail before any work when the report could not be written."""
    if path is None:
        return
    parent = Path(path).parent
    if not parent.is_dir():
        raise AccumcheckError(f"--output {path}: folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise AccumcheckError(f"--output {path}: folder {parent} is not writable; choose another path")
    if Path(path).is_dir():
        raise AccumcheckError(f"--output {path}: is a folder; give a file name")


def _console():
    from rich.console import Console

    # Piped output has no width of its own; give tables room instead of folding them.
    return Console(width=None if sys.stdout.isatty() else 120)


def _emit(report, args: argparse.Namespace) -> None:
    from .report import write_atomic

    if args.output is None:
        if args.format == "table":
            render_console(report, _console())
        else:
            sys.stdout.write(render(report, args.format))
        return
    text = render(report, args.format)
    try:
        write_atomic(args.output, text)
    except OSError as exc:
        fd, rescue = tempfile.mkstemp(prefix="accumcheck-report-", suffix=f".{args.format}")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        raise AccumcheckError(f"--output {args.output}: cannot write ({exc.strerror}); "
                              f"the report was saved to {rescue} instead") from None
    print(summary_line(report) if isinstance(report, Report) else cross_summary(report))
    print(f"report written to {args.output}")


def _compare(args: argparse.Namespace) -> int:
    from .api import compare, compare_frameworks

    _check_output(args.output)
    frameworks = args.framework if isinstance(args.framework, list) else [args.framework]
    if args.grad_norms is not None and len(set(frameworks)) > 1:
        raise AccumcheckError("--grad-norms works with one framework at a time; run each --framework on its own")
    with _LazyProgress() as progress:
        if len(set(frameworks)) > 1:
            report = compare_frameworks(case=args.case, frameworks=frameworks, accum_steps=args.accum_steps,
                                        device=args.device, seed=args.seed, inject=args.inject,
                                        progress=progress, hybridize=args.hybridize)
        else:
            report = compare(case=args.case, framework=frameworks[0], accum_steps=args.accum_steps,
                             device=args.device, seed=args.seed, oracle=args.oracle, inject=args.inject,
                             progress=progress, hybridize=args.hybridize, grad_norms=args.grad_norms)
    _emit(report, args)
    return report.exit_code


def _cases(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .cases import builtin_case, builtin_case_names

    table = Table(show_lines=True)
    for column in ("case", "N", "parameters", "description"):
        table.add_column(column, overflow="fold")
    for name in builtin_case_names():
        case = builtin_case(name)
        params = case.parameters()
        table.add_row(name, str(case.accum_steps), f"{len(params)} tensors, {sum(p.numel for p in params):,}",
                      " ".join(case.description.split()))
    _console().print(table)
    return 0


def _show(args: argparse.Namespace) -> int:
    from .report import load_report

    _check_output(args.output)
    report = load_report(args.report)
    _emit(report, args)
    return report.exit_code


class _LazyProgress:
    """A progress bar on stderr that appears only once a run has taken more than a second,
    and only on a terminal."""

    DELAY_S = 1.0

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.progress = None
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> Callable[[str, int, int], None]:
        return self.update

    def update(self, phase: str, done: int, total: int) -> None:
        if self.progress is None:
            if time.perf_counter() - self.started < self.DELAY_S or not sys.stderr.isatty():
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.progress.start()
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(self.tasks[phase], completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


if __name__ == "__main__":
    sys.exit(main())
