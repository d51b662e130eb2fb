"""--memory-budget from every way in: ``accumcheck compare`` and ``accumcheck check`` say how many
groups ran and refuse a bad value or a budget below one tensor in one line (exit 2), and the
pytest plugin hands ``--accum-memory-budget`` to its fixtures."""

import pytest
from budget_checks import tightest
from conftest import needs_torch, run_cli

from accumcheck.report import load_report

pytestmark = needs_torch

SETUP = '''
import torch


def accumcheck_setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)) for _ in range(4)]
    return {"model": model, "batches": batches, "loss_fn": torch.nn.functional.cross_entropy}
'''


def test_compare_says_how_many_groups_ran_and_reruns_with_the_budget(tmp_path):
    least = tightest(case="shared-weight", framework="torch")
    out = tmp_path / "r.json"
    done = run_cli("compare", "--framework", "torch", "--case", "shared-weight", "--accum-steps", "4", "--inject",
                   "scale", "--memory-budget", str(least), "--format", "json", "--output", str(out))
    assert done.returncode == 1, done.stderr
    report = load_report(out)
    assert report.groups == 2 and [t.name for t in report.flagged] == ["shared.weight"]
    assert report.reproduce_command().endswith(f"--memory-budget {least}")
    shown = run_cli("show", str(out))
    assert "judged in 2 groups to stay within the memory budget of" in shown.stdout


@pytest.mark.parametrize("args, message", [
    (["--memory-budget", "2 lots"], "accumcheck compare: error: argument --memory-budget: '2 lots' is not a number of "
                                    "bytes (e.g. 512M, 2G, 1.5GiB or 1000000000)"),
    (["--memory-budget", "1M"], "accumcheck: error: --memory-budget 1.0 MiB: tensor shared.weight alone needs"),
    (["--memory-budget", "1G", "--oracle"], "accumcheck: error: --memory-budget 1.0 GiB: not with --oracle (the "
                                            "float64 oracle runs a float64 copy of the whole model, beyond any "
                                            "budget); drop one of the two"),
])
def test_compare_refuses_in_one_line(args, message):
    done = run_cli("compare", "--framework", "torch", "--case", "shared-weight", *args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


def test_check_takes_a_budget_for_your_model(tmp_path):
    (tmp_path / "setup.py").write_text(SETUP)
    out = tmp_path / "r.json"
    done = run_cli("check", "setup.py", "--memory-budget", "129M", "--inject", "drop-step", "--format", "json", "--output", str(out),
                   cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    report = load_report(out)
    assert report.groups == 1 and report.config["memory_budget"] == 129 * 2**20
    assert "--memory-budget 135266304" in report.reproduce_command()
    small = run_cli("check", "setup.py", "--memory-budget", "1K", cwd=tmp_path)
    assert small.returncode == 2 and "give at least" in small.stderr and small.stderr.count("\n") == 1


def test_the_plugin_hands_the_budget_to_its_fixtures(pytester):
    least = tightest(case="shared-weight", framework="torch")
    pytester.makepyfile("""
        import torch

        def test_case(accum_compare):
            report = accum_compare("shared-weight", inject="scale")
            assert report.groups == 2 and report.exit_code == 1
            assert accum_compare("shared-weight", oracle=True).groups == 1  # what it cannot hold: not given

        def test_own(accum_check):
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
            data = [(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(4)]
            report = accum_check(model, torch.nn.functional.mse_loss, data)
            assert report.config["memory_budget"] > 0
    """)
    result = pytester.runpytest_subprocess("--accum-memory-budget", str(least), "--accum-framework", "torch",
                                           "--accum-steps", "4")
    result.assert_outcomes(passed=2)
    bad = pytester.runpytest("--accum-memory-budget", "x")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*argument --accum-memory-budget: 'x' is not a number of bytes*"])
