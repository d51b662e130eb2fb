"""The installed ``accumcheck`` command, run in a subprocess as a user would run it."""

import csv
import io
import json
import sys

import pytest
from conftest import HAS_TORCH, needs_torch, run_cli

BAD_TOML = """name = "bad"
[input]
kind = "features"
features = 3
batch_size = 2
[[layers]]
type = "dense"
name = "fc"
units = -1
"""


@needs_torch
def test_default_compare_passes_and_prints_the_table():
    result = run_cli("compare")
    assert result.returncode == 0, result.stderr
    assert "embed-attention" in result.stdout and "embed.weight" in result.stdout
    assert "OK: all 12 tensors faithful" in result.stdout
    assert "reproduce: accumcheck compare --framework torch --device cpu --case embed-attention" in result.stdout


@needs_torch
def test_injected_fault_exits_one_and_names_the_tensor():
    result = run_cli("compare", "--case", "shared-weight", "--inject", "double-step")
    assert result.returncode == 1
    assert "FLAGGED 1 of 4 tensors: shared.weight (weight, diverged" in result.stdout
    assert "Mismatched elements: 256 / 256 (100.0%)" in result.stdout
    assert "Greatest absolute difference:" in result.stdout


@needs_torch
def test_an_explained_fault_fails_also_under_fail_on_diverged_and_the_reproduce_line_keeps_it():
    result = run_cli("compare", "--case", "shared-weight", "--inject", "repeat-step", "--fail-on", "diverged")
    assert result.returncode == 1, result.stderr
    assert "micro-step 8 counted twice (fit 1.000)" in result.stdout
    assert "--inject repeat-step:shared.weight --fail-on diverged" in result.stdout


@needs_torch
def test_roundoff_control_exits_zero():
    result = run_cli("compare", "--case", "tiny-grads", "--inject", "roundoff")
    assert result.returncode == 0, result.stdout
    assert "round-off" in result.stdout


def test_cases_lists_the_builtins():
    result = run_cli("cases")
    assert result.returncode == 0
    for name in ("tiny-grads", "embed-attention", "transformer-small", "shared-weight"):
        assert name in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["compare", "--framework", "tensorflow"], "--framework: unknown framework 'tensorflow'; choose one of jax, mxnet, torch"),
    (["compare", "--device", "tpu"], "unknown device 'tpu'"),
    (["compare", "--case", "nope"], "unknown case 'nope'; built-in cases:"),
    (["compare", "--inject", "explode"], "unknown fault 'explode'; choose one of drop-step"),
    (["compare", "--inject", "scale:nope.weight"], "no parameter named 'nope.weight'"),
    (["compare", "--accum-steps", "0"], "argument --accum-steps: '0' is not a positive integer"),
    (["compare", "--accum-steps", "abc"], "argument --accum-steps: 'abc' is not a positive integer"),
    (["compare", "--accum-steps", "-3"], "argument --accum-steps: '-3' is not a positive integer"),
    (["compare", "--seed", "x"], "argument --seed: 'x' is not a seed"),
    (["compare", "--seed", "-1"], "argument --seed: '-1' is not a seed"),
    (["compare", "--format", "yaml"], "argument --format: invalid choice: 'yaml'"),
    (["compare", "--output", "/nonexistent/dir/r.json"], "folder /nonexistent/dir does not exist"),
    (["compare", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["show", "/nonexistent/report.json"], "cannot read report"),
    (["compare", "--fail-on", "never"], "argument --fail-on: 'never' is not one of suspicious, marginal, diverged"),
    (["compare", "--strict", "--fail-on", "diverged"], "--strict fails on suspicious tensors, --fail-on diverged"),
])
def test_user_mistakes_are_one_line_and_exit_two(args, fragment):
    if not HAS_TORCH and fragment.startswith(("unknown device", "no parameter")):
        pytest.skip("needs torch")
    result = run_cli(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert fragment in result.stderr, result.stderr


def test_malformed_case_file_names_file_and_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(BAD_TOML)
    result = run_cli("compare", "--case", str(path))
    assert result.returncode == 2
    assert result.stderr.strip() == f"accumcheck: error: {path}: layers[0].units: must be a positive integer, got -1"


@needs_torch
def test_cuda_asked_for_without_one():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    result = run_cli("compare", "--device", "gpu", "--case", "shared-weight")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "CUDA is not available" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_report_that_is_not_json(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("hello")
    result = run_cli("show", str(path))
    assert result.returncode == 2 and "not JSON" in result.stderr


@needs_torch
def test_json_report_round_trips_through_show(tmp_path):
    out = tmp_path / "r.json"
    result = run_cli("compare", "--case", "shared-weight", "--inject", "scale", "--format", "json", "--output", str(out))
    assert result.returncode == 1
    assert "report written to" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left behind
    data = json.loads(out.read_text())
    assert data["schema_version"] == 2 and data["kind"] == "report" and data["inject"].startswith("scale:shared.weight")
    again = run_cli("show", str(out), "--format", "json")
    assert again.returncode == 1
    assert json.loads(again.stdout) == data
    table = run_cli("show", str(out))
    assert "FLAGGED 1 of 4 tensors: shared.weight" in table.stdout


@needs_torch
def test_markdown_renders_as_a_table_and_csv_parses(tmp_path):
    md = run_cli("compare", "--case", "tiny-grads", "--format", "markdown")
    assert md.returncode == 0
    lines = md.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| tensor |"))
    rows = lines[start:start + 6]
    assert rows[1].startswith("|---|")
    assert len({row.count("|") for row in rows}) == 1  # every row has the header's columns
    assert "`dense0.weight`" in rows[2]
    sheet = run_cli("compare", "--case", "tiny-grads", "--format", "csv")
    parsed = list(csv.DictReader(io.StringIO(sheet.stdout)))
    assert [row["name"] for row in parsed] == ["dense0.weight", "dense0.bias", "dense1.weight", "dense1.bias"]
    assert parsed[0]["shape"] == "1000x10" and float(parsed[0]["condition"]) > 1


@needs_torch
def test_output_replaces_an_existing_file(tmp_path):
    out = tmp_path / "r.md"
    out.write_text("old")
    result = run_cli("compare", "--case", "shared-weight", "--accum-steps", "2", "--format", "markdown",
                     "--output", str(out))
    assert result.returncode == 0
    assert out.read_text().startswith("## accumcheck: shared-weight")


def test_a_missing_framework_says_how_to_install_it(monkeypatch):
    import importlib.util

    import accumcheck
    from accumcheck.run.registry import get_backend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mxnet" else real(name, *a))
    with pytest.raises(accumcheck.AccumcheckError, match=r"mxnet is not installed; pip install 'accumcheck\[mxnet\]'"):
        get_backend("mxnet")


def test_a_long_run_shows_the_time_left_on_a_terminal(monkeypatch):
    """The progress bar (on a terminal, after a second) estimates the time left, not only the time spent."""
    from rich.progress import TimeRemainingColumn

    from accumcheck.cli import _LazyProgress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    bar = _LazyProgress()
    bar.started -= bar.DELAY_S
    with bar as update:
        update("native + manual", 1, 100)
        assert any(isinstance(column, TimeRemainingColumn) for column in bar.progress.columns)
