"""The ``accumcheck`` command: parse, call the library, hand the result to a renderer, map it to an
exit code.

Exit codes: 0 every tensor faithful, 1 something flagged, 2 usage, input or configuration error,
3 an internal error (a bug in accumcheck, never a finding: one line on stderr, the traceback saved
to a file it names), 128 + the signal's number when interrupted: 130 Ctrl-C (SIGINT), 143 SIGTERM,
129 SIGHUP.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from . import api
from .case.reading import builtin_cases
from .errors import AccumcheckError, RankFailed
from .files import check_output_file, check_output_folder, write_or_rescue
from .options.choices import MODES, REDUCTIONS, STACK_FAULTS, STACKS
from .options.spec import OPTIONS_BY_NAME, RUN_OPTIONS, TRAIN_OPTIONS, TRAIN_RUN_OPTIONS, Option, add_options
from .options.values import comma_list
from .render import FORMATS, render, render_console
from .render.plots import figures, growth, save, save_plot
from .render.table import render_cases
from .render.wording import one_line
from .report import Report, diff_reports, load_report
from .repro.request import check_request as check_repro
from .run.launch import ending_signals, launched_rank, launched_world_size, raise_pending, signal_name, signal_number
from .run.registry import backend_names, backend_options
from .run.setupfile import load_setup, run_setup
from .run.validation import configure
from .version import __version__

SWEEP_OPTIONS = ("framework", "device", "case", "seed", "inject", "force")
INTERNAL_ERROR = 3


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="accumcheck", description="Checks native against manual gradient accumulation, "
                     "judged by floating-point error bounds.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    frameworks = f" (backends here: {', '.join(backend_names())})"
    own = [option for _, option in backend_options().values()]

    compare = sub.add_parser("compare", help="run a case in native and manual mode and judge every tensor")
    for option in RUN_OPTIONS:
        option.add_to(compare.add_argument, help_suffix=frameworks if option.name == "framework" else "")
    _add_backend_options(compare, own)
    _add_output_options(compare, plot=True)

    sweep = sub.add_parser("sweep", help="compare at several numbers of accumulation steps")
    add_options(sweep.add_argument, [o for o in RUN_OPTIONS if o.name in SWEEP_OPTIONS])
    _add_backend_options(sweep, own)
    sweep.add_argument("--accum-steps", type=comma_list(_accum_steps().from_text), metavar="N,N,...",
                       default=[1, 2, 4, 8, 16, 32, 64], help="the numbers of micro-steps (default: 1,2,4,...,64)")
    _add_output_options(sweep, plot=True)

    train = sub.add_parser("train", help="K optimizer steps with native and manual accumulation")
    for option in RUN_OPTIONS:
        if option.name in TRAIN_RUN_OPTIONS:
            option.add_to(train.add_argument, default="tiny-grads" if option.name == "case" else ...)
    add_options(train.add_argument, TRAIN_OPTIONS)
    _add_backend_options(train, own)
    train.add_argument("--format", choices=("table", "json"), default="table", help="(default: %(default)s)")
    train.add_argument("--output", metavar="FILE", help="write the JSON there, and the PNG plot beside it")

    diff = sub.add_parser("diff", help="compare two saved JSON reports tensor by tensor")
    diff.add_argument("report_a", metavar="A.json")
    diff.add_argument("report_b", metavar="B.json")
    diff.add_argument("--format", choices=("table", "markdown"), default="table", help="(default: %(default)s)")

    check = sub.add_parser("check", help="check your own model, set up by a function in a Python file")
    check.add_argument("setup", metavar="FILE.py[:FUNCTION]",
                       help="a Python file whose FUNCTION (default accumcheck_setup) returns check's arguments: "
                            "model, batches, and loss_fn or step, ...")
    check.add_argument("--accum-steps", type=_accum_steps().from_text, metavar="N",
                       help="micro-steps (default: the setup's accum_steps, else every batch)")
    check.add_argument("--inject", metavar="KIND[:PARAM]", help="perturb the native accumulation to prove the check fires")
    check.add_argument("--oracle", action="store_true", default=None, help="also run a float64 copy of the model")
    check.add_argument("--mode", choices=MODES, help="what fills the native slot (torch, mxnet)")
    check.add_argument("--full-batch", action="store_true", default=None,
                       help="also compare with the micro-batches joined into one batch (float64; torch, mxnet)")
    check.add_argument("--loss-reduction", choices=REDUCTIONS,
                       help="how the loop normalises the window, for --full-batch (mean: divides by N)")
    check.add_argument("--train-mode", action="store_true", default=None,
                       help="run the model in training mode, dropout off")
    check.add_argument("--force", action="store_true", default=None,
                       help="run even where the check's memory estimate exceeds what is available")
    budget = OPTIONS_BY_NAME["memory_budget"]
    check.add_argument("--memory-budget", type=budget.from_text, metavar="BYTES", help=budget.help + " (torch)")
    _add_output_options(check, plot=True)

    stack = sub.add_parser("stack", help="run a built-in case through a training stack and check every optimizer step")
    stack.add_argument("--stack", required=True, choices=STACKS, help="the training stack whose loop runs the case")
    stack.add_argument("--case", default="padded-tokens", help="a built-in case or case file (default: %(default)s)")
    stack.add_argument("--accum-steps", type=_accum_steps().from_text, metavar="N",
                       help="micro-batches per optimizer step (default: the case's)")
    stack.add_argument("--batches", type=_accum_steps().from_text, metavar="M",
                       help="micro-batches in the run (default 2N + 2: two full windows and a short one)")
    stack.add_argument("--fault", choices=STACK_FAULTS, help="break the loop on purpose to see the check fire")
    stack.add_argument("--force", action="store_true",
                       help="run even where the run's memory estimate exceeds what is available")
    stack.add_argument("--world-size", type=_accum_steps().from_text, metavar="W",
                       help="run data-parallel on W CPU ranks started by torchrun (default: 1, or the job's under "
                            "torchrun); each step's window is every rank's micro-batches. gluon: W CPU contexts "
                            "in this process, the gradients summed by a kvstore 'local'")
    stack.add_argument("--format", choices=("table", "json", "markdown"), default="table", help="output format (default: %(default)s)")
    stack.add_argument("--output", metavar="FILE", help="write the report to FILE (atomically) instead of stdout")

    sub.add_parser("cases", help="list the built-in cases")

    show = sub.add_parser("show", help="re-render a saved JSON report")
    show.add_argument("report", metavar="REPORT.json")
    _add_output_options(show)
    return parser


def _accum_steps() -> Option:
    return next(o for o in RUN_OPTIONS if o.name == "accum_steps")


def _add_backend_options(parser: argparse.ArgumentParser, options: list[Option]) -> None:
    for option in options:  # unset unless given: only a backend that has the option takes it
        option.add_to(parser.add_argument, default=None)


def _add_output_options(parser: argparse.ArgumentParser, plot: bool = False) -> None:
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: %(default)s)")
    parser.add_argument("--output", metavar="FILE", help="write the report to FILE (atomically) instead of stdout")
    if plot:
        parser.add_argument("--plot", metavar="DIR", help="also draw the plots (PNG and SVG) into DIR")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("give a command: compare, sweep, train, check, stack, diff, cases or show")
    # SIGTERM and SIGHUP end a run as Ctrl-C does: the ranks it started are ended, a progress bar
    # is stopped (the cursor shown again), and the exit code is 128 + the signal's number.
    with ending_signals():
        try:
            try:
                return {"compare": _compare, "cases": _cases, "show": _show, "sweep": _sweep, "diff": _diff,
                        "train": _train, "check": _check, "stack": _stack}[args.command](args)
            except AccumcheckError as exc:
                rank = launched_rank()
                print(f"accumcheck: error{f' (rank {rank})' if rank else ''}: {exc}", file=sys.stderr)
                return 2
            except RankFailed as exc:  # a rank's own internal-error line, not wrapped again
                print(f"accumcheck: {exc}", file=sys.stderr)
                return INTERNAL_ERROR
            except Exception as exc:  # a bug, not a finding: never exit 1, never a bare traceback
                print(f"accumcheck: internal error ({type(exc).__name__}: {_first_line(exc)}); this is not an "
                      f"accumulation finding; {_save_traceback()}", file=sys.stderr)
                return INTERNAL_ERROR
        except KeyboardInterrupt as exc:  # also a signal that came while an error was being told
            return _interrupted(exc)


def _interrupted(exc: KeyboardInterrupt) -> int:
    """Say that the run was interrupted (where stderr still takes it: after SIGHUP the terminal
    may be gone) and return 128 + the signal's number: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP."""
    signum = signal_number(exc)
    try:
        print("accumcheck: interrupted" + (f" ({signal_name(signum)})" if signum != signal.SIGINT else ""),
              file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed or hung-up stderr
        pass
    return 128 + signum


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else "no message"


def _save_traceback() -> str:
    try:
        with tempfile.NamedTemporaryFile("w", prefix="accumcheck-traceback-", suffix=".txt", delete=False) as handle:
            handle.write(f"accumcheck {__version__}\nargv: {sys.argv!r}\n\n{traceback.format_exc()}")
    except OSError:
        return "the traceback could not be saved (the temporary folder takes no files)"
    return f"the full traceback is in {handle.name}; please include it when you report this"


def _options(args: argparse.Namespace, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The run options (and backend options) the parser took, by name."""
    known = [o.name for o in RUN_OPTIONS] + list(backend_options())
    return {name: getattr(args, name) for name in known if hasattr(args, name) and (names is None or name in names)}


def _compare(args: argparse.Namespace) -> int:
    _check_outputs(args)
    if args.world_size is None:  # under torchrun: data-parallel on the job's ranks
        args.world_size = launched_world_size()
    config = configure(_options(args))
    check_repro(config, args.repro, args.shrink)  # what could not be written is refused before the run
    quiet = launched_rank() != 0  # every rank holds the same report; rank 0 prints it
    with _LazyProgress(enabled=not quiet) as progress:
        report = api.run(config, progress)
    if quiet:
        return report.exit_code
    _emit(report, args)
    if args.plot:
        _plots(report.reports if hasattr(report, "reports") else [report], args.plot)
    if args.repro is not None:
        _repro(report, config, args)
    return report.exit_code


def _repro(report: Report, config: Any, args: argparse.Namespace) -> None:
    """Write the --repro script (after --shrink), saying so on stderr: stdout holds the report."""
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    say(api.write_repro(report, config, args.repro, shrink=args.shrink, log=say).says())


def _sweep(args: argparse.Namespace) -> int:
    _check_outputs(args)
    with _LazyProgress() as progress:
        result = api.sweep(args.case, args.accum_steps, progress=progress,
                           **{k: v for k, v in _options(args).items() if k not in ("case", "accum_steps")})
    _emit(result, args)
    if args.plot:
        _plots(result.reports[-1:], args.plot, growth_of=result.reports)
    return result.exit_code


def _train(args: argparse.Namespace) -> int:
    _check_outputs(args)
    with _LazyProgress() as progress:
        report = api.train(args.case, steps=args.steps, optimizer=args.optimizer, lr=args.lr, progress=progress,
                           **{k: v for k, v in _options(args, TRAIN_RUN_OPTIONS + tuple(backend_options())).items()
                              if k != "case"})
    if args.output:
        write_or_rescue("--output", args.output, report.to_json())
        try:
            picture = save_plot(report, Path(args.output).with_suffix(".png"))
        except OSError as exc:
            raise AccumcheckError(f"--output {args.output}: the report was written, but not the plot beside it "
                                  f"({exc.strerror})") from None
        print(f"report written to {args.output}, plot to {picture}")
    elif args.format == "json":
        sys.stdout.write(report.to_json())
    if args.format == "table" or args.output:
        render_console(report, _console())
    return report.exit_code


def _check(args: argparse.Namespace) -> int:
    _check_outputs(args)
    setup = load_setup(args.setup)
    overrides = {name: getattr(args, name) for name in ("accum_steps", "inject", "oracle", "mode", "full_batch",
                                                        "loss_reduction", "train_mode", "force", "memory_budget")}
    with _LazyProgress() as progress:
        report = run_setup(args.setup, setup, {k: v for k, v in overrides.items() if v is not None}, progress)
    _emit(report, args)
    if args.plot:
        _plots([report], args.plot)
    return report.exit_code


def _stack(args: argparse.Namespace) -> int:
    _check_outputs(args)
    launched = launched_world_size()
    if launched is not None and args.world_size not in (None, launched):
        raise AccumcheckError(f"--world-size {args.world_size}: this process was started by torchrun with "
                              f"WORLD_SIZE={launched}; pass --world-size {launched} or leave it out")
    report = api.stack(args.stack, args.case, args.accum_steps, args.batches, args.fault, force=args.force,
                       world_size=launched or args.world_size or 1)
    if launched is not None:
        from .torch.stacks.launch import write_rank_report

        write_rank_report(report)  # for the command that started the ranks, where one did
        if launched_rank() != 0:  # every rank holds the same report; rank 0 prints it
            return report.exit_code
    _emit(report, args)
    return report.exit_code


def _diff(args: argparse.Namespace) -> int:
    diff = diff_reports(load_report(args.report_a), load_report(args.report_b), (args.report_a, args.report_b))
    _drawable(diff, args.format, f"{args.report_a} and {args.report_b}")
    if args.format == "markdown":
        sys.stdout.write(render(diff, "markdown"))
    else:
        render_console(diff, _console())
    return diff.exit_code


def _cases(args: argparse.Namespace) -> int:
    render_cases(builtin_cases(), _console())
    return 0


def _show(args: argparse.Namespace) -> int:
    _check_outputs(args)
    report = load_report(args.report)
    _emit(report, args, _drawable(report, args.format, args.report))
    return report.exit_code


def _drawable(report: Any, fmt: str, source: str) -> str:
    """A report read from a file, drawn off screen in ``fmt``: a file whose fields are each of the
    right type but do not fit together (edited by hand, or cut short) is refused in one line
    before anything is printed."""
    try:
        return render(report, fmt)
    except AccumcheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the drawing trips on, the file is the cause
        raise AccumcheckError(f"{source}: its fields do not fit together, so it cannot be shown "
                              f"({type(exc).__name__}: {_first_line(exc)}); pass a report as accumcheck wrote it "
                              f"(if it is one, this is a bug: {_save_traceback()})") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Fail before any work when an output could not be written."""
    if getattr(args, "output", None) is not None:
        check_output_file("--output", args.output)
        if args.command == "train":  # the plot goes beside the report
            check_output_file("--output", Path(args.output).with_suffix(".png"))
    if getattr(args, "plot", None) is not None:
        check_output_folder("--plot", args.plot)


def _console() -> Any:
    from rich.console import Console

    # A terminal has its width, and COLUMNS (read by rich) says a pipe's; a pipe without it gets
    # 120 columns rather than rich's 80.
    columns = os.environ.get("COLUMNS", "")
    return Console(width=None if sys.stdout.isatty() or (columns.isdigit() and int(columns) > 0) else 120)


def _emit(report: Any, args: argparse.Namespace, text: str | None = None) -> None:
    """Print the report, or write it to --output; ``text``: its rendering in --format, if made."""
    if args.output is None and args.format == "table":
        render_console(report, _console())  # drawn for the terminal: its width, its colours
        return
    text = render(report, args.format) if text is None else text
    if args.output is None:
        sys.stdout.write(text)
        return
    write_or_rescue("--output", args.output, text)
    print(one_line(report))
    print(f"report written to {args.output}")


def _plots(reports: list[Report], folder: str, growth_of: list[Report] | None = None) -> None:
    written = []
    try:
        for r in reports:
            written += save(figures(r), folder, f"{r.case}-{r.framework}-N{r.accum_steps}")
        if growth_of is not None:
            first = growth_of[0]
            written += save({"growth": growth(growth_of)}, folder, f"{first.case}-{first.framework}-sweep")
    except OSError as exc:
        raise AccumcheckError(f"--plot {folder}: cannot draw the plots there ({exc.strerror}); the report above "
                              "is complete") from None
    print(f"plots written: {', '.join(str(p) for p in written if p.suffix == '.png')} (and .svg)", file=sys.stderr)


class _LazyProgress:
    """A progress bar on stderr that appears only once a run has taken more than a second,
    and only on a terminal."""

    DELAY_S = 1.0

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.started = time.perf_counter()
        self.progress: Any = None
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> Callable[[str, float, int], None]:
        return self.update

    def update(self, phase: str, done: float, total: int) -> None:
        """The run's progress, at each of its steps; also where a signal whose first Terminated
        was swallowed (``launch.raise_pending``) ends the run."""
        raise_pending()
        if self.progress is None:
            if not self.enabled or time.perf_counter() - self.started < self.DELAY_S or not sys.stderr.isatty():
                return
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            # elapsed, then the time left at the rate so far: a long run says how long it will take
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                     console=Console(stderr=True), transient=True)
            self.progress.start()
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(self.tasks[phase], completed=done)

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        """Stop the bar: erase it and show the cursor again, also when the run ends by an error or
        a signal (SIGINT, SIGTERM and SIGHUP are raised here, see ``main``)."""
        if self.progress is None:
            return
        try:
            self.progress.stop()
        except (OSError, ValueError):  # the terminal is gone (SIGHUP): nothing is left to restore
            pass
        except Exception:
            if exc_type is None:
                raise
            # A signal inside the bar's own start leaves rich half started, and its stop trips
            # on what start had not done yet: the cursor is shown here instead.
            try:
                self.progress.console.show_cursor(True)
            except (OSError, ValueError):
                pass


if __name__ == "__main__":
    sys.exit(main())
