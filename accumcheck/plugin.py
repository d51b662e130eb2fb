"""pytest plugin: ``pytest --accum-steps 16,32`` runs accumulation checks at each setting.

Hooks and fixtures only; the logic lives in the library. Options (group "accumcheck"):
--accum-steps, --accum-framework, --accum-device, --accum-case, --accum-world-size, --accum-report. Tests that ask
for the fixtures ``accum_steps``, ``accum_framework``, ``accum_device`` or ``accum_case`` run
once per combination; ``accum_compare`` runs a case with them and saves its report.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from .backends import FRAMEWORKS
from .options import choice_list, positive_int, positive_int_list

DEVICES = ("cpu", "gpu")


def _case_list(text: str) -> list[str]:
    from .cases import builtin_case_names

    items = [item.strip() for item in text.split(",")]
    known = builtin_case_names()
    for item in items:
        if item not in known and not item.endswith(".toml"):
            raise argparse.ArgumentTypeError(f"{item!r} is not a built-in case ({', '.join(known)}) nor a .toml path")
    return items


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("accumcheck", "gradient accumulation checks (accumcheck)")
    group.addoption("--accum-steps", type=positive_int_list, metavar="N[,N...]", default=None,
                    help="accumulation steps to run each check at, e.g. 16,32 (default: each case's own)")
    group.addoption("--accum-framework", type=choice_list(FRAMEWORKS), metavar="NAME[,NAME]", default=None,
                    help=f"frameworks to check: {','.join(FRAMEWORKS)} (default: the installed ones)")
    group.addoption("--accum-device", type=choice_list(DEVICES), metavar="DEV[,DEV]", default=None,
                    help="devices: cpu,gpu; gpu runs are skipped where there is none (default: cpu)")
    group.addoption("--accum-case", type=_case_list, metavar="NAME[,NAME]", default=None,
                    help="cases for tests that use accum_case (default: every built-in case)")
    group.addoption("--accum-world-size", type=positive_int, metavar="W", default=None,
                    help="run accum_compare data-parallel on W ranks (torch.distributed; default: one process)")
    group.addoption("--accum-report", metavar="DIR", default=None,
                    help="write each accum_compare run's JSON and markdown report into DIR (default: none)")


def _settings(config: pytest.Config) -> dict[str, list]:
    from .backends import installed_frameworks
    from .cases import builtin_case_names

    return {
        "steps": config.getoption("--accum-steps") or [None],
        "framework": config.getoption("--accum-framework") or installed_frameworks() or list(FRAMEWORKS),
        "device": config.getoption("--accum-device") or ["cpu"],
        "case": config.getoption("--accum-case") or builtin_case_names(),
    }


def pytest_report_header(config: pytest.Config) -> str:
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
    s = _settings(metafunc.config)
    if "accum_steps" in metafunc.fixturenames:
        metafunc.parametrize("accum_steps", s["steps"], indirect=True,
                             ids=[f"N{n}" if n else "Ndefault" for n in s["steps"]])
    if "accum_framework" in metafunc.fixturenames:
        params = [pytest.param(f, marks=() if importlib.util.find_spec(f) else
                                pytest.mark.skip(reason=f"{f} is not installed (pip install 'accumcheck[{f}]')"))
                  for f in s["framework"]]
        metafunc.parametrize("accum_framework", params, indirect=True, ids=s["framework"])
    if "accum_device" in metafunc.fixturenames:
        metafunc.parametrize("accum_device", s["device"], indirect=True, ids=s["device"])
    if "accum_case" in metafunc.fixturenames:
        metafunc.parametrize("accum_case", s["case"], indirect=True, ids=[Path(c).stem for c in s["case"]])


@pytest.fixture
def accum_steps(request: pytest.FixtureRequest) -> int | None:
    """Accumulation steps of this run (None: the case's own)."""
    return getattr(request, "param", None)


@pytest.fixture
def accum_framework(request: pytest.FixtureRequest) -> str:
    """The framework of this run: "torch" or "mxnet"."""
    return getattr(request, "param", "torch")


@pytest.fixture
def accum_device(request: pytest.FixtureRequest, accum_framework: str) -> str:
    """The device of this run; a gpu run is skipped where the framework sees no GPU."""
    device = getattr(request, "param", "cpu")
    if device == "gpu" and not _has_gpu(accum_framework):
        pytest.skip(f"{accum_framework} sees no GPU")
    return device


@pytest.fixture
def accum_case(request: pytest.FixtureRequest) -> str:
    """A built-in case name (or case file) of this run."""
    return getattr(request, "param", "embed-attention")


@pytest.fixture
def accum_compare(request: pytest.FixtureRequest, accum_framework: str, accum_device: str,
                  accum_steps: int | None) -> Callable[..., Any]:
    """``accum_compare(case, **kwargs)``: ``accumcheck.compare`` with this run's framework,
    device and steps (and ``world_size`` from --accum-world-size, for PyTorch); the report is
    saved under --accum-report when given."""
    import accumcheck

    world = request.config.getoption("--accum-world-size")

    def run(case: str = "embed-attention", **kwargs: Any) -> Any:
        options = {"framework": accum_framework, "device": accum_device, "accum_steps": accum_steps, **kwargs}
        if world and accum_framework == "torch":
            options.setdefault("world_size", world)
        report = accumcheck.compare(case, **options)
        _save(request, report)
        return report

    return run


def _save(request: pytest.FixtureRequest, report: Any) -> None:
    folder = request.config.getoption("--accum-report")
    if not folder:
        return
    from .render import markdown
    from .report import write_atomic

    Path(folder).mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid).strip("_")
    write_atomic(Path(folder) / f"{stem}.json", report.to_json())
    write_atomic(Path(folder) / f"{stem}.md", markdown(report))


def _has_gpu(framework: str) -> bool:
    if framework == "torch":
        import torch

        return torch.cuda.is_available()
    if framework == "mxnet":
        from .backends.mxnet_backend import _mx

        return _mx().context.num_gpus() > 0
    return False
