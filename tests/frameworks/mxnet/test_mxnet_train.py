"""accumcheck train on MXNet: gluon.Trainer over grad_req='add' against the buffer written back
before trainer.step() (apache/mxnet#16686's workaround)."""

import json

import numpy as np
import pytest
from conftest import run_cli

from accumcheck.errors import AccumcheckError

mx = pytest.importorskip("mxnet")
from accumcheck.api import train  # noqa: E402


def test_the_kaddto_reordering_under_adam_is_amplified_round_off_within_the_controls_band():
    """MXNet 1.9.1 sums faithfully, but grad_req='add' adds inside the backward kernels (kAddTo):
    another valid order, which Adam amplifies past one ulp; the control (manual's micro-batches
    summed last to first) differs as much, so it is not flagged."""
    report = train("shared-weight", framework="mxnet", steps=12, optimizer="adam", lr=1e-3)
    assert report.exit_code == 0 and not report.non_finite, report.summary()
    assert report.first_out_of_band and not report.first_out_of_control
    assert report.summary().startswith("OK: amplified round-off, as two valid orders differ")
    assert any(v > 0 for values in report.control_diff.values() for v in values)


@pytest.mark.parametrize("fault", ["double-step", "drop-step"])
def test_a_fault_in_native_accumulation_is_flagged_at_the_first_step(fault):
    report = train("shared-weight", framework="mxnet", steps=4, optimizer="adam", lr=1e-3, inject=fault)
    assert report.exit_code == 1 and report.first_out_of_control == {"shared.weight": 0}
    assert report.summary().startswith("FLAGGED at step 0 (shared.weight): native is ")


def test_a_clean_run_stays_in_the_band():
    report = train("tiny-grads", framework="mxnet", steps=6, optimizer="adam", lr=1e-3, oracle=True)
    assert report.exit_code == 0 and not report.non_finite
    assert set(report.losses) == {"manual", "float64"}
    assert all(len(trace) == 6 for trace in report.oracle_diff.values())
    assert "trainer.step(32)" in report.settings["optimizer step"]  # a mean loss, N = 32: the window's mean


def _by_hand(optimizer: str, steps: int):
    """The case's two loops as a Gluon user writes them, independently of accumcheck's passes:
    manual trains (grad_req='write', a float32 buffer written back before trainer.step()); native
    runs each window with grad_req='add' on a block given manual's parameters, its gradients
    stepping a parameter set of its own."""
    from accumcheck.case.reading import resolve_case
    from accumcheck.mxnet.casemodel import case_step, prepared

    case = resolve_case("shared-weight")
    n = case.accum_steps
    rescale = n if case.loss_reduction == "mean" else 1
    blocks = {mode: prepared(case, case.weights(), "float32", mx.cpu(), True) for mode in ("manual", "add", "native")}
    params = {mode: list(block.canonical.values()) for mode, block in blocks.items()}
    trainers = {mode: mx.gluon.Trainer(params[mode], optimizer, {"learning_rate": 1e-2}) for mode in ("manual", "native")}
    steps_of = {mode: case_step(case, blocks[mode], mx.cpu(), "float32", n) for mode in ("manual", "add")}
    for p in params["add"]:
        p.grad_req = "add"
    for k in range(steps):
        for p, q in zip(params["add"], params["manual"]):
            p.set_data(q.data())
            p.zero_grad()
        acc = [mx.nd.zeros(p.shape, dtype="float32") for p in params["manual"]]
        for i in range(n):
            for mode in ("add", "manual"):
                with mx.autograd.record():
                    loss, _ = steps_of[mode](k * n + i)
                loss.backward()
            for buffer, p in zip(acc, params["manual"]):
                buffer[:] += p.grad()
        for buffer, p in zip(acc, params["manual"]):
            p.grad()[:] = buffer
        for p, q in zip(params["native"], params["add"]):
            p.grad()[:] = q.grad()
            p.data()._fresh_grad = True
        for mode in ("manual", "native"):
            trainers[mode].step(rescale)
    return {mode: {name: p.data().asnumpy() for name, p in blocks[mode].canonical.items()}
            for mode in ("native", "manual")}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_both_trajectories_are_the_loops_a_user_writes(optimizer, monkeypatch):
    """The parameters after two steps, bit for bit those of plain Gluon loops."""
    from accumcheck.mxnet import train as module

    seen = {}
    record = module.Trajectory.record

    def keep(self, step, native, manual, control, oracle=None):
        seen[step] = {"native": native, "manual": manual}
        return record(self, step, native, manual, control, oracle)

    monkeypatch.setattr(module.Trajectory, "record", keep)
    train("shared-weight", framework="mxnet", steps=2, optimizer=optimizer, lr=1e-2)
    want = _by_hand(optimizer, 2)
    for mode in ("native", "manual"):
        for name in want[mode]:
            assert np.array_equal(seen[1][mode][name], want[mode][name]), (mode, name)


def test_float16_with_and_without_master_weights():
    """float16 parameters train; without master weights Adam's update leaves float16 at the first
    step for every order (the training, not the accumulation); with them (multi_precision) the
    gradients still accumulate in float16 under grad_req='add', far past the control's band."""
    plain = train("transformer-small", framework="mxnet", steps=3, dtype="float16", lr=1e-3, accum_steps=8)
    master = train("transformer-small", framework="mxnet", steps=3, dtype="float16", lr=1e-3, accum_steps=8,
                   multi_precision=True)
    assert plain.settings["params"] == master.settings["params"] == "float16"
    assert master.settings["trainer"] == ("gluon.Trainer(params, 'adam', "
                                          "{'learning_rate': 0.001, 'multi_precision': True})")
    assert "multi_precision" not in plain.settings["trainer"]
    assert plain.exit_code == 1 and "valid summation orders, went inf or nan at that step too" in plain.summary()
    assert master.exit_code == 1 and not master.non_finite and min(master.first_out_of_control.values()) == 0


def test_the_cli_writes_the_json_and_the_plot(tmp_path):
    out = tmp_path / "run.json"
    result = run_cli("train", "--framework", "mxnet", "--case", "tiny-grads", "--steps", "2", "--output", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["kind"] == "trajectory" and report["versions"]["mxnet"] == mx.__version__
    assert (tmp_path / "run.png").stat().st_size > 0


def test_a_dtype_the_backend_does_not_train_is_one_line():
    with pytest.raises(AccumcheckError, match=r"bfloat16"):
        train("tiny-grads", framework="mxnet", steps=1, dtype="bfloat16")
    result = run_cli("train", "--framework", "torch", "--case", "tiny-grads", "--steps", "1", "--dtype", "float16")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "the torch backend trains float32 parameters only; use --framework mxnet" in result.stderr
