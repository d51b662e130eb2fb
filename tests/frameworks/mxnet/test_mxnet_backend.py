"""The MXNet Gluon backend: grad_req='add' against grad_req='write' plus a buffer."""

import numpy as np
import pytest
from attribution_checks import assert_explained

import accumcheck
from accumcheck.case.reading import builtin_case_names
from accumcheck.options.choices import FAULT_KINDS

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
FIXED = tuple(int(x) for x in mx.__version__.split(".")[:2]) >= (1, 7)  # apache/mxnet#17995
CASES = builtin_case_names()
needs_fixed_mxnet = pytest.mark.skipif(not FIXED, reason=f"mxnet {mx.__version__} has apache/mxnet#16708")


def _clean(case):
    return FIXED or case != "shared-weight"


def test_kernel_differences_show_as_round_off_with_ulps_and_ratio():
    report = accumcheck.compare("embed-attention", framework="mxnet", accum_steps=16)
    embed = next(t for t in report.tensors if t.name == "embed.weight")
    assert embed.verdict == "round-off" and embed.max_ulps > 0 and 0 < embed.ratio <= 1
    assert report.bound["native"]["kernel_allowance"] > 0 and report.bound["manual"]["kernel_allowance"] == 0


@pytest.mark.parametrize("steps", [16, 32])
@pytest.mark.parametrize("fault", [f for f in FAULT_KINDS if f != "roundoff"])
@pytest.mark.parametrize("case", CASES)
def test_every_fault_is_flagged_and_explained(case, fault, steps):
    if not _clean(case):
        pytest.skip("the real bug flags this case already")
    report = accumcheck.compare(case, framework="mxnet", accum_steps=steps, inject=fault)
    target = report.inject.split(":")[1].split("@")[0]
    assert [t.name for t in report.flagged] == [target]
    assert report.flagged[0].worst_mode == "native"
    assert_explained(report.flagged[0], fault, steps)
    assert not any(t.verdict == "suspicious" for t in report.tensors)


@pytest.mark.parametrize("steps", [16, 32])
@pytest.mark.parametrize("case", CASES)
def test_roundoff_control_is_not_flagged_nor_explained(case, steps):
    if not _clean(case):
        pytest.skip("the real bug flags this case already")
    report = accumcheck.compare(case, framework="mxnet", accum_steps=steps, inject="roundoff")
    assert report.exit_code == 0
    assert all(t.cause is None and t.verdict in ("identical", "round-off") for t in report.tensors)


def test_shared_weight_verdict_follows_the_version():
    # MXNet 1.6.0's ElemwiseSum with more than four inputs and kAddTo counted the running total
    # again (apache/mxnet#16708, #17989); 1.7.0 fixed it. shared-weight has five contributions.
    report = accumcheck.compare("shared-weight", framework="mxnet", accum_steps=16)
    if FIXED:
        assert report.exit_code == 0
    else:
        assert report.exit_code == 1
        assert {t.name for t in report.flagged} == {"shared.weight", "shared.bias"}
        assert report.flagged[0].kind == "weight"
        # What the fit finds: the running total multiplied by 16 at every micro-step, each
        # micro-gradient computed without one of its five contributions (8/9 of it for the weight).
        weight = report.flagged[0].cause
        assert (weight.kind, weight.factor) == ("growth", 16.0) and weight.grad_scale == pytest.approx(8 / 9, rel=1e-5)
        assert weight.fit > 0.999 and weight.residual_ratio <= 1


def test_float64_oracle_runs_in_mxnet():
    report = accumcheck.compare("transformer-small", framework="mxnet", accum_steps=4, oracle=True)
    assert report.settings["oracle"] == "mxnet float64"
    assert all(t.oracle_err_native is not None for t in report.tensors)


def test_gpu_without_one_is_a_clear_error():
    if mx.context.num_gpus():
        pytest.skip("a GPU is present")
    with pytest.raises(accumcheck.AccumcheckError, match="sees no GPU"):
        accumcheck.compare("shared-weight", framework="mxnet", device="gpu", accum_steps=2)


@pytest.mark.gpu
def test_gpu_run():
    if not mx.context.num_gpus():
        pytest.skip("no GPU")
    report = accumcheck.compare("embed-attention", framework="mxnet", device="gpu", accum_steps=32)
    assert report.device.startswith("gpu") and report.exit_code == (0 if FIXED else report.exit_code)


# ----------------------------------------------------------------------------- a user's own block


def _user_block():
    from mxnet import gluon

    class Net(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.embed = gluon.nn.Embedding(20, 8)
                self.shared = gluon.nn.Dense(8, flatten=False)
                self.out = gluon.nn.Dense(3, flatten=False)

        def hybrid_forward(self, F, x):
            h = self.embed(x)
            h = sum(self.shared(h * s) for s in (1.0, 0.5, 2.0, -1.0, 0.25))  # five uses of one weight
            return self.out(F.tanh(h))

    mx.random.seed(0)
    net = Net()
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(0)
    batches = [(mx.nd.array(rng.integers(0, 20, (4, 6))), mx.nd.array(rng.integers(0, 3, (4, 6))))
               for _ in range(8)]
    return net, gluon.loss.SoftmaxCrossEntropyLoss(), batches


def _state(net):
    return {n: (p.grad_req, p.grad().asnumpy().copy(), p.data().asnumpy().copy())
            for n, p in net.collect_params().items()}


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_check_on_a_hand_built_block_leaves_it_as_found(hybridize):
    import accumcheck.mxnet

    net, loss_fn, batches = _user_block()
    if hybridize:
        net.hybridize(static_alloc=True)
    with mx.autograd.record():
        loss_fn(net(batches[0][0]), batches[0][1]).backward()  # leave some gradients behind
    net.out.bias.grad_req = "add"
    before = _state(net)
    report = accumcheck.mxnet.check(net, loss_fn, batches, accum_steps=8)
    after = _state(net)
    for name in before:
        assert before[name][0] == after[name][0], name
        assert np.array_equal(before[name][1], after[name][1]), name
        assert np.array_equal(before[name][2], after[name][2]), name
    kinds = {t.name.split("_", 1)[1]: t.kind for t in report.tensors}
    assert kinds["embedding0_weight"] == "embedding" and kinds["dense0_bias"] == "bias"
    shared = [t for t in report.tensors if t.name.endswith("dense0_weight")][0]
    assert shared.flagged is (not FIXED)
    faulty = accumcheck.mxnet.check(net, loss_fn, batches, accum_steps=8, inject="scale")
    assert faulty.flagged and faulty.flagged[0].name.endswith("embedding0_weight")


def test_check_rejects_bad_input():
    import accumcheck.mxnet

    net, loss_fn, batches = _user_block()
    with pytest.raises(accumcheck.AccumcheckError, match="only 8 batches"):
        accumcheck.mxnet.check(net, loss_fn, batches, accum_steps=9)
    with pytest.raises(accumcheck.AccumcheckError, match="batches is empty"):
        accumcheck.mxnet.check(net, loss_fn, [], accum_steps=2)
