"""accumcheck train on JAX: manual's float32 buffer trains; optax.MultiSteps (native) and the control
(the buffer summed last to first) are fed the same micro-gradients, each stepping parameters of its
own, and native is judged against the control's gap."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
from conftest import run_cli  # noqa: E402

from accumcheck.api import train  # noqa: E402
from accumcheck.errors import AccumcheckError  # noqa: E402


def test_a_running_sum_under_adam_stays_within_the_controls_band():
    report = train("shared-weight", framework="jax", steps=10, optimizer="adam", lr=1e-3, grad_mean=False)
    assert report.exit_code == 0 and not report.first_out_of_control, report.summary()
    assert report.summary().startswith("OK:")
    assert report.settings["native"].startswith("optax.MultiSteps(optax.adam(0.001), every_k_schedule=16, "
                                                "use_grad_mean=False)")


@pytest.mark.parametrize("fault", ["double-step", "drop-step"])
def test_a_fault_in_multisteps_accumulator_is_flagged_at_the_first_step(fault):
    report = train("shared-weight", framework="jax", steps=4, optimizer="adam", lr=1e-3, inject=fault)
    assert report.exit_code == 1 and report.first_out_of_control == {"shared.weight": 0}
    assert report.summary().startswith("FLAGGED at step 0 (shared.weight)")


def test_the_running_mean_moves_a_bias_whose_micro_gradients_cancel_where_no_sum_does():
    """tiny-grads' dense1.bias: its micro-gradients cancel exactly, so manual's sum and the control's
    are 0; MultiSteps' running mean (three roundings a micro-step) leaves ~1e-9, which Adam turns
    into steps of a good fraction of lr: more than a reordering explains."""
    report = train("tiny-grads", framework="jax", steps=2, optimizer="adam", lr=1e-3)
    assert report.exit_code == 1 and report.first_out_of_control.get("dense1.bias") == 0
    assert report.control_diff["bias"][0] == 0 and report.max_diff["bias"][0] > 1e-5
    summed = train("tiny-grads", framework="jax", steps=2, optimizer="adam", lr=1e-3, grad_mean=False)
    assert summed.exit_code == 0, summed.summary()


def test_manual_is_the_loop_a_user_writes():
    """Manual's parameters after two steps, bit for bit those of a plain optax loop (its update and
    apply_updates jit-compiled)."""
    from accumcheck.case.reading import resolve_case
    from accumcheck.jax.casemodel import CaseParams, case_batches, grad_function
    from accumcheck.run import trajectory as module

    case = resolve_case("shared-weight")
    n = case.accum_steps
    device = jax.devices("cpu")[0]
    params = CaseParams(case, case.weights(), "float32", "float32", device).arrays()
    grad_of, batches = grad_function(case, True), case_batches(case, n, "float32", device)
    opt = optax.adam(1e-3)
    state = opt.init(params)
    update, apply = jax.jit(opt.update), jax.jit(optax.apply_updates)  # a step compiled as users compile it
    for k in range(2):
        acc = {name: jax.numpy.zeros_like(p) for name, p in params.items()}
        for i in range(n):
            _, grads = grad_of(params, batches(k * n + i))
            acc = jax.tree_util.tree_map(lambda a, g: a + g, acc, grads)
        updates, state = update(jax.tree_util.tree_map(lambda a: a / n, acc), state, params)
        params = apply(params, updates)
    seen = {}
    record = module.Trajectory.record

    def keep(self, step, native, manual, control, oracle=None):
        seen[step] = manual
        return record(self, step, native, manual, control, oracle)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module.Trajectory, "record", keep)
        train("shared-weight", framework="jax", steps=2, optimizer="adam", lr=1e-3)
    for name, value in params.items():
        assert np.array_equal(seen[1][name], np.asarray(value)), name


def test_the_cli_trains_on_jax_and_refuses_master_weights():
    result = run_cli("train", "--framework", "jax", "--case", "shared-weight", "--steps", "2", "--inject", "scale",
                     "--accum-steps", "4")
    assert result.returncode in (0, 1) and ("OK:" in result.stdout or "FLAGGED" in result.stdout), result.stderr
    with pytest.raises(AccumcheckError, match="--master-weights"):
        train("tiny-grads", framework="jax", steps=1, master_weights=True)
