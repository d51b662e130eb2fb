"""accumcheck.mxnet.check(full_batch=True) and (oracle=True) on Gluon blocks: the accumulated
gradient against the whole window's in one backward pass, both on a float64 copy of the block. A per-example loss is
the whole batch's as it is; a mean loss per micro-batch is N times it, or weighted unlike it when
the micro-batches differ in size; the block is left as found."""

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
import accumcheck.mxnet  # noqa: E402
from accumcheck.errors import AccumcheckError  # noqa: E402

gluon = mx.gluon
N = 8
SOFTMAX = gluon.loss.SoftmaxCrossEntropyLoss()


def _net(hybridize: bool):
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.BatchNorm(), gluon.nn.Dense(4))
    net.initialize(mx.init.Xavier())  # deferred: no in_units anywhere
    if hybridize:
        net.hybridize()
    return net


def _batches(sizes=(6,) * N):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((size, 5)).astype(np.float32), (np.arange(size) % 4).astype(np.float32))
            for size in sizes]


def _state(net):
    return {name: (p.data().asnumpy().copy(), p.data().dtype, p.grad_req,
                   p.grad().asnumpy().copy() if p.grad_req != "null" else None)
            for name, p in net.collect_params().items()}


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_per_example_losses_are_the_whole_batch_and_the_block_is_left_as_found(hybridize):
    net = _net(hybridize)
    report = accumcheck.mxnet.check(net, SOFTMAX, _batches(), full_batch=True)
    assert report.exit_code == 0 and report.full_batch.equivalent and report.full_batch.normalisation == "sum"
    assert report.full_batch.max_relative_difference < 1e-12 and report.full_batch.item_counts == [6] * N
    assert report.config["full_batch"] is True and "full_batch=True" in report.reproduce_command()
    net(mx.nd.array(_batches()[0][0]))  # now initialised: the check deferred them again
    before = _state(net)
    assert accumcheck.mxnet.check(net, SOFTMAX, _batches(), full_batch=True).exit_code == 0
    after = _state(net)
    for name, (data, dtype, req, grad) in before.items():
        assert np.array_equal(after[name][0], data) and after[name][1] == dtype == np.float32, name
        assert after[name][2] == req and (grad is None or np.array_equal(after[name][3], grad)), name


@pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
def test_the_oracle_is_the_float64_blocks_accumulation(hybridize):
    net = _net(hybridize)
    net(mx.nd.array(_batches()[0][0]))
    before = _state(net)
    report = accumcheck.mxnet.check(net, SOFTMAX, _batches(), oracle=True)
    assert report.exit_code == 0 and report.oracle and report.full_batch is None
    assert "oracle=True" in report.reproduce_command()
    for t in report.tensors:
        # E sums the float32 block's micro-gradients: it differs from the float64 block's sum by
        # the float32 forward and backward's rounding, small against the gradient but not zero
        assert t.oracle_err_native is not None and t.oracle_err_exact <= 1e-5 * t.max_abs_grad, t.name
    assert any(t.oracle_err_exact > 0 for t in report.tensors)
    for name, (data, dtype, req, grad) in before.items():
        after = _state(net)[name]
        assert np.array_equal(after[0], data) and after[1] == dtype and after[2] == req, name


def test_a_mean_loss_per_micro_batch_is_n_times_the_whole_batch():
    def mean_step(block, batch):
        return SOFTMAX(block(batch[0]), batch[1]).mean()

    report = accumcheck.mxnet.check(_net(True), None, _batches(), step=mean_step, full_batch=True)
    assert report.exit_code == 1 and not report.full_batch.equivalent
    assert report.full_batch.factor == pytest.approx(N) and "matches N (N = 8)" in report.full_batch.explanation
    # told that the loop divides each micro-batch's mean by N, it is the whole batch's again
    same = accumcheck.mxnet.check(_net(True), None, _batches(), step=mean_step, full_batch=True,
                                  loss_reduction="mean")
    assert same.exit_code == 0 and same.full_batch.equivalent


def test_mean_losses_over_micro_batches_of_different_sizes_are_weighted_unlike_the_whole_batch():
    sizes = (2, 9, 4, 7, 3, 8, 5, 6)

    def mean_step(block, batch):
        return SOFTMAX(block(batch[0]), batch[1]).mean()

    report = accumcheck.mxnet.check(_net(False), None, _batches(sizes), step=mean_step, full_batch=True,
                                    loss_reduction="mean")
    assert report.exit_code == 1 and not report.full_batch.constant
    assert report.full_batch.factor_max / report.full_batch.factor_min > 1.01
    assert report.full_batch.item_counts is None  # a step function: the check cannot count items
    counted = accumcheck.mxnet.check(_net(False), SOFTMAX, _batches(sizes), full_batch=True)
    assert counted.exit_code == 0 and counted.full_batch.item_counts == list(sizes)


class Scaled(gluon.Block):
    """A block with a plain number among its inputs: it does not concatenate."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, use_bias=False)  # dense(x * s) = dense(x) * s

    def forward(self, x, scale):
        return self.dense(x) * scale


def test_micro_batches_join_where_they_can_and_need_collate_where_they_cannot():
    def scaled():
        mx.random.seed(0)
        net = Scaled()
        net.initialize(mx.init.Xavier())
        return net

    same = [((x, 2.0), y) for x, y in _batches()]  # one setting in every micro-batch: it stays
    report = accumcheck.mxnet.check(scaled(), SOFTMAX, same, full_batch=True)
    assert report.exit_code == 0 and report.full_batch.equivalent
    differing = [((x, 1.0 + k % 2), y) for k, (x, y) in enumerate(_batches())]
    with pytest.raises(AccumcheckError) as raised:
        accumcheck.mxnet.check(scaled(), SOFTMAX, differing, full_batch=True)
    assert str(raised.value) == ("full_batch: cannot join the micro-batches into one: batch[0][1] is a float that "
                                 "differs between micro-batches; pass collate=lambda batches: one_batch")
    # a collate that scales each micro-batch's inputs joins them into a batch of scale 1
    collated = []

    def collate(parts):
        collated.append(len(parts))
        return ((mx.nd.concat(*(mx.nd.array(b[0][0]) * b[0][1] for b in parts), dim=0), 1.0),
                np.concatenate([b[1] for b in parts]))

    report = accumcheck.mxnet.check(scaled(), SOFTMAX, differing, full_batch=True, collate=collate)
    assert collated == [N] and report.exit_code == 0 and report.full_batch.equivalent


@pytest.mark.parametrize("kwargs, message", [
    ({"full_batch": "yes"}, "full_batch must be True or False, got 'yes'"),
    ({"oracle": 1}, "oracle must be True or False, got 1"),
    ({"full_batch": True, "loss_reduction": "avg"},
     "loss_reduction must be one of mean, sum, token_count (or None: sum, this framework's convention), got 'avg'"),
    ({"full_batch": True, "collate": 3}, "collate must be a function, got a int"),
])
def test_bad_full_batch_arguments_are_one_line(kwargs, message):
    with pytest.raises(AccumcheckError) as raised:
        accumcheck.mxnet.check(_net(False), SOFTMAX, _batches(), **kwargs)
    assert str(raised.value) == f"check: {message}"
