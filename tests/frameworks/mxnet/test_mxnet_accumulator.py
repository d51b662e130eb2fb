"""accumcheck.mxnet.GradAccumulator: float32 buffers for Gluon, plain or compensated, and
``compare --framework mxnet --mode accumulator|compensated``, which judges it in the native slot."""

import numpy as np
import pytest
from budget_checks import assert_same_report, tightest
from conftest import run_cli

import accumcheck
from accumcheck.case.reading import builtin_case_names

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
from mxnet import autograd, gluon  # noqa: E402

import accumcheck.mxnet  # noqa: E402
from accumcheck.mxnet import GradAccumulator  # noqa: E402

SLOW = ("embed-attention", "transformer-small")  # a minute or so at 256 micro-steps


def _runs():
    for case in builtin_case_names():
        yield from [(case, 16), (case, 32)]
        yield pytest.param(case, 256, marks=pytest.mark.slow) if case in SLOW else (case, 256)


@pytest.mark.parametrize("case, steps", list(_runs()))
def test_compensated_mode_is_within_half_a_float32_ulp_of_e(case, steps):
    """docs/precision.md: within 0.5 float32 ulp of E, as a correctly rounded sum would be."""
    report = accumcheck.compare(case, framework="mxnet", accum_steps=steps, mode="compensated")
    assert report.exit_code == 0 and report.config["mode"] == "compensated"
    assert max(t.err_ulps_native for t in report.tensors) <= 0.5


def test_plain_accumulator_is_round_off_but_drifts_with_n():
    small = accumcheck.compare("padded-tokens", framework="mxnet", accum_steps=16, mode="accumulator")
    large = accumcheck.compare("padded-tokens", framework="mxnet", accum_steps=256, mode="accumulator")
    assert small.exit_code == large.exit_code == 0
    assert max(t.err_ulps_native for t in large.tensors) > max(t.err_ulps_native for t in small.tensors) > 1


@pytest.mark.parametrize("case", builtin_case_names())
def test_plain_accumulator_is_the_manual_buffers_running_sum_bit_for_bit(case):
    """docs/mxnet.md: the same float32 running sum as the manual buffer, of the same grad_req='write'
    gradients."""
    report = accumcheck.compare(case, framework="mxnet", accum_steps=16, mode="accumulator")
    assert {t.verdict for t in report.tensors} == {"identical"}


@pytest.mark.parametrize("mode", ["accumulator", "compensated"])
@pytest.mark.parametrize("fault", ["drop-step", "double-step", "scale", "bf16"])
def test_every_fault_reaches_the_accumulator_buffer(mode, fault):
    report = accumcheck.compare("padded-tokens", framework="mxnet", accum_steps=4, mode=mode,
                                inject=f"{fault}:fc1.weight")
    assert [t.name for t in report.flagged] == ["fc1.weight"], fault
    control = accumcheck.compare("padded-tokens", framework="mxnet", accum_steps=4, mode=mode,
                                 inject="roundoff:fc1.weight")
    assert control.exit_code == 0


@pytest.mark.parametrize("mode", ["accumulator", "compensated"])
def test_memory_budget_groups_run_the_accumulator_too(mode):
    options = {"case": "padded-tokens", "framework": "mxnet", "accum_steps": 8, "mode": mode, "inject": "scale"}
    whole, grouped = accumcheck.compare(**options), accumcheck.compare(**options, memory_budget=tightest(**options))
    assert grouped.groups > 1
    assert_same_report(whole, grouped)


def test_cli_names_the_accumulator_in_the_native_slot():
    result = run_cli("compare", "--framework", "mxnet", "--case", "shared-weight", "--mode", "compensated",
                     "--accum-steps", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--mode compensated" in result.stdout  # the reproduce line


# --------------------------------------------------------------------------------------- the class
def _dense():
    mx.random.seed(0)
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize()
    return net


def _micro_steps(net, acc, steps=3):
    """``steps`` backward passes through ``net`` (grad_req='write'), each added; returns the float64
    sum of the weight's micro-gradients."""
    x = mx.nd.random.normal(shape=(5, 4))
    expected = np.zeros((3, 4))
    for k in range(steps):
        with autograd.record():
            loss = ((net(x) * (k + 1)) ** 2).sum()
        loss.backward()
        expected += net.weight.grad().asnumpy().astype(np.float64)
        acc.add()
        assert not net.weight.grad().asnumpy().any()  # zeroed: grad_req='write' would keep a stale one
    return expected


@pytest.mark.parametrize("compensated", [False, True])
def test_apply_writes_the_total_back_into_the_gradient_exactly(compensated):
    net = _dense()
    before = {name: p.data().asnumpy().copy() for name, p in net.collect_params().items()}
    acc = GradAccumulator(net, compensated=compensated)
    expected = _micro_steps(net, acc)
    acc.apply()
    totals = [t.asnumpy() for t in acc.totals()]
    assert np.array_equal(net.weight.grad().asnumpy(), totals[0]) and np.array_equal(net.bias.grad().asnumpy(),
                                                                                     totals[1])
    assert np.allclose(totals[0], expected, rtol=1e-6, atol=0)
    # the parameters, and every grad_req, as found
    assert all(np.array_equal(p.data().asnumpy(), before[name]) for name, p in net.collect_params().items())
    assert {p.grad_req for p in net.collect_params().values()} == {"write"}
    acc.zero()
    assert all(not t.asnumpy().any() for t in acc.totals())


def test_a_trainer_steps_with_the_written_back_total():
    net = _dense()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 1.0})
    acc = GradAccumulator(net)
    _micro_steps(net, acc)
    acc.apply()
    weight, total = net.weight.data().asnumpy().copy(), acc.totals()[0].asnumpy()
    trainer.step(1)  # no stale-gradient error: the write-back counts as the step's gradient
    assert np.array_equal(net.weight.data().asnumpy(), weight - total)


def _parameter(values, dtype="float32"):
    param = gluon.Parameter("p", shape=(len(values[0]),), dtype=dtype)
    param.initialize(mx.init.Zero())
    return param


def _accumulate(grads, dtype="float32", **kw):
    """A GradAccumulator over one parameter fed ``grads`` (lists of floats), one micro-step each."""
    param = _parameter(grads, dtype)
    acc = GradAccumulator([param], **kw)
    for g in grads:
        param.grad()[:] = mx.nd.array(g, dtype=dtype)
        acc.add()
    return acc, param


def test_plain_mode_is_a_float32_running_sum_by_default():
    # 1 + 2^-24 is a tie in float32 and rounds to the even 1.0, twice: the plain sum loses both.
    acc, _ = _accumulate([[1.0], [2.0**-24], [2.0**-24]])
    assert acc.compensated is False and acc.carries is None
    assert acc.totals()[0].asnumpy().tolist() == [1.0] and acc.totals()[0].dtype == np.float32


def test_compensated_mode_keeps_what_each_addition_rounds_away():
    acc, _ = _accumulate([[1.0], [2.0**-24], [2.0**-24]], compensated=True)
    assert acc.totals()[0].asnumpy().tolist() == [1.0 + 2.0**-23]  # the exact sum
    assert acc.sums[0].asnumpy().tolist() == [1.0] and acc.carries[0].asnumpy().tolist() == [2.0**-23]
    acc, _ = _accumulate([[3.0, -3.0], [3.0, 3.0]], compensated=True)
    assert acc.totals()[0].asnumpy().tolist() == [6.0, 0.0] and acc.carries[0].asnumpy().tolist() == [0.0, 0.0]


def test_float16_parameters_accumulate_in_float32():
    # 2048 + 1 is a tie in float16 (11 significant bits): float16 would keep 2048, float32 keeps 2049.
    acc, param = _accumulate([[2048.0], [1.0], [1.0]], dtype="float16", compensated=True)
    assert acc.sums[0].dtype == np.float32 and acc.totals()[0].asnumpy().tolist() == [2050.0]
    acc.apply()
    assert param.grad().dtype == np.float16 and param.grad().asnumpy().tolist() == [2050.0]


def test_add_to_and_replace_reach_one_buffer():
    params = [_parameter([[0.0] * 3]), _parameter([[0.0] * 2])]
    acc = GradAccumulator(params, compensated=True)
    acc.add_to(1, mx.nd.array([1.0, 2.0]))
    acc.add_to(1, mx.nd.array([1e-8, 0.0]))
    assert acc.sums[1].asnumpy().tolist() == [1.0, 2.0] and acc.total(0).asnumpy().tolist() == [0, 0, 0]
    assert acc.carries[1].asnumpy().tolist() == pytest.approx([1e-8, 0.0], rel=1e-6)
    acc.replace(1, mx.nd.array([5.0, 6.0]))
    assert acc.total(1).asnumpy().tolist() == [5.0, 6.0] and acc.carries[1].asnumpy().tolist() == [0.0, 0.0]


def test_frozen_parameters_are_left_out_and_left_alone():
    net = _dense()
    net.bias.grad_req = "null"
    acc = GradAccumulator(net.collect_params())
    assert acc.params == [net.weight]
    assert net.bias.grad_req == "null"


@pytest.mark.parametrize("make, message", [
    (lambda: gluon.nn.Dense(3), "parameter dense\\d+_weight is not initialised yet"),
    (lambda: [np.zeros(3)], "expected Gluon Parameters \\(or a Block\\), got ndarray"),
])
def test_bad_input_is_one_line(make, message):
    block = make()
    if isinstance(block, gluon.Block):
        block.initialize()  # deferred: no in_units
    with pytest.raises(accumcheck.AccumcheckError, match=message) as excinfo:
        GradAccumulator(block)
    assert "\n" not in str(excinfo.value)


def test_sparse_and_multi_context_gradients_are_refused():
    sparse = gluon.nn.Embedding(10, 4, sparse_grad=True)
    sparse.initialize()
    with pytest.raises(accumcheck.AccumcheckError, match="row_sparse gradient; it accumulates dense gradients"):
        GradAccumulator(sparse)
    two = gluon.nn.Dense(3, in_units=4)
    two.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    with pytest.raises(accumcheck.AccumcheckError, match="lives on 2 contexts"):
        GradAccumulator(two)
