"""pytest plugin: ``pytest --accum-steps 16,32`` runs accumulation checks at each setting.

Options, hooks and fixtures only; the logic lives in the library, imported when a test asks for
it, so that a test run that does not use accumcheck pays nothing for it being installed. Options
(group "accumcheck") come from the same specification as the command line's:
--accum-steps, --accum-framework, --accum-device, --accum-case (comma lists: one run of each
test per item), --accum-world-size, --accum-memory-budget (given to ``accum_compare`` and
``accum_check`` where the run can take it), --accum-report. Tests that ask for the fixtures
``accum_steps``, ``accum_framework``, ``accum_device`` or ``accum_case`` run once per
combination; ``accum_compare`` runs a case with them and saves its report, ``accum_check`` runs
your own model's check at the run's steps and saves its report, ``accum_stack`` runs a built-in
case through a training stack at the run's steps.

A test in which ``accumcheck.compare`` itself raised (an AccumcheckError for a bad case or
option, or a bug in accumcheck) is reported as an error (E), not as a failure (F): a failure is
an accumulation finding, an error is a check that could not run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

from .options.spec import RUN_OPTIONS, add_options

_PLUGIN_OPTIONS = [option for option in RUN_OPTIONS if option.pytest]

# On an item whose accum_compare call raised: (one-line description, the exception raised).
_RAISED = pytest.StashKey[tuple[str, BaseException]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("accumcheck", "gradient accumulation checks (accumcheck)")
    add_options(group.addoption, _PLUGIN_OPTIONS, prefix="--accum-", as_lists=True)
    group.addoption("--accum-report", metavar="DIR", default=None,
                    help="write each accum_compare run's JSON and markdown report into DIR (default: none)")


def pytest_configure(config: pytest.Config) -> None:
    """Refuse an unknown framework or case (a typo would otherwise skip), or a report folder that
    could take no files, before any test runs."""
    folder = config.getoption("--accum-report")
    if folder:
        from .errors import AccumcheckError
        from .files import check_output_folder

        try:
            check_output_folder("--accum-report", folder)
        except AccumcheckError as exc:
            raise pytest.UsageError(f"argument --accum-report: {exc}") from None
    frameworks, cases = _names(config.getoption("--accum-framework")), config.getoption("--accum-case") or []
    if not frameworks and not cases:
        return
    from .case.reading import resolve_case
    from .errors import AccumcheckError
    from .run.registry import backend_names

    for name in frameworks:
        if name not in backend_names():
            raise pytest.UsageError(f"argument --accum-framework: {name!r} is not a framework here "
                                    f"(known: {', '.join(backend_names())})")
    for case in cases:
        try:
            resolve_case(case)
        except AccumcheckError as exc:
            raise pytest.UsageError(f"argument --accum-case: {exc}") from None


def _settings(config: pytest.Config) -> dict[str, list]:
    """The values each parametrised fixture runs over (the options given, else the defaults:
    the case's own steps, the installed frameworks, the CPU, every built-in case)."""
    from .case.reading import builtin_case_names
    from .run.registry import installed_backends

    return {
        "steps": config.getoption("--accum-steps") or [None],
        "framework": _names(config.getoption("--accum-framework")) or installed_backends(),
        "device": config.getoption("--accum-device") or ["cpu"],
        "case": config.getoption("--accum-case") or builtin_case_names(),
    }


def _names(lists: list | None) -> list[str]:
    """--accum-framework items (each parsed as a tuple of names), flattened."""
    return [name for item in lists or [] for name in item]


def pytest_report_header(config: pytest.Config) -> str | None:
    if not any(config.getoption(f"--accum-{name}") for name in ("steps", "framework", "device", "case", "world-size")):
        return None  # nothing asked of accumcheck: say nothing, load nothing
    s = _settings(config)
    steps = ",".join("case default" if n is None else str(n) for n in s["steps"])
    flags = (f"--accum-steps {steps} --accum-framework {','.join(s['framework'])} "
             f"--accum-device {','.join(s['device'])}")
    world = config.getoption("--accum-world-size")
    if world:
        flags += f" --accum-world-size {world}"
    return (f"accumcheck: {flags}; reproduce one run with: accumcheck compare --framework F --device D "
            f"--case C --accum-steps N" + (f" --world-size {world}" if world else ""))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    wanted = {"accum_steps", "accum_framework", "accum_device", "accum_case"} & set(metafunc.fixturenames)
    if not wanted:
        return
    s = _settings(metafunc.config)
    if "accum_steps" in wanted:
        metafunc.parametrize("accum_steps", s["steps"], indirect=True,
                             ids=[f"N{n}" if n else "Ndefault" for n in s["steps"]])
    if "accum_framework" in wanted:
        metafunc.parametrize("accum_framework", [_framework_param(name) for name in s["framework"]], indirect=True,
                             ids=s["framework"])
    if "accum_device" in wanted:
        metafunc.parametrize("accum_device", s["device"], indirect=True, ids=s["device"])
    if "accum_case" in wanted:
        metafunc.parametrize("accum_case", s["case"], indirect=True, ids=[Path(str(c)).stem for c in s["case"]])


def _framework_param(name: str) -> Any:
    """A framework to run, skipped (with the install hint) where it is not installed."""
    from .errors import AccumcheckError
    from .run.registry import get_backend

    try:
        get_backend(name)
    except AccumcheckError as exc:
        return pytest.param(name, marks=pytest.mark.skip(reason=str(exc)))
    return name


@pytest.fixture
def accum_steps(request: pytest.FixtureRequest) -> int | None:
    """Accumulation steps of this run (None: the case's own)."""
    return getattr(request, "param", None)


@pytest.fixture
def accum_framework(request: pytest.FixtureRequest) -> str | None:
    """The framework of this run (None: the first installed)."""
    return getattr(request, "param", None)


@pytest.fixture
def accum_device(request: pytest.FixtureRequest, accum_framework: str | None) -> str:
    """The device of this run; a run on a GPU is skipped where the framework sees none."""
    from .options.values import device_kind
    from .run.registry import default_backend, get_backend

    device = getattr(request, "param", "cpu")
    kind = device_kind(device)
    name = accum_framework or default_backend()
    if kind != "cpu" and not get_backend(name).has_device(kind):
        pytest.skip(f"{name} sees no GPU")
    return device


@pytest.fixture
def accum_case(request: pytest.FixtureRequest) -> str:
    """A built-in case name (or case file) of this run."""
    return getattr(request, "param", "embed-attention")


@pytest.fixture
def accum_compare(request: pytest.FixtureRequest, accum_framework: str | None, accum_device: str,
                  accum_steps: int | None) -> Callable[..., Any]:
    """``accum_compare(case, **kwargs)``: ``accumcheck.compare`` with this run's framework,
    device and steps (and ``world_size`` from --accum-world-size where the backend runs
    data-parallel); the report is saved under --accum-report when given."""
    from .api import compare
    from .run.registry import default_backend, get_backend

    world = request.config.getoption("--accum-world-size")
    budget = request.config.getoption("--accum-memory-budget")
    framework = accum_framework or default_backend()

    def run(case: str = "embed-attention", **kwargs: Any) -> Any:
        options = {"framework": framework, "device": accum_device, "accum_steps": accum_steps, **kwargs}
        if world and get_backend(framework).capabilities.data_parallel:
            options.setdefault("world_size", world)
        from .run.budget import UNBUDGETED

        if budget and get_backend(framework).capabilities.memory_budget and not any(
                options.get(name) for name in UNBUDGETED):
            options.setdefault("memory_budget", budget)
        return _saved_run(request, compare, case, **options)

    return run


@pytest.fixture
def accum_check(request: pytest.FixtureRequest, accum_steps: int | None) -> Callable[..., Any]:
    """``accum_check(model, loss_fn=None, batches=..., **kwargs)``: your own model's check
    (``accumcheck.<framework>.check``, the framework told by the model's class; JAX's
    ``accum_check(params, loss_fn, batches)``) at this run's steps (--accum-steps;
    ``accum_steps=`` when not given, default 16), with --accum-memory-budget where that check
    honours a budget; the report is saved under --accum-report when given."""
    from .run.budget import UNBUDGETED
    from .run.checkargs import shape_of
    from .run.setupfile import user_check

    budget = request.config.getoption("--accum-memory-budget")

    def check(model: Any, *args: Any, **kwargs: Any) -> Any:
        fn = user_check(model, "accum_check", args[0] if args else kwargs.get("params"))[1]
        shape = shape_of(fn)
        if shape is not None:
            shape.refuse_renamed(kwargs, "accum_check")
        if budget and shape is not None and "memory_budget" in shape.honoured and not any(
                kwargs.get(name) for name in UNBUDGETED):
            kwargs.setdefault("memory_budget", budget)
        return fn(model, *args, **kwargs)

    def run(model: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["accum_steps"] = accum_steps if accum_steps is not None else kwargs.get("accum_steps", 16)
        return _saved_run(request, check, model, *args, **kwargs)

    return run


@pytest.fixture
def accum_stack(request: pytest.FixtureRequest, accum_steps: int | None) -> Callable[..., Any]:
    """``accum_stack(stack, case="padded-tokens", batches=None, fault=None)``: ``accumcheck
    stack`` (a built-in case through Hugging Face's Trainer, accelerate, Lightning or Gluon's
    Trainer) at this run's steps (--accum-steps; the case's N when not given); the report is
    saved under --accum-report when given."""
    from .api import stack

    def run(name: str, case: str = "padded-tokens", **kwargs: Any) -> Any:
        return _saved_run(request, stack, name, case, accum_steps, **kwargs)

    return run


def _saved_run(request: pytest.FixtureRequest, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``'s report, saved under --accum-report; an exception it raises is
    marked as one accumcheck raised (an error, not a finding)."""
    try:
        report = fn(*args, **kwargs)
    except Exception as exc:  # accumcheck could not run the check: an error, not a finding
        request.node.stash[_RAISED] = (_one_line(exc), exc)
        raise
    _save(request, report)
    return report


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


# An old-style wrapper: ``wrapper=True`` needs pluggy 1.2, which pytest 7.4 does not require.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Tag the call report of a test that failed because accumcheck raised (that very exception,
    not a later assertion of the test's own), and say so under its traceback."""
    outcome = yield
    if call.when != "call" or _RAISED not in item.stash:
        return
    line, exc = item.stash[_RAISED]
    del item.stash[_RAISED]  # the exception holds the frames of the run: let them go
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and call.excinfo.value is exc:
        report.accumcheck_error = line
        text = f"accumcheck raised {line}: this is an error in running the check, not an accumulation finding"
        if hasattr(report.longrepr, "addsection"):
            report.longrepr.addsection("accumcheck", text)
        else:
            report.sections.append(("accumcheck", text))


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    """A test in which accumcheck raised counts among the errors (E), not the failures."""
    if report.when == "call" and report.failed and getattr(report, "accumcheck_error", None):
        return "error", "E", "ERROR"
    return None


def _save(request: pytest.FixtureRequest, report: Any) -> None:
    folder = request.config.getoption("--accum-report")
    if not folder:
        return
    from .render import render
    from .report import write_atomic

    Path(folder).mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid).strip("_")
    write_atomic(Path(folder) / f"{stem}.json", report.to_json())
    write_atomic(Path(folder) / f"{stem}.md", render(report, "markdown"))
