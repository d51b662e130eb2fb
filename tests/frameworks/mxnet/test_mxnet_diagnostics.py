"""Gluon's GradMonitor: the PyTorch monitor's TensorBoard tags, statistics equal to numpy's, the
dominance report under a huge gradient (and none under normal ones), no engine wait in a step,
and the user's parameters and gradients left as found but for the clipping asked for."""

import logging
import threading

import numpy as np
import pytest

from accumcheck.errors import AccumcheckError

mx = pytest.importorskip("mxnet", reason="mxnet is not installed (pip install 'accumcheck[mxnet]')")
from mxnet import autograd, gluon  # noqa: E402

import accumcheck.mxnet  # noqa: E402
from accumcheck.mxnet import GradMonitor  # noqa: E402
from accumcheck.mxnet import diagnostics as diagnostics_module  # noqa: E402

VOCAB, WIDTH = 50, 16


def blocks(n=6, seed=0):
    """Embedding, n tanh Dense blocks and a head, named as the PyTorch test's Blocks model
    (embed.weight, layers.0.weight, ..., head.bias)."""
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential(prefix="")
    net.add(gluon.nn.Embedding(VOCAB, WIDTH, prefix="embed."))
    for i in range(n):
        net.add(gluon.nn.Dense(WIDTH, in_units=WIDTH, activation="tanh", flatten=False, prefix=f"layers.{i}."))
    net.add(gluon.nn.Dense(VOCAB, in_units=WIDTH, flatten=False, prefix="head."))
    net.initialize(mx.init.Xavier())
    return net


def backward(net, seed=0):
    x = mx.nd.array(np.random.RandomState(seed).randint(0, VOCAB, (4, 8)))
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x).reshape((-1, VOCAB)), x.reshape((-1,))).mean()
    loss.backward()


def host_grads(net):
    return {n: p.grad().asnumpy().astype(np.float64) for n, p in net.collect_params().items() if p.grad_req != "null"}


class Recorder:
    def __init__(self):
        self.values = {}

    def add_scalar(self, tag, value, step):
        self.values[(tag, step)] = value


def events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return accumulator


# ----------------------------------------------------------------------------- TensorBoard


def test_the_tags_are_the_pytorch_monitors_on_the_same_model(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.tensorboard import SummaryWriter

    from accumcheck.torch.diagnostics import GradMonitor as TorchMonitor

    class Blocks(torch.nn.Module):
        def __init__(self, n=6):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, WIDTH)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(n))
            self.head = torch.nn.Linear(WIDTH, VOCAB)

    model = Blocks()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    writer = SummaryWriter(str(tmp_path / "torch"))
    theirs = TorchMonitor(model, writer=writer, log_every=2)
    net = blocks()
    ours = GradMonitor(net, writer=str(tmp_path / "gluon"), log_every=2)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(ours.names)  # the same model
    for step in range(5):
        backward(net, seed=step)
        ours.clip_global_norm(1e9)
        theirs.clip_grad_norm_(1e9)
    ours.close()
    theirs.flush()
    writer.close()
    gluon_events, torch_events = events(tmp_path / "gluon"), events(tmp_path / "torch")
    tags = set(gluon_events.Tags()["scalars"])
    assert tags == set(torch_events.Tags()["scalars"])
    assert "grad_norm/layers.0" in tags and "grad_share/layers.5" in tags and len(tags) == 5 * 5
    assert [e.step for e in gluon_events.Scalars("grad_absmax/layers.3")] == [0, 2, 4]


@pytest.mark.parametrize("where", ["host", "engine"])
def test_the_statistics_are_numpys_from_the_gradients(monkeypatch, where):
    """Minima and maxima of CPU gradients come from numpy in HostCopy; of others, from the engine."""
    if where == "engine":
        monkeypatch.setattr(GradMonitor, "_on_host", lambda self, grads, live: [])
    net = blocks(4)
    net[2].weight.grad_req = "null"  # frozen: not monitored, not clipped
    recorder = Recorder()
    monitor = GradMonitor(net, layers="all", writer=recorder, log_every=1)
    assert "layers.1.weight" not in monitor.names and "layers.1.bias" in monitor.names
    expected = {}
    for step in range(GradMonitor.WRITE_EVERY + 3):  # across a batch of writes
        backward(net, seed=step)
        grads = host_grads(net)
        total = np.sqrt(sum(np.square(g).sum() for g in grads.values()))
        for layer in ("embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"):
            layer_grads = [g for n, g in grads.items() if n.rsplit(".", 1)[0] == layer]
            norm = np.sqrt(sum(np.square(g).sum() for g in layer_grads))
            low, high = min(g.min() for g in layer_grads), max(g.max() for g in layer_grads)
            expected[step, layer] = {"grad_norm": norm, "grad_min": low, "grad_max": high,
                                     "grad_absmax": max(high, -low), "grad_share": norm**2 / total**2}
        monitor.clip_global_norm(0.5)
    monitor.flush()
    assert len(recorder.values) == len(expected) * 5
    for (step, layer), stats in expected.items():
        for tag, value in stats.items():
            assert recorder.values[f"{tag}/{layer}", step] == pytest.approx(value, rel=1e-5), (step, tag, layer)


def test_an_on_demand_window_logs_every_step():
    net, recorder = blocks(2), Recorder()
    monitor = GradMonitor(net, writer=recorder, log_every=1000)
    for step in range(8):
        if step == 3:
            monitor.enable(steps=3)
        backward(net, seed=step)
        monitor.clip_global_norm(1e9)
    monitor.flush()
    assert {step for _, step in recorder.values} == {0, 3, 4, 5}


# ----------------------------------------------------------------------------- dominance


def test_a_huge_gradient_is_named_first_with_most_of_the_norm(caplog):
    net = blocks()
    backward(net)
    net[5].weight.grad()[:] *= 1e4  # layers.4.weight
    grads = host_grads(net)
    monitor = GradMonitor(net, clip_threshold=0.1)
    with caplog.at_level(logging.WARNING, logger="accumcheck.diagnostics"):
        monitor.clip_global_norm(1.0)
        reports = monitor.flush()
    assert len(reports) == 1
    first = reports[0].entries[0]
    assert first.name == "layers.4.weight" and first.share > 0.9
    norms = {n: np.linalg.norm(g) for n, g in grads.items()}
    total = sum(v**2 for v in norms.values())
    for entry in reports[0].entries:
        assert entry.norm == pytest.approx(norms[entry.name], rel=1e-5)
        assert entry.share == pytest.approx(norms[entry.name] ** 2 / total, rel=1e-5)
    assert reports[0].total_norm == pytest.approx(np.sqrt(total), rel=1e-5)
    assert "clipping scale" in reports[0].reason and "layers.4.weight" in caplog.text


def test_normal_gradients_report_nothing_even_when_clipped_a_little():
    net = blocks()
    monitor = GradMonitor(net, clip_threshold=0.1)
    for step in range(5):
        backward(net, seed=step)
        total = float(np.sqrt(sum(np.square(g).sum() for g in host_grads(net).values())))
        monitor.clip_global_norm(total / 2 if step % 2 else 1e9)  # a scale of 0.5, or none
    assert monitor.flush() == []


def test_a_non_finite_gradient_is_reported_not_crashed_on():
    net = blocks(3)
    backward(net)
    net[2].bias.grad()[2] = float("inf")  # layers.1.bias
    monitor = GradMonitor(net)
    monitor.clip_global_norm(1.0)
    report = monitor.flush()[0]
    assert report.reason == "non-finite gradient norm"
    assert report.entries[0].name == "layers.1.bias" and report.entries[0].nonfinite == 1


# ----------------------------------------------------------------------------- no engine wait


WAITS = ("asnumpy", "asscalar", "wait_to_read")


@pytest.fixture
def host_reads(monkeypatch):
    """Every call in this thread that waits for the engine: an NDArray read on the host
    (float(), bool() and asscalar() go through asnumpy), wait_to_read, waitall."""
    seen, main = [], threading.get_ident()

    def counting(name, original):
        def wrapper(*args, **kwargs):
            if threading.get_ident() == main:  # not the engine's custom-operator thread
                seen.append(name)
            return original(*args, **kwargs)
        return wrapper

    for name in WAITS:
        monkeypatch.setattr(mx.nd.NDArray, name, counting(name, getattr(mx.nd.NDArray, name)))
    monkeypatch.setattr(mx.nd, "waitall", counting("waitall", mx.nd.waitall))
    return seen


def run_steps(net, monitor, reads, steps=12):
    """Per step: the engine waits the monitor's step made."""
    per_step = []
    for step in range(steps):
        backward(net, seed=step)
        del reads[:]
        monitor.clip_global_norm(0.5)
        per_step.append(list(reads))
    return per_step


@pytest.mark.parametrize("options", [dict(writer=None), dict(log_every=5), dict(log_every=1)],
                         ids=["no-writer", "statistics-every-5", "statistics-every-step"])
def test_a_step_never_waits_for_the_engine(host_reads, options):
    net = blocks()
    if "log_every" in options:
        options["writer"] = Recorder()
    monitor = GradMonitor(net, **options)
    per_step = run_steps(net, monitor, host_reads)
    assert per_step == [[]] * len(per_step)
    assert monitor.flush() == [] and monitor.step == 12
    if options["writer"] is not None:  # the statistics arrived all the same
        assert len({step for _, step in options["writer"].values}) == 12 // options["log_every"] + (
            options["log_every"] > 1)


def test_the_wait_detector_sees_a_host_read_in_the_step(host_reads, monkeypatch):
    """Negative control: the values read on the host at once (the naive way) are caught."""

    class Blocking(diagnostics_module.HostCopy):
        def __init__(self, array, payload, extremes=()):
            self.payload, self.now = payload, array.asnumpy()

        def ready(self):
            return True

        def values(self):
            return self.now

    monkeypatch.setattr(diagnostics_module, "HostCopy", Blocking)
    net = blocks()
    assert all(reads == ["asnumpy"] for reads in run_steps(net, GradMonitor(net), host_reads, steps=3))


# ----------------------------------------------------------------------------- the user's values


def test_parameters_and_gradients_are_left_as_found_but_for_the_clipping():
    net = blocks()
    net[1].weight.grad_req = "null"
    backward(net)
    params = net.collect_params()
    data = {n: p.data().asnumpy().copy() for n, p in params.items()}
    grads = host_grads(net)
    requests = {n: p.grad_req for n, p in params.items()}
    monitor = GradMonitor(net, writer=Recorder(), log_every=1)
    monitor.clip_global_norm(1e9)  # no clipping: every gradient bit for bit as it was
    monitor.flush()
    assert all(np.array_equal(p.grad().asnumpy(), grads[n]) for n, p in params.items() if p.grad_req != "null")
    total = monitor.clip_global_norm(1.0)  # clipping: by Gluon's own scale
    monitor.flush()
    theirs = blocks()
    theirs[1].weight.grad_req = "null"
    backward(theirs)
    expected = gluon.utils.clip_global_norm([p.grad() for p in theirs.collect_params().values()
                                             if p.grad_req != "null"], 1.0, check_isfinite=False)
    assert float(total.asscalar()) == pytest.approx(float(expected.asscalar()), rel=1e-6)
    for (name, p), q in zip(params.items(), theirs.collect_params().values()):
        assert np.array_equal(p.data().asnumpy(), data[name]), name
        assert p.grad_req == requests[name]
        if p.grad_req != "null":
            np.testing.assert_allclose(p.grad().asnumpy(), q.grad().asnumpy(), rtol=1e-5, atol=1e-12)


def test_mixed_dtypes_and_a_parameter_frozen_later_give_numpys_norms():
    params = [gluon.Parameter(f"p{i}_weight", shape=(3, 4), dtype=dtype) for i, dtype in
              enumerate(["float32", "float16", "float32", "float64"])]
    rng = np.random.RandomState(0)
    for p in params:
        p.initialize()
        p.grad()[:] = rng.normal(size=(3, 4))
    monitor = GradMonitor(params, layers="all", writer=Recorder(), log_every=1)
    expected = [np.linalg.norm(p.grad().asnumpy().astype(np.float64)) for p in params]
    monitor.clip_global_norm(1e9)
    np.testing.assert_allclose(monitor.last_norms.asnumpy(), expected, rtol=1e-3)  # float16's rounding
    params[1].grad_req = "null"
    monitor.clip_global_norm(1e9)
    np.testing.assert_allclose(monitor.last_norms.asnumpy(), [expected[0], 0, expected[2], expected[3]], rtol=1e-6)
    assert monitor.flush() == []


def test_the_public_paths_and_the_pytorch_name_of_the_clip():
    assert accumcheck.mxnet.GradMonitor is GradMonitor
    net = blocks(2)
    backward(net)
    total = GradMonitor(net).clip_grad_norm_(1e9)
    assert float(total.asscalar()) == pytest.approx(np.sqrt(sum(np.square(g).sum() for g in host_grads(net).values())))


def test_gluons_blocking_check_is_there_when_asked_for():
    net = blocks(2)
    backward(net)
    net[1].bias.grad()[0] = float("nan")
    with pytest.warns(UserWarning, match="nan or inf"):
        assert np.isnan(GradMonitor(net).clip_global_norm(1.0, check_isfinite=True))


@pytest.mark.parametrize("argument, message", [
    ({"log_every": 0}, "GradMonitor: log_every=0 is not a positive integer"),
    ({"top_k": 0}, "GradMonitor: top_k=0 is not a positive integer"),
    ({"clip_threshold": 0}, "GradMonitor: clip_threshold=0 is not a positive number"),
    ({"layers": "nothing*"}, "layers: no layer matches 'nothing*'"),
])
def test_bad_arguments_are_refused_when_the_monitor_is_made(argument, message):
    with pytest.raises(AccumcheckError) as info:
        GradMonitor(blocks(2), **argument)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), info.value


def test_bad_sources_and_calls_are_refused_in_one_line():
    net = blocks(2)
    backward(net)
    refusals = []
    for call in (lambda: GradMonitor([p.grad() for p in net.collect_params().values()]),
                 lambda: GradMonitor([]),
                 lambda: GradMonitor(net).clip_global_norm(-1.0),
                 lambda: GradMonitor(net).clip_grad_norm_(1.0, norm_type=1)):
        with pytest.raises(AccumcheckError) as info:
            call()
        refusals.append(str(info.value))
    assert all(r.startswith("GradMonitor") and "\n" not in r for r in refusals), refusals
    assert "is not a Gluon Parameter" in refusals[0] and "no parameter has a gradient" in refusals[1]
    assert "max_norm=-1.0 is not a positive number" in refusals[2] and "L2 norm only" in refusals[3]


def test_parameters_on_two_contexts_need_ctx():
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    for ctx in (mx.cpu(0), mx.cpu(1)):
        with autograd.record():
            out = net(mx.nd.ones((2, 4), ctx=ctx)).sum()
        out.backward()
    with pytest.raises(AccumcheckError, match="on 2 contexts; pass ctx="):
        GradMonitor(net).clip_global_norm(1.0)
    expected = np.sqrt(sum(np.square(p.grad(mx.cpu(1)).asnumpy()).sum() for p in net.collect_params().values()))
    total = GradMonitor(net, ctx=mx.cpu(1)).clip_global_norm(1e9)
    assert float(total.asscalar()) == pytest.approx(expected, rel=1e-6)
