"""--accum-dtype float64 on MXNet: the manual buffer in float64, judged at float64's bound."""

import pytest

import accumcheck

pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
from budget_checks import assert_same_report, tightest  # noqa: E402


def test_a_float64_buffer_is_judged_at_its_own_bound():
    single = accumcheck.compare("shared-weight", framework="mxnet", accum_steps=32)
    double = accumcheck.compare("shared-weight", framework="mxnet", accum_steps=32, accum_dtype="float64")
    assert double.exit_code == 0 and double.accum_dtype == "float64" and single.accum_dtype == "float32"
    # float64 sums of float32 micro-gradients: far closer to E than the float32 buffer
    for t32, t64 in zip(single.tensors, double.tensors):
        assert t64.err_manual < t32.err_manual / 1e6, t64.name


def test_a_fault_is_still_flagged_and_groups_agree():
    options = {"case": "padded-tokens", "framework": "mxnet", "accum_steps": 8, "accum_dtype": "float64",
               "inject": "scale:fc1.weight"}
    whole = accumcheck.compare(**options)
    assert [t.name for t in whole.flagged] == ["fc1.weight"]
    assert_same_report(whole, accumcheck.compare(**options, memory_budget=tightest(**options)))
