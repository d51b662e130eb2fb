"""The Gluon Trainer under the training stack check: a faithful loop is faithful at every step (the
positive control), trainer.step(b) and a loss divided by N are fingerprinted (the negative
controls), a short last window, micro-batches never stepped on, and the net and Trainer left as
they were found."""

import random

import numpy as np
import pytest

from accumcheck.errors import AccumcheckError

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
from mxnet import autograd, gluon  # noqa: E402

from accumcheck.integrations.gluon import AccumulationCheck, run_case  # noqa: E402

B = 4  # samples per micro-batch


def small_net():
    """Dense -> BatchNorm -> Dropout -> Dense, hybridized, grad_req='add', and a momentum SGD
    Trainer that has already stepped once (so it has optimizer states and update counts)."""
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, in_units=5, activation="tanh"), gluon.nn.BatchNorm(in_channels=8),
            gluon.nn.Dropout(0.5), gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    for param in net.collect_params().values():
        if param.grad_req != "null":
            param.grad_req = "add"
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9})
    x, y = micro_batches(1)[0]
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    trainer.step(B)
    net.collect_params().zero_grad()
    return net, trainer


def micro_batches(count):
    rng = np.random.default_rng(1)
    return [(mx.nd.array(rng.standard_normal((B, 5))), mx.nd.array(rng.integers(0, 3, B))) for _ in range(count)]


def loop(net, trainer, check, count, n, step_size=None, last_steps=True, fail_at=None, scalar=False):
    """The loop a Gluon user writes; ``step_size(k)`` is what trainer.step gets for a window of k."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    step_size = step_size or (lambda k: k * B)
    batches = micro_batches(count)
    with check:
        for i, (x, y) in enumerate(batches):
            random.random(), np.random.random()  # a loop's own draws (shuffling, augmentation)
            if i == fail_at:
                raise RuntimeError("the loop broke")
            x, y = check.record(x, y)
            with autograd.record():
                loss = loss_fn(net(x), y)
                if scalar:
                    loss = loss.mean() / n
            loss.backward()
            if (i + 1) % n == 0 or (last_steps and i == count - 1):
                trainer.step(step_size(i % n + 1))
                net.collect_params().zero_grad()
    return check


def snapshot(net, trainer):
    """Everything the check must leave as it found it, as plain values."""
    params = net.collect_params()
    opt = trainer._optimizer
    states = {i: s.asnumpy().tobytes() for i, s in trainer._updaters[0].states.items()}
    return {"data": {k: p.data().asnumpy().tobytes() for k, p in params.items()},
            "dtype": {k: np.dtype(p.dtype).name for k, p in params.items()},
            "grad": {k: p.grad().asnumpy().tobytes() for k, p in params.items() if p.grad_req != "null"},
            "grad_req": {k: p.grad_req for k, p in params.items()},
            "states": states, "state_dtypes": {i: s.dtype for i, s in trainer._updaters[0].states.items()},
            "counts": {d: dict(c) for d, c in opt._all_index_update_counts.items()},
            "num_update": opt.num_update, "rescale_grad": opt.rescale_grad,
            "dropout": net[2]._rate, "patched": "step" in vars(trainer)}


# ----------------------------------------------------------------------------- a built-in case


def test_step_over_the_window_samples_is_faithful_at_every_step():
    report = run_case("padded-tokens", 4)  # 10 micro-batches: windows 0-3, 4-7 and a short one, 8-9
    assert [s.micro_batches for s in report.steps] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert report.micro_batches_seen == report.micro_batches_expected == 10
    assert [s.verdict for s in report.steps] == ["faithful"] * 3
    assert report.exit_code == 0 and report.unstepped == [] and report.stack == "gluon"
    assert all(s.result.max_relative_difference < 1e-12 for s in report.steps)


def test_step_per_micro_batch_is_flagged_as_n_times_too_large():
    report = run_case("padded-tokens", 4, fault="step-per-micro-batch")
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "N")] * 2 + [
        ("constant-factor", "k")]  # the short window of 2 stepped with step(b): 2 times too large
    assert report.exit_code == 1 and report.summary().startswith("FLAGGED: 3 of 3")


def test_a_loss_divided_by_n_is_flagged_as_one_over_n():
    report = run_case("padded-tokens", 4, 8, fault="loss-over-n")
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "1/N")] * 2


# ----------------------------------------------------------------------------- your own loop


def test_a_short_last_window_stepped_with_its_own_samples_is_faithful():
    net, trainer = small_net()
    report = loop(net, trainer, AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss()), 8, 3).report
    assert [s.micro_batches for s in report.steps] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert report.exit_code == 0 and report.accum_steps == 3 and report.model == "HybridSequential"


def test_a_short_last_window_stepped_with_n_samples_is_k_over_n():
    net, trainer = small_net()
    check = AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss())
    report = loop(net, trainer, check, 8, 3, step_size=lambda k: 3 * B).report
    assert [s.verdict for s in report.steps[:2]] == ["faithful"] * 2
    last = report.steps[2].result
    assert last.matches == "k/N" and last.factor == pytest.approx(2 / 3)


def test_a_scalar_loss_divided_by_n_with_step_1_is_faithful():
    net, trainer = small_net()
    check = AccumulationCheck(net, trainer, lambda out, y: gluon.loss.SoftmaxCrossEntropyLoss()(out, y).mean())
    report = loop(net, trainer, check, 6, 3, step_size=lambda k: 1, scalar=True).report
    assert report.exit_code == 0 and len(report.steps) == 2
    assert any("scalar loss" in note for note in report.notes)


def test_micro_batches_never_stepped_on_are_counted():
    net, trainer = small_net()
    check = AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss())
    report = loop(net, trainer, check, 8, 3, last_steps=False).report
    assert report.unstepped == [6, 7] and report.micro_batches_seen == 8 and report.exit_code == 1
    assert [s.verdict for s in report.steps] == ["faithful"] * 2
    assert report.summary().startswith("DROPPED BATCHES: 2 micro-batches (6, 7)")


def test_gradients_left_from_before_the_window_are_flagged():
    net, trainer = small_net()
    x, y = micro_batches(2)[1]
    with autograd.record():  # a backward whose gradient nobody zeroes before the loop
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    check = AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss())
    report = loop(net, trainer, check, 6, 3).report
    assert [s.verdict for s in report.steps] == ["mismatch", "faithful"]


def test_steps_stops_checking_after_k_optimizer_steps():
    net, trainer = small_net()
    check = AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss(), steps=1)
    loop(net, trainer, check, 8, 3)
    assert check.done and len(check.report.steps) == 1 and check.report.micro_batches_seen == 3
    assert check.report.unstepped == []


# ----------------------------------------------------------------------------- left as found


@pytest.mark.parametrize("fail_at", [None, 4], ids=["finished", "raised"])
def test_the_net_and_trainer_are_left_as_found(fail_at):
    net, trainer = small_net()
    x, y = micro_batches(2)[1]
    with autograd.record():  # gradients the check finds (and must leave) that are not zero
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    before = snapshot(net, trainer)
    assert any(np.frombuffer(g, np.float32).any() for g in before["grad"].values())
    states = random.getstate(), np.random.get_state()
    check = AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss())
    if fail_at is None:
        loop(net, trainer, check, 7, 3)
    else:
        with pytest.raises(RuntimeError, match="the loop broke"):
            loop(net, trainer, check, 7, 3, fail_at=fail_at)
    assert len(check.windows) > 0  # the check stepped the float64 copies
    assert snapshot(net, trainer) == before
    python_state, numpy_state = states
    assert random.getstate() == python_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_state))
    x, y = micro_batches(1)[0]  # and the net still trains in float32 afterwards
    net.collect_params().zero_grad()
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    trainer.step(B)
    assert net[0].weight.data().dtype == np.float32 and trainer._optimizer.num_update == before["num_update"] + 1


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make, words", [
    (lambda net, trainer: AccumulationCheck(object(), trainer), "net must be a gluon.Block"),
    (lambda net, trainer: AccumulationCheck(net, "sgd"), "trainer must be a gluon.Trainer"),
    (lambda net, trainer: AccumulationCheck(net, trainer, steps=0), "steps must be a whole number >= 1"),
    (lambda net, trainer: AccumulationCheck(net, trainer).record(mx.nd.ones((2, 5))), "outside `with check:`"),
    (lambda net, trainer: AccumulationCheck(net, trainer).report, "no report yet"),
    (lambda net, trainer: run_case("padded-tokens", 2, fault="drop"), "step-per-micro-batch, loss-over-n"),
    (lambda net, trainer: AccumulationCheck(*_deferred()).__enter__(), "run one forward pass before the check"),
], ids=["net", "trainer", "steps", "record", "report", "fault", "deferred"])
def test_bad_input_is_one_line_saying_what_to_do(make, words):
    net, trainer = small_net()
    with pytest.raises(AccumcheckError, match=words) as caught:
        make(net, trainer)
    assert "\n" not in str(caught.value)


def _deferred():
    net = gluon.nn.Dense(3)  # in_units unknown until the first forward
    net.initialize()
    return net, gluon.Trainer(net.collect_params(), "sgd")


def test_a_missing_mxnet_is_one_actionable_error(monkeypatch):
    """Importing the integration without MXNet installed: one AccumcheckError saying what to install."""
    import importlib
    import sys

    for name in [m for m in sys.modules if m == "mxnet" or m.startswith("mxnet.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "accumcheck.integrations.gluon", raising=False)
    monkeypatch.delitem(sys.modules, "accumcheck.mxnet.library", raising=False)
    with pytest.raises(AccumcheckError, match=r"accumcheck.integrations.gluon needs MXNet \(mxnet is not installed\); "
                                              r"install them with pip install 'accumcheck\[mxnet\]'"):
        importlib.import_module("accumcheck.integrations.gluon")


# ----------------------------------------------------------------------------- what the step did


def test_each_step_is_one_update_the_optimizer_replayed_once_makes():
    net, trainer = small_net()  # momentum SGD with states from a step before the check
    report = loop(net, trainer, AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss()), 8, 4).report
    assert report.exit_code == 0
    for s in report.steps:
        assert s.update.one_update and s.update.optimizer_steps == 1 and s.update.moved == []
        assert s.update.error is not None and s.update.error <= 1


def test_a_step_at_every_micro_batch_of_a_window_zeroed_once_is_several_updates():
    net, trainer = small_net()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    check = AccumulationCheck(net, trainer, loss_fn)
    with check:
        for i, (x, y) in enumerate(micro_batches(8)):
            x, y = check.record(x, y)
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(4 * B)
            if (i + 1) % 4 == 0:
                net.collect_params().zero_grad()
    report = check.report
    assert report.exit_code == 1
    assert [s.update.optimizer_steps for s in report.steps] == [1, 2, 3, 4] * 2
    assert "the optimizer stepped 4 times in this window of 4 micro-batches" in report.steps[3].explanation
    assert report.steps[0].update.split


def test_weights_decayed_by_hand_at_every_micro_batch_moved_inside_the_window():
    net, trainer = small_net()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    check = AccumulationCheck(net, trainer, loss_fn)
    with check:
        for i, (x, y) in enumerate(micro_batches(8)):
            x, y = check.record(x, y)
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            for p in net.collect_params().values():
                if p.grad_req != "null":
                    p.set_data(p.data() * (1 - 1e-3))
            if (i + 1) % 4 == 0:
                trainer.step(4 * B)
                net.collect_params().zero_grad()
    report = check.report
    assert report.exit_code == 1 and all(s.update.moved for s in report.steps)
    assert all(s.update.error > 1 for s in report.steps)  # nor is the update the optimizer's once
    assert "moved between the window's micro-batches" in report.summary()
