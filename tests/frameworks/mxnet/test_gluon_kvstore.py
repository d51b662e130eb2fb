"""The Gluon Trainer on several contexts under a kvstore, under the training stack check: the
applied gradient is every context's gradient summed (as the kvstore sums them), judged against the
window as one batch. A faithful loop is faithful whether the kvstore or the Trainer updates (the
positive controls); trainer.step given one context's share is named C times too large (the negative
control); the trainer's own kvstore, its optimizer states and every context's parameters are left
as found, so training goes on bit for bit as it would have without the check."""

import numpy as np
import pytest

from accumcheck.errors import AccumcheckError

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
from mxnet import autograd, gluon  # noqa: E402

from accumcheck.integrations.gluon import AccumulationCheck, run_case  # noqa: E402

B = 6  # samples per micro-batch, split across the contexts
CONTEXTS = [mx.cpu(0), mx.cpu(1)]


def net_and_trainer(kvstore="local", update_on_kvstore=None, optimizer="adam"):
    """Dense -> Dense on two CPU contexts, grad_req='add', and a Trainer that has stepped once (so
    its kvstore holds weights and, with update_on_kvstore, the optimizer's states)."""
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, in_units=5, activation="tanh"), gluon.nn.Dense(3, in_units=8))
    net.initialize(mx.init.Xavier(), ctx=CONTEXTS)
    net.hybridize()
    for param in net.collect_params().values():
        param.grad_req = "add"
    trainer = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": 0.01}, kvstore=kvstore,
                            update_on_kvstore=update_on_kvstore)
    train_step(net, trainer, *micro_batches(1)[0])
    return net, trainer


def micro_batches(count, seed=1):
    rng = np.random.default_rng(seed)
    return [(mx.nd.array(rng.standard_normal((B, 5))), mx.nd.array(rng.integers(0, 3, B))) for _ in range(count)]


def backward_on_contexts(net, x, y):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    shards = zip(gluon.utils.split_and_load(x, CONTEXTS), gluon.utils.split_and_load(y, CONTEXTS))
    with autograd.record():
        losses = [loss_fn(net(xs), ys) for xs, ys in shards]
    autograd.backward(losses)


def train_step(net, trainer, x, y):
    backward_on_contexts(net, x, y)
    trainer.step(B)
    net.collect_params().zero_grad()


def loop(net, trainer, count, n, per_context=False):
    """The data-parallel loop a Gluon user writes: each micro-batch recorded whole, split across the
    contexts, one backward per context, trainer.step once per window of n."""
    check = AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss())
    with check:
        for i, (x, y) in enumerate(micro_batches(count)):
            x, y = check.record(x, y)
            backward_on_contexts(net, x, y)
            if (i + 1) % n == 0:
                trainer.step(n * B / (len(CONTEXTS) if per_context else 1))
                net.collect_params().zero_grad()
    return check.report


def weights(net):
    """Every context's copy of every parameter, by position (two nets' parameter names differ)."""
    return [(str(c), d.asnumpy().tobytes()) for p in net.collect_params().values()
            for c, d in zip(p.list_ctx(), p.list_data())]


# ----------------------------------------------------------------------------- a built-in case


def test_a_built_in_case_on_two_contexts_is_faithful_at_every_step():
    report = run_case("padded-tokens", 4, world_size=2)
    assert [s.verdict for s in report.steps] == ["faithful"] * 3 and report.exit_code == 0
    assert all(s.result.max_relative_difference < 1e-12 for s in report.steps)
    assert any("2 contexts (cpu(0), cpu(1)), kvstore 'local'" in note for note in report.notes)


def test_a_step_given_one_contexts_share_is_c_times_too_large():
    report = run_case("padded-tokens", 4, 8, world_size=2, fault="step-per-context-batch")
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "C")] * 2
    assert report.steps[0].result.factor == pytest.approx(2.0) and report.exit_code == 1
    assert "C = 2 contexts" in report.summary() and "trainer.step's batch_size counts one context's" in report.summary()


def test_a_loss_divided_by_n_on_two_contexts_is_one_over_n():
    report = run_case("padded-tokens", 4, 8, world_size=2, fault="loss-over-n")
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "1/N")] * 2


# ----------------------------------------------------------------------------- your own loop


@pytest.mark.parametrize("kvstore, update_on_kvstore", [("local", True), ("local", False), ("device", None)],
                         ids=["local-update-on-kvstore", "local-trainer-updates", "device"])
def test_your_loop_on_two_contexts_is_faithful_and_training_goes_on_as_without_the_check(kvstore, update_on_kvstore):
    checked, checked_trainer = net_and_trainer(kvstore, update_on_kvstore)
    control, control_trainer = net_and_trainer(kvstore, update_on_kvstore)  # the same run, never checked
    assert weights(checked) == weights(control)
    own_kvstore = checked_trainer._kvstore
    report = loop(checked, checked_trainer, 6, 3)
    assert [s.verdict for s in report.steps] == ["faithful"] * 2 and report.exit_code == 0
    assert checked_trainer._kvstore is own_kvstore and "step" not in vars(checked_trainer)
    assert weights(checked) == weights(control)
    for x, y in micro_batches(3, seed=7):  # the next real steps: the kvstore's and optimizer's states as they were
        train_step(checked, checked_trainer, x, y)
        train_step(control, control_trainer, x, y)
    assert weights(checked) == weights(control)
    assert checked_trainer._optimizer.num_update == control_trainer._optimizer.num_update


def test_your_loop_stepping_one_contexts_share_is_flagged():
    net, trainer = net_and_trainer()
    report = loop(net, trainer, 6, 3, per_context=True)
    assert [(s.verdict, s.result.matches) for s in report.steps] == [("constant-factor", "C")] * 2


# ----------------------------------------------------------------------------- refused


def test_a_distributed_kvstore_is_refused_in_one_line():
    net, _ = net_and_trainer()
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore="dist_sync")  # created at its first step
    with pytest.raises(AccumcheckError, match="a distributed KVStore \\('dist_sync'\\)") as caught:
        AccumulationCheck(net, trainer).__enter__()
    assert "\n" not in str(caught.value) and "kvstore='local'" in str(caught.value)


def test_parameters_on_other_contexts_than_the_trainers_are_refused():
    net, trainer = net_and_trainer()
    net.collect_params().reset_ctx(mx.cpu(0))
    with pytest.raises(AccumcheckError, match="lives on cpu\\(0\\) but the trainer on cpu\\(0\\), cpu\\(1\\)"):
        AccumulationCheck(net, trainer).__enter__()


def test_one_contexts_share_needs_several_contexts():
    with pytest.raises(AccumcheckError, match="needs several contexts; add --world-size 2"):
        run_case("padded-tokens", 2, fault="step-per-context-batch")


def test_the_float64_run_starts_from_the_optimizer_states_the_kvstore_holds():
    """With update_on_kvstore the optimizer's states (Adam's moments) live in the kvstore's updater:
    the check's own kvstore starts from float64 copies of them, not from zeros."""
    net, trainer = net_and_trainer("local", True)
    found = {i: [s.asnumpy() for s in states] for i, states in trainer._kvstore._updater.states.items()}
    assert found and any(s.any() for states in found.values() for s in states)
    with AccumulationCheck(net, trainer, gluon.loss.SoftmaxCrossEntropyLoss()):
        during = trainer._kvstore._updater.states
        assert sorted(during) == sorted(found)
        for i, states in during.items():
            assert all(s.dtype == np.float64 and np.array_equal(s.asnumpy(), f) for s, f in zip(states, found[i]))


@pytest.mark.parametrize("flags, code, words", [([], 0, "FAITHFUL: every optimizer step"),
                                                (["--per-context"], 1, "matches C (C = 2 contexts)")],
                         ids=["faithful", "per-context"])
def test_the_example_loop_on_two_contexts(flags, code, words):
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[3] / "examples" / "gluon_contexts.py"
    result = subprocess.run([sys.executable, str(example), *flags], capture_output=True, text=True, timeout=300)
    assert result.returncode == code, result.stderr[-2000:]
    assert words in result.stdout
