"""Reduced precision: bfloat16/float16 parameters accumulate natively in their own dtype."""

import pytest
from conftest import needs_torch, run_cli

import accumcheck

pytestmark = needs_torch


def test_bfloat16_native_accumulation_loses_precision_and_the_float32_buffer_does_not():
    report = accumcheck.compare("transformer-small", dtype="bfloat16", accum_steps=32)
    assert report.param_dtype == "bfloat16" and report.accum_dtype == "float32"
    assert report.exit_code == 1
    lost = [t for t in report.tensors if t.verdict == "precision-loss"]
    assert len(lost) >= 30 and all(t.worst_mode == "native" or t.ratio <= 1 for t in lost)
    for t in report.tensors:
        assert t.verdict != "diverged"  # within bfloat16's own round-off, as the theorem says
        # docs/precision.md: the float32 buffer stays within float32's own bound of E; how many ulps
        # that is follows the CPU's kernels (ci/figures.py quotes it with the kernels held alike)
        assert t.ratio_manual <= 1.0
        assert t.err_ulps_manual is not None
        assert t.precision_ratio is not None
    # bfloat16 keeps 8 bits where float32 keeps 24: one bfloat16 rounding of a sum is up to 2^15 float32
    # ulps of it, and 32 of them leave the worst element of 36 tensors past that
    assert max(t.err_ulps_native for t in lost) >= 2**15


def test_float16_too_and_a_float64_buffer_does_not_flag_float32():
    assert accumcheck.compare("shared-weight", dtype="float16", accum_steps=32).exit_code == 1
    report = accumcheck.compare("shared-weight", accum_dtype="float64", accum_steps=32)
    assert report.exit_code == 0 and report.accum_dtype == "float64"
    assert all(t.precision_ratio is None for t in report.tensors)


def test_cli_shows_the_loss_in_float32_ulps():
    result = run_cli("compare", "--case", "shared-weight", "--dtype", "bfloat16", "--accum-steps", "32")
    assert result.returncode == 1
    assert "precision-loss" in result.stdout and "float32 ulps" in result.stdout
    bad = run_cli("compare", "--dtype", "float8")
    assert bad.returncode == 2 and "argument --dtype: 'float8' is not one of float32, bfloat16, float16" in bad.stderr


def test_mxnet_says_plainly_it_runs_no_bfloat16():
    pytest.importorskip("mxnet")
    with pytest.raises(accumcheck.AccumcheckError,
                       match=r"--dtype bfloat16: not available with the mxnet backend \(it runs float32 and float16"):
        accumcheck.compare("shared-weight", framework="mxnet", dtype="bfloat16")
