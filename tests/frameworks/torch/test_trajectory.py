"""accumcheck train: manual's training, with native accumulation and a control (manual's
micro-batches summed last to first) fed the same micro-gradients; native judged against the
control's gap, which Adam's amplified round-off widens."""

import json

import pytest
from conftest import needs_torch, run_cli

from accumcheck.errors import AccumcheckError

pytestmark = needs_torch


def test_adam_amplifies_a_valid_reordering_as_far_as_the_control_and_it_passes():
    from accumcheck.api import train

    adam = train("tiny-grads", steps=10, optimizer="adam", lr=1e-3, inject="roundoff")
    # out of the one-ulp band under Adam (the old verdict's "LEFT THE ROUND-OFF BAND") ...
    assert adam.first_out_of_band and max(max(values) for values in adam.band_ratio.values()) > 1
    # ... but no further from manual than the control: amplified round-off, exit 0
    assert adam.exit_code == 0 and not adam.first_out_of_control, adam.summary()
    assert adam.summary().startswith("OK: amplified round-off, as two valid orders differ")
    assert max(max(values) for values in adam.control_ratio.values()) <= adam.margin
    assert any(v > 0 for values in adam.control_diff.values() for v in values)


def test_clean_torch_trajectories_are_identical_within_the_controls_band():
    from accumcheck.api import train

    report = train("shared-weight", steps=4, optimizer="adam", lr=1e-2)
    assert report.exit_code == 0 and report.summary() == "OK: native and manual identical for all 4 adam steps"
    assert all(v == 0 for values in report.max_diff.values() for v in values)
    assert any(v > 0 for values in report.control_diff.values() for v in values)  # the control is another order


@pytest.mark.parametrize("fault, optimizer", [("double-step", "adam"), ("drop-step", "sgd"), ("bf16", "adam")])
def test_a_fault_is_flagged_at_the_step_it_left_the_controls_band(fault, optimizer):
    from accumcheck.api import train

    report = train("shared-weight", steps=5, optimizer=optimizer, lr=1e-2, inject=fault)
    first = min(report.first_out_of_control.values())
    assert report.exit_code == 1 and "shared.weight" in report.first_out_of_control and first <= 1
    assert report.summary().startswith(f"FLAGGED at step {first} (")
    assert max(values[first] for values in report.control_ratio.values()) > report.margin


def test_a_learning_rate_too_large_diverges_every_order_and_says_so():
    from accumcheck.api import train

    report = train("tiny-grads", steps=3, accum_steps=2, lr=1e30)
    assert report.exit_code == 1 and report.summary().startswith("NON-FINITE at step 1 (")
    assert "valid summation orders, went inf or nan at that step too" in report.summary()
    assert "lower --lr" in report.summary()


def test_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "run.json"
    result = run_cli("train", "--case", "tiny-grads", "--steps", "5", "--inject", "roundoff", "--oracle",
                     "--output", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: amplified round-off" in result.stdout and "×control" in result.stdout
    data = json.loads(out.read_text())
    assert data["kind"] == "trajectory" and data["steps"] == 5 and data["optimizer"] == "adam"
    assert set(data["losses"]) == {"manual", "float64"} and all(len(v) == 5 for v in data["losses"].values())
    assert set(data["band_ratio"]) == set(data["control_diff"]) == set(data["control_ratio"]) == {"weight", "bias"}
    assert data["margin"] > 1 and data["first_out_of_band"] and not data["first_out_of_control"]
    assert (tmp_path / "run.png").stat().st_size > 10_000
    flagged = run_cli("train", "--case", "shared-weight", "--steps", "3", "--inject", "double-step")
    assert flagged.returncode == 1 and "FLAGGED at step 0 (shared.weight)" in flagged.stdout


def test_bad_training_options():
    from accumcheck.api import train

    with pytest.raises(AccumcheckError, match="--optimizer: 'lamb'"):
        train("tiny-grads", optimizer="lamb")
    result = run_cli("train", "--lr", "-1")
    assert result.returncode == 2 and "argument --lr: '-1' is not a positive number" in result.stderr
