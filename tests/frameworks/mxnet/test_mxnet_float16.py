"""float16 parameters on MXNet: grad_req='add' sums float16 gradients in float16 (precision-loss
against a float32 buffer), with or without the optimizer's float32 master weights."""

import pytest
from conftest import run_cli

import accumcheck
from accumcheck.errors import AccumcheckError

pytest.importorskip("mxnet")


@pytest.fixture(scope="module")
def plain():
    return accumcheck.compare("transformer-small", framework="mxnet", dtype="float16")


def test_native_float16_sums_are_precision_loss_and_the_float32_buffer_is_not(plain):
    assert plain.exit_code == 1 and plain.config["dtype"] == "float16"
    flagged = {t.name for t in plain.flagged}
    assert "embed.weight" in flagged and len(flagged) >= len(plain.tensors) // 2
    assert all(t.verdict == "precision-loss" for t in plain.flagged)
    assert max(t.err_ulps_native for t in plain.flagged) > 1e4  # float32 ulps
    assert max(t.err_ulps_manual for t in plain.tensors) <= 1  # the float32 buffer keeps every float16 step


def test_master_weights_do_not_change_the_accumulation(plain):
    master = accumcheck.compare("transformer-small", framework="mxnet", dtype="float16", multi_precision=True)
    assert [(t.name, t.verdict) for t in master.tensors] == [(t.name, t.verdict) for t in plain.tensors]
    assert any("multi_precision" in note and "float16" in note for note in master.notes)


def test_a_float32_accumulator_fixes_it():
    fixed = accumcheck.compare("transformer-small", framework="mxnet", dtype="float16", mode="compensated")
    assert fixed.exit_code == 0


def test_master_weights_for_float32_parameters_are_refused_in_one_line():
    with pytest.raises(AccumcheckError, match="--multi-precision: float32 parameters"):
        accumcheck.compare("tiny-grads", framework="mxnet", multi_precision=True)
    result = run_cli("compare", "--framework", "mxnet", "--case", "tiny-grads", "--multi-precision")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
