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
from .options import choice_list, integer, positive_float, positive_int, positive_int_list
from .render import FORMATS, cross_summary, num, render, render_console, summary_line
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
    _add_run_options(run)
    run.add_argument("--accum-steps", type=positive_int, metavar="N",
                     help="micro-steps to accumulate (default: the case's own)")
    run.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=False,
                     help="also run the whole model in float64 (default: off)")
    run.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                     help="parameters and gradients, so the native accumulation (default: %(default)s)")
    run.add_argument("--accum-dtype", choices=("float32", "float64"), default="float32",
                     help="the manual buffer (default: %(default)s)")
    run.add_argument("--mode", choices=("native", "accumulator", "compensated"), default="native",
                     help="what is compared with the manual buffer: the framework's own accumulation, or "
                          "accumcheck.torch.GradAccumulator, plain or compensated (default: %(default)s)")
    run.add_argument("--loss-reduction", choices=("mean", "sum", "token_count"),
                     help="override the case's loss normalisation (token_count: divide by the accumulation's tokens)")
    run.add_argument("--full-batch", action="store_true",
                     help="also compare with the whole batch's gradient in one backward pass (float64, PyTorch)")
    run.add_argument("--world-size", type=positive_int, metavar="W",
                     help="run data-parallel on W ranks with torch.distributed (gloo on cpu, nccl on gpu): DDP with "
                          "no_sync() against an all-reduce every micro-step and one process over the same micro-batches "
                          "(default: one process; under torchrun: its WORLD_SIZE)")
    run.add_argument("--reduce-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                     help="with --world-size: the dtype of DDP's all-reduce (default: %(default)s)")
    run.add_argument("--inject-rank", type=integer, metavar="R",
                     help="with --world-size: the rank whose native accumulation --inject perturbs (default: 0)")
    run.add_argument("--grad-norms", metavar="DIR",
                     help="also log each mode's per-layer gradient norms to TensorBoard event files in DIR")
    _add_output_options(run)

    sweep = sub.add_parser("sweep", help="compare at several numbers of accumulation steps")
    sweep.add_argument("--framework", default="torch", choices=FRAMEWORKS, help="(default: %(default)s)")
    _add_run_options(sweep)
    sweep.add_argument("--accum-steps", type=positive_int_list, metavar="N,N,...", default=[1, 2, 4, 8, 16, 32, 64],
                       help="the numbers of micro-steps (default: 1,2,4,...,64)")
    _add_output_options(sweep)

    train = sub.add_parser("train", help="K optimizer steps with native and manual accumulation (PyTorch)")
    train.add_argument("--case", default="tiny-grads", metavar="NAME|PATH", help="(default: %(default)s)")
    train.add_argument("--steps", type=positive_int, default=20, metavar="K", help="optimizer steps (default: %(default)s)")
    train.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="(default: %(default)s)")
    train.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default: %(default)s)")
    train.add_argument("--accum-steps", type=positive_int, metavar="N", help="micro-steps per optimizer step "
                       "(default: the case's own)")
    train.add_argument("--seed", type=integer, metavar="S", help="override the case's seed")
    train.add_argument("--inject", metavar="KIND[:PARAM]", help="perturb the native accumulation at every step")
    train.add_argument("--oracle", action="store_true", help="also train the whole model in float64")
    train.add_argument("--device", default="cpu", metavar="DEV", help="(default: %(default)s)")
    train.add_argument("--format", choices=("table", "json"), default="table", help="(default: %(default)s)")
    train.add_argument("--output", metavar="FILE", help="write the JSON there, and the PNG plot beside it")

    diff = sub.add_parser("diff", help="compare two saved JSON reports tensor by tensor")
    diff.add_argument("report_a", metavar="A.json")
    diff.add_argument("report_b", metavar="B.json")
    diff.add_argument("--format", choices=("table", "markdown"), default="table", help="(default: %(default)s)")

    sub.add_parser("cases", help="list the built-in cases")

    show = sub.add_parser("show", help="re-render a saved JSON report")
    show.add_argument("report", metavar="REPORT.json")
    _add_output_options(show)
    return parser


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", metavar="DEV", help="cpu, gpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--case", default="embed-attention", metavar="NAME|PATH",
                        help="a built-in case (see `accumcheck cases`) or a case .toml file (default: %(default)s)")
    parser.add_argument("--seed", type=integer, metavar="S", help="override the case's seed")
    parser.add_argument("--inject", metavar="KIND[:PARAM]",
                        help=f"perturb the native accumulation: {', '.join(FAULT_KINDS)}")
    parser.add_argument("--hybridize", action=argparse.BooleanOptionalAction, default=True,
                        help="MXNet: hybridize(static_alloc=True) the Gluon block (default: on)")
    parser.add_argument("--plot", metavar="DIR", help="also draw the plots (PNG and SVG) into DIR")


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
        _data_parallel_defaults(args)
        return {"compare": _compare, "cases": _cases, "show": _show, "sweep": _sweep, "diff": _diff,
                "train": _train}[args.command](args)
    except AccumcheckError as exc:
        rank = _rank()
        print(f"accumcheck: error{f' (rank {rank})' if rank else ''}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("accumcheck: interrupted", file=sys.stderr)
        return 130


def _rank() -> int:
    """This process's rank when torchrun started it (0 otherwise): only rank 0 prints and writes."""
    from .launch import launched_rank

    return launched_rank()


def _data_parallel_defaults(args: argparse.Namespace) -> None:
    """Under torchrun, ``compare`` runs data-parallel on the job's ranks unless told otherwise."""
    from .launch import launched_world_size

    if args.command == "compare" and args.world_size is None:
        args.world_size = launched_world_size()


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
    from .render import sweep_summary
    from .sweep import SweepReport

    print(summary_line(report) if isinstance(report, Report) else
          sweep_summary(report) if isinstance(report, SweepReport) else cross_summary(report))
    print(f"report written to {args.output}")


def _compare(args: argparse.Namespace) -> int:
    from .api import compare, compare_frameworks

    _check_output(args.output)
    _check_plot(args.plot)
    frameworks = args.framework if isinstance(args.framework, list) else [args.framework]
    if args.grad_norms is not None and len(set(frameworks)) > 1:
        raise AccumcheckError("--grad-norms works with one framework at a time; run each --framework on its own")
    if args.world_size is not None and len(set(frameworks)) > 1:
        raise AccumcheckError("--world-size runs one framework (torch); drop the second --framework")
    quiet = _rank() != 0
    with _LazyProgress(enabled=not quiet) as progress:
        if len(set(frameworks)) > 1:
            report = compare_frameworks(case=args.case, frameworks=frameworks, accum_steps=args.accum_steps,
                                        device=args.device, seed=args.seed, inject=args.inject,
                                        progress=progress, hybridize=args.hybridize)
        else:
            report = compare(case=args.case, framework=frameworks[0], accum_steps=args.accum_steps,
                             device=args.device, seed=args.seed, oracle=args.oracle, inject=args.inject,
                             progress=progress, hybridize=args.hybridize, grad_norms=args.grad_norms,
                             dtype=args.dtype, accum_dtype=args.accum_dtype, mode=args.mode,
                             loss_reduction=args.loss_reduction, full_batch=args.full_batch,
                             world_size=args.world_size, reduce_dtype=args.reduce_dtype, inject_rank=args.inject_rank)
    if quiet:  # every rank holds the same report; rank 0 prints it
        return report.exit_code
    _emit(report, args)
    if args.plot:
        _plots(report, args.plot)
    return report.exit_code


def _check_plot(folder: str | None) -> None:
    if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
        raise AccumcheckError(f"--plot {folder}: is a file; give a folder (it is created if missing)")


def _plots(report, folder: str, growth_of=None) -> None:
    from . import plots
    from .crosscheck import CrossReport

    reports = report.reports if isinstance(report, CrossReport) else [report]
    written = []
    for r in reports:
        stem = f"{r.case}-{r.framework}-N{r.accum_steps}"
        written += plots.save(plots.figures(r), folder, stem)
    if growth_of is not None:
        first = growth_of[0]
        written += plots.save({"growth": plots.growth(growth_of)}, folder, f"{first.case}-{first.framework}-sweep")
    print(f"plots written: {', '.join(str(p) for p in written if p.suffix == '.png')} (and .svg)", file=sys.stderr)


def _sweep(args: argparse.Namespace) -> int:
    from .sweep import sweep

    _check_output(args.output)
    _check_plot(args.plot)
    with _LazyProgress() as progress:
        steps = args.accum_steps

        def step_progress(phase: str, done: int, total: int, _steps=steps) -> None:
            progress("sweep", len(progress_state) - 1 + done / total, len(_steps))

        progress_state: list[int] = []
        reports = []
        for n in steps:
            progress_state.append(n)
            reports.append(sweep(args.case, [n], framework=args.framework, device=args.device, seed=args.seed,
                                 inject=args.inject, hybridize=args.hybridize, progress=step_progress).reports[0])
    from .sweep import SweepReport

    result = SweepReport(reports)
    _emit(result, args)
    if args.plot:
        _plots(result.reports[-1], args.plot, growth_of=result.reports)
    return result.exit_code


def _train(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .report import write_atomic
    from .trajectory import save_plot, train

    _check_output(args.output)
    with _LazyProgress() as progress:
        report = train(args.case, steps=args.steps, optimizer=args.optimizer, lr=args.lr, accum_steps=args.accum_steps,
                       seed=args.seed, inject=args.inject, oracle=args.oracle, device=args.device, progress=progress)
    if args.output:
        write_atomic(args.output, report.to_json())
        picture = save_plot(report, Path(args.output).with_suffix(".png"))
        print(f"report written to {args.output}, plot to {picture}")
    elif args.format == "json":
        sys.stdout.write(report.to_json())
    if args.format == "table" or args.output:
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
        console = _console()
        console.print(table)
        console.print(report.summary(), style="bold red" if report.exit_code else "bold green", soft_wrap=True)
    return report.exit_code


def _diff(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .diffing import describe, diff_reports
    from .report import load_report

    a, b = load_report(args.report_a), load_report(args.report_b)
    common, only_a, only_b = diff_reports(a, b)
    changed = [c for c in common if c.changed]
    lines_a, lines_b = f"A: {args.report_a}: {describe(a)}", f"B: {args.report_b}: {describe(b)}"
    summary = (f"{len(changed)} of {len(common)} tensors changed verdict: "
               + ", ".join(f"{c.name} ({c.verdict_a} -> {c.verdict_b})" for c in changed)
               if changed else f"no verdict changed ({len(common)} tensors in both)")
    extra = ([f"only in A: {', '.join(only_a)}"] if only_a else []) + ([f"only in B: {', '.join(only_b)}"] if only_b else [])
    if args.format == "markdown":
        out = [f"- {lines_a}", f"- {lines_b}", "", "| tensor | kind | verdict A | verdict B | ratio A | ratio B |",
               "|---|---|---|---|---:|---:|"]
        for c in common:
            mark = "**" if c.changed else ""
            out.append(f"| `{c.name}` | {c.kind} | {mark}{c.verdict_a}{mark} | {mark}{c.verdict_b}{mark} "
                       f"| {num(c.ratio_a)} | {num(c.ratio_b)} |")
        print("\n".join(out + [""] + [f"- {e}" for e in extra] + ["", f"**{summary}**"]))
    else:
        console = _console()
        console.print(lines_a)
        console.print(lines_b)
        table = Table()
        for title in ("tensor", "kind", "verdict A", "verdict B", "ratio A", "ratio B"):
            table.add_column(title, justify="right" if title.startswith("ratio") else "left", no_wrap=True)
        for c in common:
            style = "bold red" if c.changed else ""
            table.add_row(c.name, c.kind, c.verdict_a, c.verdict_b, num(c.ratio_a), num(c.ratio_b), style=style)
        console.print(table)
        for e in extra:
            console.print(e)
        console.print(summary, style="bold red" if changed else "bold green")
    return 1 if changed or only_a or only_b else 0


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

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.started = time.perf_counter()
        self.progress = None
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> Callable[[str, int, int], None]:
        return self.update

    def update(self, phase: str, done: int, total: int) -> None:
        if self.progress is None:
            if not self.enabled or time.perf_counter() - self.started < self.DELAY_S or not sys.stderr.isatty():
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
