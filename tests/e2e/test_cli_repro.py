"""``accumcheck compare --repro FILE.py [--shrink]`` from the command line: the report as ever, the
script and its data beside it, the exit code unchanged, and bad input refused in one line."""

import json
import subprocess
import sys

import pytest
from conftest import needs_torch, run_cli

from accumcheck.case.reading import builtin_case, load_case
from accumcheck.repro.shrink import size


def run_cli_script(path):
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=path.parent)


def _one_line_error(result, words):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert words in result.stderr, result.stderr


@needs_torch
@pytest.mark.parametrize("inject, code", [(None, 0), ("drop-step", 1)])
def test_repro_writes_the_script_beside_the_report_and_keeps_the_exit_code(tmp_path, inject, code):
    args = ["compare", "--framework", "torch", "--case", "shared-weight", "--accum-steps", "4",
            "--repro", str(tmp_path / "bug.py")] + (["--inject", inject] if inject else [])
    result = run_cli(*args)
    assert result.returncode == code, result.stderr
    assert "shared-weight" in result.stdout and "reproduce: accumcheck compare" in result.stdout  # the report
    assert f"reproduction written: {tmp_path / 'bug.py'} (with {tmp_path / 'bug.npz'})" in result.stderr
    assert (tmp_path / "bug.py").is_file() and (tmp_path / "bug.npz").is_file() and not (tmp_path / "bug.toml").exists()
    script = run_cli_script(tmp_path / "bug.py")
    assert script.returncode == code, script.stdout + script.stderr
    assert ("DIVERGED" if code else "AGREE") in script.stdout
    if inject:
        assert "shared.weight" in script.stdout


@needs_torch
def test_repro_with_a_json_report_on_stdout_leaves_stdout_json(tmp_path):
    result = run_cli("compare", "--framework", "torch", "--case", "tiny-grads", "--accum-steps", "2", "--format",
                     "json", "--repro", str(tmp_path / "r.py"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["case"] == "tiny-grads"
    assert "reproduction written" in result.stderr


@pytest.mark.parametrize("args, words", [
    (["--shrink"], "--shrink: shrinks the case of a --repro script; add --repro repro.py"),
    (["--repro", "bug.txt"], "--repro bug.txt: give the script a .py name"),
    (["--repro", "no/such/folder/bug.py"], "folder no/such/folder does not exist"),
    (["--repro", "folder.py"], "--repro folder.py: is a folder"),
    (["--repro", ""], "is not a non-empty text"),
    (["--framework", "torch", "--world-size", "2", "--repro", "bug.py"], "a script reproduces a single-process run"),
    (["--framework", "torch", "--dtype", "bfloat16", "--repro", "bug.py"], "drop --dtype bfloat16"),
    (["--framework", "torch", "--mode", "accumulator", "--repro", "bug.py"], "drop --mode accumulator"),
    (["--framework", "torch,mxnet", "--repro", "bug.py"], "--repro bug.py: works with one framework at a time"),
    (["--framework", "torch,mxnet", "--shrink"], "--shrink: works with one framework at a time"),
])
def test_bad_repro_input_is_one_line_and_exit_2_before_any_run(tmp_path, args, words):
    (tmp_path / "folder.py").mkdir()
    result = run_cli("compare", "--case", "shared-weight", "--accum-steps", "2", *args, cwd=tmp_path)
    _one_line_error(result, words)
    assert not (tmp_path / "bug.npz").exists() and result.stdout == ""


def test_only_compare_takes_repro():
    for command in (["sweep"], ["train"], ["check", "setup.py"]):
        result = run_cli(*command, "--repro", "bug.py")
        assert result.returncode == 2 and "unrecognized arguments: --repro" in result.stderr


@needs_torch
def test_shrink_writes_a_smaller_case_that_is_still_flagged(tmp_path):
    result = run_cli("compare", "--framework", "torch", "--case", "conditional-branch", "--inject", "drop-step",
                     "--accum-steps", "8", "--repro", str(tmp_path / "repro.py"), "--shrink")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith("shrink: kept ") for line in lines)
    assert any(line.startswith("shrunk conditional-branch: ") and "N 8 -> " in line for line in lines), lines
    assert lines[-1].startswith("reproduction written:") and "the case" in lines[-1]
    shrunk = load_case(tmp_path / "repro.toml")
    before, after = size(builtin_case("conditional-branch"), 8), size(shrunk, shrunk.accum_steps)
    assert all(after[m] <= before[m] for m in before) and after != before
    again = run_cli("compare", "--framework", "torch", "--case", str(tmp_path / "repro.toml"), "--inject",
                    "drop-step:inp.weight")
    assert again.returncode == 1 and "inp.weight" in again.stdout, again.stdout + again.stderr
    script = run_cli_script(tmp_path / "repro.py")
    assert script.returncode == 1 and "inp.weight" in script.stdout


@needs_torch
def test_shrink_of_a_faithful_run_says_so_and_writes_the_script(tmp_path):
    result = run_cli("compare", "--framework", "torch", "--case", "tiny-grads", "--accum-steps", "2",
                     "--repro", str(tmp_path / "r.py"), "--shrink")
    assert result.returncode == 0, result.stderr
    assert "--shrink: case tiny-grads flagged nothing, so there is nothing to shrink" in result.stderr
    assert (tmp_path / "r.py").is_file() and not (tmp_path / "r.toml").exists()
