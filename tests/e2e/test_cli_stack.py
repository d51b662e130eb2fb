"""accumcheck stack: a built-in case through a training stack's loop, every optimizer step
checked; exit codes as for compare (0 faithful, 1 flagged, 2 a user mistake), and the pytest
fixture that guards a stack at the run's --accum-steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accumcheck.cli import main

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def accumcheck(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it, piped at 120 columns."""
    return subprocess.run([str(Path(sys.executable).parent / "accumcheck"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600, env={**os.environ, "COLUMNS": "120"})


def test_the_trainer_on_padded_tokens_is_faithful_and_says_how_much_it_checked():
    run = accumcheck("stack", "--stack", "transformers", "--accum-steps", "4")
    assert run.returncode == 0, run.stderr
    assert "FAITHFUL: every optimizer step applied the gradient of its window as one batch (3 optimizer steps " \
           "checked, 10 micro-batches seen of the 10 the data holds)" in run.stdout
    assert "accumcheck stack --stack transformers --case padded-tokens --accum-steps 4" in run.stdout


def test_a_fault_is_flagged_exit_1_and_the_json_report_shows_again(tmp_path):
    out = tmp_path / "stack.json"
    run = accumcheck("stack", "--stack", "transformers", "--accum-steps", "4", "--fault", "loss-over-n",
                     "--format", "json", "--output", str(out))
    assert run.returncode == 1, run.stderr
    data = json.loads(out.read_text())
    assert data["kind"] == "stack" and [s["result"]["matches"] for s in data["steps"]] == ["1/N"] * 3
    shown = accumcheck("show", str(out))
    assert shown.returncode == 1 and "constant-factor   0.250 (1/N)" in shown.stdout


@pytest.mark.parametrize("args, message", [
    (["--stack", "megatron"], "argument --stack: invalid choice: 'megatron'"),
    (["--stack", "transformers", "--fault", "step-per-micro-batch"], "not a fault the transformers stack runs"),
    (["--stack", "transformers", "--case", "nope"], "unknown case 'nope'"),
    (["--stack", "transformers", "--batches", "0"], "argument --batches"),
    (["--stack", "transformers", "--case", "tiny-grads"], "a training stack runs token cases"),
])
def test_user_mistakes_are_one_line_and_exit_2(args, message, capsys):
    try:  # in-process: the same main() the console script runs
        code = main(["stack", *args])
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code
    out, err = capsys.readouterr()
    assert code == 2 and message in err
    assert "Traceback" not in err and out == ""


def test_a_report_shown_as_csv_is_refused_in_one_line(tmp_path):
    out = tmp_path / "stack.json"
    accumcheck("stack", "--stack", "transformers", "--accum-steps", "2", "--format", "json", "--output", str(out))
    run = accumcheck("show", str(out), "--format", "csv")
    assert run.returncode == 2 and "a training-stack report is written as table or json or markdown" in run.stderr


def test_the_fixture_guards_a_stack_at_each_accum_steps(pytester):
    pytester.makepyfile("""
        import accumcheck

        def test_trainer(accum_stack, accum_steps):
            report = accum_stack("transformers", batches=accum_steps + 1)
            assert report.accum_steps == accum_steps and len(report.steps) == 2
            accumcheck.assert_faithful(report)

        def test_trainer_fault(accum_stack):
            report = accum_stack("transformers", fault="loss-over-n", batches=4)
            accumcheck.assert_faithful(report)
    """)
    result = pytester.runpytest_subprocess("--accum-steps", "2,3", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*The training stack's optimizer steps are not their windows' gradients*",
                                 "*step 0 (micro-batches 0-1): constant-factor: *matches 1/N*"])
