"""accumcheck.mxnet.check on Gluon blocks as people build them: a model-zoo ResNet (deferred
initialisation, BatchNorm), an LSTM language model, the batch forms, step=, unused and tied
parameters, train_mode, and one-line errors for bad input."""

import random

import numpy as np
import pytest
from attribution_checks import assert_explained

import accumcheck
from accumcheck.options.choices import FAULT_KINDS

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
import accumcheck.mxnet  # noqa: E402

autograd, gluon = mx.autograd, mx.gluon

N = 16
HYBRIDIZE = pytest.mark.parametrize("hybridize", [False, True], ids=["imperative", "hybridized"])
# Each ResNet-18 run at N = 16 costs seconds: those run with -m slow (ci/slow.sh), a short one that
# checks the block is left as found by default; the LSTM model below runs in full by default.
RESNET_FAULTS = [pytest.param(kind, marks=pytest.mark.slow) for kind in FAULT_KINDS]
RESNET_HYBRIDIZE = pytest.mark.parametrize("hybridize", [pytest.param(False, marks=pytest.mark.slow),
                                                        pytest.param(True, marks=pytest.mark.slow)],
                                           ids=["imperative", "hybridized"])
SOFTMAX = gluon.loss.SoftmaxCrossEntropyLoss()


def _resnet(hybridize=False, seed=0):
    mx.random.seed(seed)
    net = gluon.model_zoo.vision.resnet18_v1(classes=10, pretrained=False, prefix="resnet_")
    net.initialize()  # no in_channels anywhere: every convolution, BatchNorm and the classifier are deferred
    if hybridize:
        net.hybridize(static_alloc=True)
    return net


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return [(mx.nd.array(rng.standard_normal((2, 3, 32, 32))), mx.nd.array(rng.integers(0, 10, 2))) for _ in range(N)]


class LanguageModel(gluon.HybridBlock):
    def __init__(self, vocab=50, width=16, hidden=24, tied=False, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embedding = gluon.nn.Embedding(vocab, width)
            self.lstm = gluon.rnn.LSTM(hidden, num_layers=2, dropout=dropout)  # input size deferred
            if tied:
                self.project = gluon.nn.Dense(width, flatten=False)
                self.decoder = gluon.nn.Dense(vocab, flatten=False, in_units=width, params=self.embedding.params)
            else:
                self.decoder = gluon.nn.Dense(vocab, flatten=False)

    def hybrid_forward(self, F, tokens):
        hidden = self.lstm(self.embedding(tokens))
        return self.decoder(self.project(hidden) if hasattr(self, "project") else hidden)


def _language_model(hybridize=False, tied=False, dropout=0.0):
    mx.random.seed(0)
    net = LanguageModel(tied=tied, dropout=dropout, prefix="lm_")
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize(static_alloc=True)
    return net


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(1)
    return [(mx.nd.array(rng.integers(0, 50, (8, 4))), mx.nd.array(rng.integers(0, 50, (8, 4)))) for _ in range(N)]


def _state(net):
    """Everything check may touch, by parameter: grad_req, deferred or not, shape, data, gradient."""
    state = {}
    for name, p in net.collect_params().items():
        data = None if p._data is None else p.data().asnumpy().copy()
        grad = None if p._data is None or p.grad_req == "null" else p.grad().asnumpy().copy()
        state[name] = (p.grad_req, bool(p._deferred_init), p.shape, data, grad)
    return state


def _assert_same_state(before, after):
    assert before.keys() == after.keys()
    for name, (req, deferred, shape, data, grad) in before.items():
        assert after[name][:3] == (req, deferred, shape), name
        for was, now in zip((data, grad), after[name][3:]):
            assert (was is None and now is None) or np.array_equal(was, now), name


def _flagged(report):
    return [t.name for t in report.flagged]


# ------------------------------------------------------------------------------- model zoo: ResNet


@RESNET_HYBRIDIZE
def test_resnet18_is_faithful_and_its_deferred_parameters_stay_deferred(images, hybridize):
    net = _resnet(hybridize)
    before = _state(net)
    report = accumcheck.mxnet.check(net, SOFTMAX, images, accum_steps=N)
    accumcheck.assert_faithful(report)
    assert any("deferred initialisation" in note for note in report.notes)
    assert len(report.tensors) == 62  # the 102 parameters less the 40 BatchNorm running statistics
    _assert_same_state(before, _state(net))
    # The next call initialises the parameters as it would have without the check.
    twin = _resnet(hybridize)
    for block in (net, twin):
        mx.random.seed(7)
        block(images[0][0])
    for mine, theirs in zip(net.collect_params().values(), twin.collect_params().values()):
        assert mine.shape == theirs.shape and np.array_equal(mine.data().asnumpy(), theirs.data().asnumpy())


@pytest.mark.slow  # a ResNet-18 check: run by ci/slow.sh; small blocks check the same state by default
def test_resnet18_is_left_exactly_as_found(images):
    net = _resnet(hybridize=True)
    net(images[0][0])
    rng = np.random.default_rng(2)
    for p in net.collect_params(".*running.*").values():
        p.set_data(mx.nd.array(rng.uniform(0.5, 1.5, p.shape)))
    with autograd.record():
        SOFTMAX(net(images[1][0]), images[1][1]).backward()  # gradients left behind
    net.output.bias.grad_req = "add"
    before = _state(net)
    report = accumcheck.mxnet.check(net, SOFTMAX, images, accum_steps=4, train_mode=True)  # updates running stats
    assert report.exit_code == 0 and not any("deferred" in note for note in report.notes)
    _assert_same_state(before, _state(net))
    assert all(not b._kwargs["use_global_stats"] for b in _blocks(net, gluon.nn.BatchNorm))


@pytest.mark.parametrize("fault", RESNET_FAULTS)
def test_every_fault_is_flagged_on_resnet18(images, fault):
    report = accumcheck.mxnet.check(_resnet(hybridize=True), SOFTMAX, images, accum_steps=N, inject=fault)
    assert _flagged(report) == ([] if fault == "roundoff" else ["resnet_conv0_weight"])


# ------------------------------------------------------------------------------- LSTM language model


@HYBRIDIZE
def test_lstm_language_model_is_faithful_and_every_fault_is_flagged(tokens, hybridize):
    net = _language_model(hybridize)
    report = accumcheck.mxnet.check(net, SOFTMAX, tokens, accum_steps=N)
    accumcheck.assert_faithful(report)
    assert {t.kind for t in report.tensors} == {"embedding", "weight", "bias"}
    for fault in FAULT_KINDS:
        faulty = accumcheck.mxnet.check(net, SOFTMAX, tokens, accum_steps=N, inject=f"{fault}:lm_lstm0_l1_h2h_weight"
                                        if fault != "roundoff" else fault)
        assert _flagged(faulty) == ([] if fault == "roundoff" else ["lm_lstm0_l1_h2h_weight"]), fault
        if fault != "roundoff":  # the second pass names the fault, at its micro-step
            assert_explained(faulty.flagged[0], fault, N)


@HYBRIDIZE
def test_lstm_dropout_between_layers_is_off_in_train_mode(tokens, hybridize):
    net = _language_model(hybridize, dropout=0.5)
    rates = []

    def step(block, batch):
        rates.append(block.lstm._dropout)  # MXNet's CPU kernel ignores it; cuDNN applies it
        return SOFTMAX(block(batch[0]), batch[1])

    report = accumcheck.mxnet.check(net, batches=tokens, accum_steps=4, step=step, train_mode=True)
    accumcheck.assert_faithful(report)
    second_pass = any(t.fault_score is not None for t in report.tensors)  # where the two modes differ
    assert rates[1:] == [0.0] * (12 if second_pass else 8) and net.lstm._dropout == 0.5


# ------------------------------------------------------------------------------- batch forms, step=


def _mlp():
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, activation="tanh"), gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier())
    return net


def _features(count=8, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize("form", ["label None", "no label", "bare inputs"])
def test_a_loss_without_a_label(form):
    def loss_fn(out):
        return (out ** 2).mean(axis=1)

    make = {"label None": lambda x: (x, None), "no label": lambda x: (x,), "bare inputs": lambda x: x}[form]
    report = accumcheck.mxnet.check(_mlp(), loss_fn, [make(x) for x in _features()])  # numpy inputs
    accumcheck.assert_faithful(report)
    assert report.accum_steps == 8


class TwoInputs(gluon.Block):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.image = gluon.nn.Dense(4, in_units=5)
            self.side = gluon.nn.Dense(4, in_units=3)

    def forward(self, image, side, scale=1.0):
        return self.image(image) * scale + self.side(side)


def test_dict_tuple_and_nested_inputs():
    net = TwoInputs()
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(4)
    pairs = [(x, rng.standard_normal((4, 3))) for x in _features()]
    labels = [mx.nd.array(rng.integers(0, 4, 4)) for _ in pairs]
    as_dict = [({"image": x, "side": s, "scale": 0.5}, y) for (x, s), y in zip(pairs, labels)]
    as_tuple = [((mx.nd.array(x), s), y) for (x, s), y in zip(pairs, labels)]
    for batches in (as_dict, as_tuple):
        accumcheck.assert_faithful(accumcheck.mxnet.check(net, SOFTMAX, batches))


class OwnLoss(gluon.HybridBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(3)
        self.loss = gluon.loss.SoftmaxCrossEntropyLoss()

    def hybrid_forward(self, F, x, y):
        return self.loss(self.dense(x), y).mean()  # one scalar: the model computes its own loss


@HYBRIDIZE
def test_a_block_that_computes_its_own_loss(hybridize):
    net = OwnLoss()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    rng = np.random.default_rng(5)
    batches = [(x, mx.nd.array(rng.integers(0, 3, 4))) for x in _features()]
    accumcheck.assert_faithful(accumcheck.mxnet.check(net, batches=batches))


def test_step_computes_the_loss(tokens):
    net = _language_model()
    seen = []

    def step(block, batch):
        seen.append(batch[0].context)
        return SOFTMAX(block(batch[0]), batch[1]).sum()

    report = accumcheck.mxnet.check(net, batches=tokens, accum_steps=4, step=step)
    accumcheck.assert_faithful(report)
    second_pass = any(t.fault_score is not None for t in report.tensors)  # where the two modes differ
    assert len(seen) == 1 + (3 if second_pass else 2) * 4  # the forward that initialises, then the passes
    assert all(ctx == mx.cpu() for ctx in seen)


# ------------------------------------------------------------------------------- unused and tied parameters


class Gated(gluon.Block):
    def __init__(self, deferred_unused=False, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.body = gluon.nn.Dense(4, in_units=5)
            self.branch = gluon.nn.Dense(4, in_units=5)
            self.unused = gluon.nn.Dense(4, in_units=0 if deferred_unused else 5)  # never called

    def forward(self, x, gate):
        out = self.body(x)
        return out + self.branch(x) if gate else out


@HYBRIDIZE
def test_unused_and_sometimes_used_parameters(hybridize):
    net = Gated()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    gates = [i % 3 == 0 for i in range(8)]
    rng = np.random.default_rng(6)
    batches = [((x, gate), mx.nd.array(rng.integers(0, 4, 4))) for x, gate in zip(_features(), gates)]
    report = accumcheck.mxnet.check(net, SOFTMAX, batches)
    accumcheck.assert_faithful(report)
    tensors = {t.name: t for t in report.tensors}
    unused, branch, body = (tensors[layer.weight.name] for layer in (net.unused, net.branch, net.body))
    assert unused.verdict == "no-gradient" and unused.steps_with_grad == 0
    assert branch.verdict in ("identical", "round-off") and branch.steps_with_grad == sum(gates)
    assert body.steps_with_grad is None


def test_a_deferred_parameter_no_micro_batch_initialises_is_named_and_not_judged():
    net = Gated(deferred_unused=True)
    net.initialize(mx.init.Xavier())
    batches = [((x, True), mx.nd.array([0, 1, 2, 3])) for x in _features(4)]
    report = accumcheck.mxnet.check(net, SOFTMAX, batches)
    assert report.exit_code == 0 and not any("unused" in t.name for t in report.tensors)
    assert any("not judged" in note and net.unused.weight.name in note for note in report.notes)
    assert net.unused.weight._data is None and net.unused.weight._deferred_init


@HYBRIDIZE
def test_tied_parameters_are_judged_once(tokens, hybridize):
    net = _language_model(hybridize, tied=True)
    report = accumcheck.mxnet.check(net, SOFTMAX, tokens, accum_steps=8)
    accumcheck.assert_faithful(report)
    names = [t.name for t in report.tensors]
    assert len(names) == len(set(names)) and names.count("lm_embedding0_weight") == 1
    tied = next(t for t in report.tensors if t.name == "lm_embedding0_weight")
    assert tied.aliases == ["decoder.weight"] and tied.kind == "embedding"
    faulty = accumcheck.mxnet.check(net, SOFTMAX, tokens, accum_steps=8, inject="scale")
    assert _flagged(faulty) == ["lm_embedding0_weight"]


def test_a_parameter_under_two_keys_is_judged_once():
    net = _mlp()
    net.params.update({"alias_weight": net[0].weight})  # one Parameter, two keys of collect_params()
    batches = [(x, mx.nd.array([0, 1, 2, 0])) for x in _features(4)]
    report = accumcheck.mxnet.check(net, SOFTMAX, batches)
    accumcheck.assert_faithful(report)
    shared = [t for t in report.tensors if net[0].weight.name in [t.name, *(t.aliases or [])]]
    assert len(report.tensors) == 4 and len(shared) == 1 and "alias_weight" in [shared[0].name, *shared[0].aliases]


# ------------------------------------------------------------------------------- BatchNorm and train_mode


class Normed(gluon.HybridBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.conv = gluon.nn.Conv2D(4, 3, padding=1)
            self.norm = gluon.nn.BatchNorm()
            self.drop = gluon.nn.Dropout(0.5)
            self.out = gluon.nn.Dense(3)

    def hybrid_forward(self, F, x):
        return self.out(self.drop(F.relu(self.norm(self.conv(x)))))


def _normed(hybridize):
    mx.random.seed(0)
    net = Normed()
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize(static_alloc=True)
    rng = np.random.default_rng(7)
    batches = [(mx.nd.array(rng.standard_normal((4, 2, 6, 6))), mx.nd.array(rng.integers(0, 3, 4))) for _ in range(8)]
    net(batches[0][0])
    net.norm.running_mean.set_data(mx.nd.array(rng.uniform(-1, 1, 4)))
    net.norm.running_var.set_data(mx.nd.array(rng.uniform(0.5, 2, 4)))
    return net, batches


def _inference_loss(net, batches):
    return float(np.mean([SOFTMAX(net(x), y).mean().asscalar() for x, y in batches]))


@HYBRIDIZE
@pytest.mark.parametrize("train_mode", [False, True], ids=["running-statistics", "batch-statistics"])
def test_batchnorm_statistics_follow_train_mode_and_dropout_stays_off(hybridize, train_mode):
    net, batches = _normed(hybridize)
    before = _state(net)
    report = accumcheck.mxnet.check(net, SOFTMAX, batches, train_mode=train_mode)
    accumcheck.assert_faithful(report)  # Dropout on would draw other masks in each pass: diverged
    inference = _inference_loss(net, batches)  # BatchNorm on running statistics, no Dropout
    assert (report.losses["mean_loss"] == pytest.approx(inference, rel=1e-5)) is not train_mode
    assert report.settings["train_mode"] is train_mode
    _assert_same_state(before, _state(net))
    assert net.drop._rate == 0.5 and net.norm._kwargs["use_global_stats"] is False


class Counter(gluon.Block):
    """A block that uses and updates a parameter without a gradient, as a step counter would."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(3, in_units=5)
            self.scale = self.params.get("scale", shape=(1,), init=mx.init.One(), grad_req="null")

    def forward(self, x):
        scale = self.scale.data()
        self.scale.set_data(scale * 1.5)
        return self.dense(x) * scale


def test_state_the_block_changes_is_put_back_before_each_pass():
    net = Counter()
    net.initialize(mx.init.Xavier())
    batches = [(x, mx.nd.array([0, 1, 2, 0])) for x in _features()]
    report = accumcheck.mxnet.check(net, SOFTMAX, batches)
    accumcheck.assert_faithful(report)
    assert report.losses["mean_loss"] == report.losses["manual_mean_loss"]
    assert net.scale.data().asscalar() == 1.0 and [t.name for t in report.tensors] == list(net.dense.params.keys())


def _blocks(net, kind):
    found = []
    net.apply(lambda b: found.append(b) if isinstance(b, kind) else None)
    return found


# ------------------------------------------------------------------------------- bad input: one line each


def _one_line(excinfo, *words):
    text = str(excinfo.value)
    assert "\n" not in text and text.startswith("check:"), text
    for word in words:
        assert word in text, text


def test_an_uninitialised_block_is_one_line():
    net = gluon.nn.Dense(3)
    with pytest.raises(accumcheck.AccumcheckError) as excinfo:
        accumcheck.mxnet.check(net, SOFTMAX, [(mx.nd.ones((2, 4)), mx.nd.ones(2))])
    _one_line(excinfo, "not initialised", "net.initialize()")


def test_loss_fn_and_step_together_and_no_batches_are_one_line():
    with pytest.raises(accumcheck.AccumcheckError) as excinfo:
        accumcheck.mxnet.check(_mlp(), SOFTMAX, _features(), step=lambda block, batch: block(batch))
    _one_line(excinfo, "loss_fn or step, not both")
    with pytest.raises(accumcheck.AccumcheckError) as excinfo:
        accumcheck.mxnet.check(_mlp(), SOFTMAX)
    _one_line(excinfo, "batches is missing")


def _labelled():
    return [(x, mx.nd.array([0, 1, 2, 0])) for x in _features(4)]


@pytest.mark.parametrize("device", [None, "cpu", "cpu:0", mx.cpu(0)])
def test_the_device_is_a_context_or_a_name_as_pytorch_takes_it(device):
    report = accumcheck.mxnet.check(_mlp(), SOFTMAX, _labelled(), device=device)
    assert report.exit_code == 0 and report.device == "cpu(0)"


@pytest.mark.parametrize("kwargs, words", [
    ({"device": "tpu"}, ["device 'tpu' is not a device MXNet has", "mx.Context", "cuda:N"]),
    ({"device": 3}, ["device 3 is not a device MXNet has"]),
    ({"device": "gpu:1"}, ["parameters are on cpu(0), not gpu:1", "pass device=mx.cpu(0)"]),
    ({"device": mx.cpu(1)}, ["parameters are on cpu(0), not cpu(1)"]),
    ({"memory_budget": "1G"}, ["accumcheck.mxnet.check cannot honour memory_budget='1G'", "every parameter at once",
                               "leave it out"]),
    ({"accum_steps": 0}, ["accum_steps must be a positive integer, got 0"]),
    ({"inject": 3}, ["inject must be a text"]),
])
def test_a_device_it_cannot_use_and_a_budget_are_refused_in_one_line(kwargs, words):
    with pytest.raises(accumcheck.AccumcheckError) as excinfo:
        accumcheck.mxnet.check(_mlp(), SOFTMAX, _labelled(), **kwargs)
    _one_line(excinfo, *words)


def test_what_step_returns():
    batches = [(x, mx.nd.array([0, 1, 2, 0])) for x in _features(4)]
    per_example = accumcheck.mxnet.check(_mlp(), batches=batches, step=lambda b, batch: SOFTMAX(b(batch[0]), batch[1]))
    accumcheck.assert_faithful(per_example)  # a loss per example: backward() sums it, as in MXNet's own loops
    with pytest.raises(accumcheck.AccumcheckError) as excinfo:
        accumcheck.mxnet.check(_mlp(), batches=batches, step=lambda b, batch: float(b(batch[0]).sum().asscalar()))
    _one_line(excinfo, "step returned a float", "NDArray")
    with pytest.raises(accumcheck.AccumcheckError) as excinfo:
        accumcheck.mxnet.check(_mlp(), batches=batches, step=lambda b, batch: mx.nd.ones(1))  # outside the graph
    _one_line(excinfo, "the loss of micro-batch 0 is not in a computational graph", "return the loss; accumcheck "
              "calls backward itself")


@HYBRIDIZE
def test_a_batch_the_block_cannot_take_is_one_line_and_the_block_is_left_as_found(images, hybridize):
    net = _resnet(hybridize)
    before = _state(net)
    flat = [(x.reshape((2, -1)), y) for x, y in images[:2]]
    with pytest.raises(accumcheck.AccumcheckError) as excinfo:
        accumcheck.mxnet.check(net, SOFTMAX, flat)
    _one_line(excinfo, "the block raised", "micro-batch 0", "Input data should be 4D")
    assert "[" not in str(excinfo.value).split(": ", 1)[1].split(";")[0]  # no C++ source location
    assert excinfo.value.__cause__ is not None
    _assert_same_state(before, _state(net))


def test_an_interrupt_is_not_turned_into_an_error():
    def step(block, batch):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        accumcheck.mxnet.check(_mlp(), batches=_features(2), step=step)


def test_the_reproduce_line_names_the_step_and_a_check_that_cannot_fit_is_refused(monkeypatch):
    from accumcheck.run import resources

    net = gluon.nn.Dense(3, in_units=4)
    net.initialize()
    batches = [(mx.nd.ones((2, 4)), mx.nd.array([0, 1])) for _ in range(4)]
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    report = accumcheck.mxnet.check(net, batches=batches, step=lambda b, batch: loss(b(batch[0]), batch[1]),
                                    train_mode=True)
    assert report.reproduce_command() == ("accumcheck.mxnet.check(<your Dense>, batches=batches, step=step, "
                                          "accum_steps=4, train_mode=True)")
    monkeypatch.setattr(resources, "available_memory", lambda: 100)
    with pytest.raises(accumcheck.AccumcheckError, match=r"needs about .* beside the model \(15 parameters\)"):
        accumcheck.mxnet.check(net, loss, batches)
    assert accumcheck.mxnet.check(net, loss, batches, force=True).exit_code == 0


# ------------------------------------------------------------------------------- mode: GradAccumulator


@HYBRIDIZE
def test_a_grad_accumulator_in_the_native_slot(tokens, hybridize):
    """mode="compensated": within half a float32 ulp of E; a fault on its buffer is caught; the
    block is left as found."""
    net = _language_model(hybridize)
    before = _state(net)
    report = accumcheck.mxnet.check(net, SOFTMAX, tokens, accum_steps=N, mode="compensated")
    assert report.exit_code == 0 and report.config["mode"] == "compensated"
    assert max(t.err_ulps_native for t in report.tensors) <= 0.5
    _assert_same_state(before, _state(net))
    faulty = accumcheck.mxnet.check(net, SOFTMAX, tokens, accum_steps=N, mode="accumulator",
                                    inject="drop-step:lm_lstm0_l1_h2h_weight")
    assert _flagged(faulty) == ["lm_lstm0_l1_h2h_weight"]


def test_an_unknown_mode_is_one_line(tokens):
    with pytest.raises(accumcheck.AccumcheckError, match="check: mode must be one of native, accumulator, "
                                                         "compensated, got 'kahan'"):
        accumcheck.mxnet.check(_language_model(), SOFTMAX, tokens, mode="kahan")


# ------------------------------------------------------------------------------- the user's code, left as found


class Restless(gluon.Block):
    """A block whose forward changes what a check must put back: it rebinds an attribute, appends
    to a list, adds to an NDArray in place, moves an average kept in a grad_req='null' Parameter,
    and BatchNorm's running statistics move in train_mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(4, in_units=3)
            self.norm = gluon.nn.BatchNorm(in_channels=4)
            self.out = gluon.nn.Dense(2, in_units=4)
            self.average = self.params.get("average", shape=(4,), init=mx.init.Zero(), grad_req="null")
        self.seen, self.calls, self.total = 0, [], mx.nd.zeros(1)

    def forward(self, x):
        self.seen = self.seen + 1
        self.calls.append(self.seen)
        self.total += 1
        hidden = self.norm(self.dense(x))
        with autograd.pause():
            self.average.set_data(self.average.data().astype(hidden.dtype) * 0.5 + hidden.mean(axis=0))
        self.added = True
        return self.out(hidden)


def _restless():
    mx.random.seed(0)
    net = Restless(prefix="restless_")
    net.initialize(mx.init.Xavier())
    with autograd.record():
        L2(net(mx.nd.ones((2, 3))), mx.nd.ones((2, 2))).backward()  # gradients left behind
    del net.added
    return net


L2 = gluon.loss.L2Loss()
# micro-batch k's label holds k, so that the user's code knows where it is
RESTLESS_BATCHES = [(mx.nd.array(np.random.default_rng(k).standard_normal((2, 3))), mx.nd.full((2, 2), k))
                    for k in range(8)]


def _index(label):
    return int(label[0, 0].asscalar())


def _everything(net):
    """What the user's code or the check may change: parameters, gradients (the arrays too),
    the blocks' attributes, and Python's and NumPy's random states."""
    grads = {name: p.list_grad() for name, p in net.collect_params().items() if p.grad_req != "null"}
    return (_state(net), grads, net.seen, net.calls, list(net.calls), net.total, net.total.asnumpy(),
            hasattr(net, "added"), random.getstate(), np.random.get_state())


def _assert_everything_as_found(before, after):
    _assert_same_state(before[0], after[0])
    assert before[1].keys() == after[1].keys()
    assert all(a is b for name in before[1] for a, b in zip(before[1][name], after[1][name])), "gradient arrays"
    seen, calls, called, total, value, added, python, numpy = before[2:]
    assert after[2] == seen and after[3] is calls and after[4] == called and after[5] is total, "attributes"
    assert np.array_equal(after[6], value) and after[7] == added
    assert after[8] == python, "Python's random state"
    assert after[9][0] == numpy[0] and np.array_equal(after[9][1], numpy[1]) and after[9][2:] == numpy[2:], "NumPy's"


RESTLESS_PATHS = {"native": {}, "train_mode": {"train_mode": True}, "oracle-full_batch": {"oracle": True,
                                                                                           "full_batch": True},
                  "accumulator": {"mode": "accumulator"}}
RESTLESS_RUNS = [(path, fails) for path in RESTLESS_PATHS for fails in (None, "the passes")] + \
    [("oracle-full_batch", "the float64 pass")]


@pytest.mark.parametrize("path, fails", RESTLESS_RUNS, ids=[f"{p}-{f or 'succeeds'}" for p, f in RESTLESS_RUNS])
def test_a_loss_that_draws_random_numbers_and_a_forward_that_changes_the_block_are_put_back(path, fails):
    """Python's and NumPy's random states, the weights, BatchNorm's statistics and an average the
    forward moves, gradients, and the blocks' attributes: bit for bit as found, whether the check
    succeeds or the loss raises at micro-batch 5."""
    options = RESTLESS_PATHS[path]

    def loss_fn(out, label):
        np.random.rand(3)
        random.random()
        if fails is not None and _index(label) == 5 and (fails == "the passes") == (out.dtype == np.float32):
            raise ValueError("micro-batch 5 is bad")
        return L2(out, label)

    net = _restless()
    random.seed(1)
    np.random.seed(1)
    before = _everything(net)
    if fails is None:
        report = accumcheck.mxnet.check(net, loss_fn, RESTLESS_BATCHES, **options)
        assert report.exit_code == 0
    else:
        copy = " on the float64 copy" if fails == "the float64 pass" else ""
        with pytest.raises(accumcheck.UserCodeError, match=f"loss_fn{copy} raised ValueError on micro-batch 5"):
            accumcheck.mxnet.check(net, loss_fn, RESTLESS_BATCHES, **options)
    _assert_everything_as_found(before, _everything(net))


@pytest.mark.parametrize("edit", ["data()[:] +=", "set_data"])
@pytest.mark.parametrize("at", [0, 5])
def test_a_step_that_edits_the_weights_is_refused_and_they_are_put_back(edit, at):
    def step(block, batch):
        np.random.rand()
        random.random()
        if _index(batch[1]) == at:
            with autograd.pause():
                weight = block.dense.weight
                if edit == "set_data":
                    weight.set_data(weight.data() * 2)
                else:
                    weight.data()[:] += 1
        return L2(block(batch[0]), batch[1])

    net = _restless()
    before = _everything(net)
    with pytest.raises(accumcheck.UserCodeError, match=r"the weights changed while the check ran "
                                                       r"\(restless_dense0_weight\): your step edits them"):
        accumcheck.mxnet.check(net, batches=RESTLESS_BATCHES, step=step)
    _assert_everything_as_found(before, _everything(net))


def test_a_step_that_edits_an_average_without_a_gradient_passes_and_it_is_put_back():
    """A grad_req='null' Parameter (an average, BatchNorm's statistics) the user's step moves in
    place does not change the gradients: the check passes, and the values come back."""
    def step(block, batch):
        with autograd.pause():
            block.average.data()[:] += 1
            block.norm.running_mean.data()[:] += 1
        return L2(block(batch[0]), batch[1])

    net = _restless()
    before = _everything(net)
    assert accumcheck.mxnet.check(net, batches=RESTLESS_BATCHES, step=step).exit_code == 0
    _assert_everything_as_found(before, _everything(net))


def _backward_in_step(block, batch):
    loss = L2(block(batch[0]), batch[1])
    loss.backward()
    return loss


def _backward_retained(block, batch):
    loss = L2(block(batch[0]), batch[1])
    loss.backward(retain_graph=True)
    return loss


def _backward_in_loss(out, label):
    loss = L2(out, label)
    loss.backward()
    return loss


@pytest.mark.parametrize("how", ["step", "step, graph retained", "loss_fn", "deferred block"])
def test_a_loss_or_step_that_calls_backward_itself_is_refused_with_the_fix(how):
    """Native would count the user's backward and accumcheck's (2x), manual only the last: a
    finding about the user's call, not the accumulation. Refused before anything is judged."""
    net = _restless()
    if how == "deferred block":
        net = gluon.nn.Dense(2)  # its first call, which the check makes without recording, initialises it
        net.initialize()
    before = _state(net)
    kwargs = {"loss_fn": _backward_in_loss} if how == "loss_fn" else \
        {"step": _backward_retained if "retained" in how else _backward_in_step}
    with pytest.raises(accumcheck.UserCodeError) as excinfo:
        accumcheck.mxnet.check(net, batches=RESTLESS_BATCHES, **kwargs)
    _one_line(excinfo, "backward() ", "micro-batch 0", "return the loss; accumcheck calls backward itself")
    _assert_same_state(before, _state(net))
