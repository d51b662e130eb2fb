"""accumcheck train on MXNet: gluon.Trainer over grad_req='add' against the buffer written back
before trainer.step() (apache/mxnet#16686's workaround)."""

import json

import numpy as np
import pytest
from conftest import run_cli

from accumcheck.errors import AccumcheckError

mx = pytest.importorskip("mxnet")
from accumcheck.api import train  # noqa: E402


def test_adam_amplifies_a_valid_reordering_that_sgd_keeps_in_the_band():
    adam = train("tiny-grads", framework="mxnet", steps=10, optimizer="adam", lr=1e-3, inject="roundoff")
    sgd = train("tiny-grads", framework="mxnet", steps=10, optimizer="sgd", lr=1e-1, inject="roundoff")
    assert adam.exit_code == 1 and min(adam.first_out_of_band.values()) == 0
    assert max(values[9] for values in adam.band_ratio.values()) >= 1e2
    assert sgd.exit_code == 0 and max(max(values) for values in sgd.band_ratio.values()) <= 1.0


def test_a_clean_run_stays_in_the_band():
    report = train("tiny-grads", framework="mxnet", steps=6, optimizer="adam", lr=1e-3, oracle=True)
    assert report.exit_code == 0 and not report.non_finite
    assert set(report.losses) == {"native", "manual", "float64"}
    assert all(len(trace) == 6 for trace in report.oracle_diff.values())
    assert "trainer.step(32)" in report.settings["optimizer step"]  # a mean loss, N = 32: the window's mean


def _by_hand(native: bool, optimizer: str, steps: int, multi_precision: bool = False, dtype: str = "float32"):
    """The case's loop as a Gluon user writes it, independently of accumcheck's passes."""
    from accumcheck.case.reading import resolve_case
    from accumcheck.mxnet.casemodel import case_step, prepared

    case = resolve_case("shared-weight")
    n = case.accum_steps
    block = prepared(case, case.weights(), dtype, mx.cpu(), True)
    params = list(block.canonical.values())
    trainer = mx.gluon.Trainer(params, optimizer, {"learning_rate": 1e-2, "multi_precision": multi_precision})
    step = case_step(case, block, mx.cpu(), dtype, n)
    for p in params:
        p.grad_req = "add" if native else "write"
    for k in range(steps):
        for p in params:
            p.zero_grad()
        acc = [mx.nd.zeros(p.shape, dtype="float32") for p in params]
        for i in range(n):
            with mx.autograd.record():
                loss, _ = step(k * n + i)
            loss.backward()
            if not native:
                for buffer, p in zip(acc, params):
                    buffer[:] += p.grad().astype("float32")
        if not native:
            for buffer, p in zip(acc, params):
                p.grad()[:] = buffer.astype(p.dtype)
        trainer.step(n if case.loss_reduction == "mean" else 1)
    return {name: p.data().asnumpy() for name, p in block.canonical.items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_both_trajectories_are_the_loops_a_user_writes(optimizer, monkeypatch):
    """The parameters after two steps, bit for bit those of a plain Gluon loop of each kind."""
    from accumcheck.mxnet import train as module

    seen = {}
    record = module.Trajectory.record

    def keep(self, step, native, manual, oracle=None):
        seen[step] = (native, manual)
        return record(self, step, native, manual, oracle)

    monkeypatch.setattr(module.Trajectory, "record", keep)
    train("shared-weight", framework="mxnet", steps=2, optimizer=optimizer, lr=1e-2)
    for mode, native in (("native", True), ("manual", False)):
        want = _by_hand(native, optimizer, 2)
        got = seen[1][0 if native else 1]
        for name in want:
            assert np.array_equal(got[name], want[name]), (mode, name)


def test_float16_with_and_without_master_weights():
    """float16 parameters train; multi_precision changes the update (float32 master weights),
    so the two runs differ, and the gradients still accumulate in float16 under grad_req='add'."""
    plain = train("transformer-small", framework="mxnet", steps=3, dtype="float16", lr=1e-3, accum_steps=8)
    master = train("transformer-small", framework="mxnet", steps=3, dtype="float16", lr=1e-3, accum_steps=8,
                   multi_precision=True)
    assert plain.settings["params"] == master.settings["params"] == "float16"
    assert master.settings["trainer"] == ("gluon.Trainer(params, 'adam', "
                                          "{'learning_rate': 0.001, 'multi_precision': True})")
    assert "multi_precision" not in plain.settings["trainer"]
    assert plain.losses["native"][2] != master.losses["native"][2]
    # float16 accumulation under grad_req='add' against the float32 buffer: out of the band
    assert plain.exit_code == 1 and master.exit_code == 1


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
