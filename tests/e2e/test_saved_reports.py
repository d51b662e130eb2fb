"""Reports saved by accumcheck 0.1.0 (schema version 1, in tests/fixtures/reports-0.1.0) still load,
render, and rerun from their reproduce line to the same verdicts.

The fixtures were written by 0.1.0's own ``accumcheck compare ... --format json`` and ``sweep``. The
rerun is compared verdict by verdict, not bit for bit: another CPU may round a kernel differently.
(``ci/report_snapshot.py compare`` holds two snapshots of one machine to every bit.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from accumcheck.api import run
from accumcheck.cli import build_parser
from accumcheck.options.spec import RUN_OPTIONS
from accumcheck.render import FORMATS, render
from accumcheck.report import CrossReport, Report, SweepReport, load_report
from accumcheck.run.registry import get_backend
from accumcheck.run.validation import configure

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "reports-0.1.0"
NAMES = ("torch-double-step", "cross", "data-parallel", "full-batch", "mxnet-imperative")


def _needs(report) -> None:
    frameworks = report.frameworks if isinstance(report, CrossReport) else [report.framework]
    for name in frameworks:
        if not get_backend(name, installed=False).available():
            pytest.skip(f"{name} is not installed")


def _rerun(report):
    """The report's reproduce line, parsed by today's command line and run."""
    args = build_parser().parse_args(report.reproduce_command().split()[1:])
    options = {name: getattr(args, name) for name in [o.name for o in RUN_OPTIONS] + ["hybridize"]
               if hasattr(args, name)}
    config = configure(options)
    return config, run(config)


def _verdicts(report):
    if isinstance(report, CrossReport):
        return [_verdicts(r) for r in report.reports] + [[(a.name, a.verdict) for a in report.agreement]]
    return [(t.name, t.kind, t.verdict, t.flagged_ranks) for t in report.tensors]


@pytest.mark.parametrize("name", NAMES)
def test_a_report_of_0_1_0_loads_renders_and_reruns_to_the_same_verdicts(name):
    saved = load_report(FIXTURES / f"{name}.json")
    for fmt in FORMATS:
        assert render(saved, fmt)
    _needs(saved)
    _, again = _rerun(saved)
    assert type(again) is type(saved)
    assert _verdicts(again) == _verdicts(saved) and again.exit_code == saved.exit_code
    first = saved.reports[0] if isinstance(saved, CrossReport) else saved
    assert first.config == (again.reports[0] if isinstance(again, CrossReport) else again).config
    assert again.reproduce_command() == saved.reproduce_command()


def test_the_typed_results_of_0_1_0_are_read_from_its_settings():
    parallel = load_report(FIXTURES / "data-parallel.json")
    assert isinstance(parallel, Report) and parallel.schema_version == 2
    assert parallel.data_parallel.setup.world_size == 2 and parallel.data_parallel.setup.fault_rank == 1
    assert [r.flagged for r in parallel.data_parallel.ranks] == [[], ["shared.weight"]]
    assert "data_parallel" not in parallel.settings and "requested_device" not in parallel.settings
    assert parallel.config["inject_rank"] == 1 and parallel.config["world_size"] == 2
    full = load_report(FIXTURES / "full-batch.json")
    assert full.full_batch.normalisation == "mean" and not full.full_batch.equivalent and full.exit_code == 1
    assert full.reproduce_command().endswith("--full-batch --loss-reduction mean")
    mxnet = load_report(FIXTURES / "mxnet-imperative.json")
    assert mxnet.notes == ["imperative", "oracle mxnet float64"] and mxnet.config["backend_options"] == {
        "hybridize": False}


def test_a_sweep_of_0_1_0_loads_with_its_note():
    sweep = load_report(FIXTURES / "sweep.json")
    assert isinstance(sweep, SweepReport) and [r.accum_steps for r in sweep.reports] == [1, 2]
    assert sweep.reports[0].notes == ["fault not injected: double-step: no running total at N = 1"]
    assert sweep.flagged == [(2, "shared.weight")] and sweep.exit_code == 1


def test_show_and_diff_read_them(tmp_path):
    shown = run_cli("show", str(FIXTURES / "torch-double-step.json"))
    assert shown.returncode == 1 and "FLAGGED 1 of 4 tensors: shared.weight" in shown.stdout
    fresh = tmp_path / "fresh.json"
    assert run_cli("compare", "--case", "shared-weight", "--accum-steps", "4", "--format", "json",
                   "--output", str(fresh)).returncode == 0
    diff = run_cli("diff", str(FIXTURES / "torch-double-step.json"), str(fresh))
    assert diff.returncode == 1 and "shared.weight (diverged -> " in diff.stdout
