"""Gradient diagnostics: clipping drop-in, layer statistics in TensorBoard, dominance report."""

import logging

import numpy as np
import pytest

from accumcheck.diagnostics import layer_groups, layer_norms, select_layers
from accumcheck.errors import AccumcheckError

torch = pytest.importorskip("torch")
from simulated_device import SimulatedDevice  # noqa: E402

from accumcheck.torch import diagnostics as diagnostics_module  # noqa: E402
from accumcheck.torch.diagnostics import GradMonitor, dominance_report, named_parameters  # noqa: E402


def many_parameters(seed=0, scale=1.0):
    """300 parameters: 150 Linear layers in a Sequential, with gradients."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(150)])
    (model(torch.randn(4, 8)).pow(2).sum() * scale).backward()
    return model


class Blocks(torch.nn.Module):
    def __init__(self, n=6):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(n))
        self.head = torch.nn.Linear(16, 50)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def backward(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (4, 8), generator=gen)
    torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1)).backward()


# ----------------------------------------------------------------------------- layers


def test_layer_selection_defaults_to_blocks_0_1_middle_and_last_two():
    names = [n for n, _ in Blocks(12).named_parameters()]
    groups, blocks = layer_groups(names)
    assert blocks == [f"layers.{i}" for i in range(12)]
    assert select_layers(names) == ["layers.0", "layers.1", "layers.6", "layers.10", "layers.11"]
    assert select_layers(names, [0, -1]) == ["layers.0", "layers.11"]
    assert select_layers(names, "head*,embed*") == ["embed", "head"]
    assert select_layers(names, "all")[0] == "embed" and len(select_layers(names, "all")) == 14
    with pytest.raises(AccumcheckError, match="out of range for 12"):
        select_layers(names, [12])
    with pytest.raises(AccumcheckError, match="no layer matches"):
        select_layers(names, "nothing*")


def test_layer_norms_of_host_gradients():
    norms = layer_norms(["a.w", "a.b", "b.w"], [np.full(4, 1.0), np.full(5, 0.0), np.full(9, 1.0)])
    assert norms == {"a": 2.0, "b": 3.0}


def test_names_from_plain_parameters_and_param_groups():
    model = Blocks(2)
    plain = named_parameters(model.parameters())
    assert [n for n, _ in plain][:2] == ["0", "1"]
    groups = [{"params": list(model.layers.parameters()), "name": "blocks"},
              {"params": list(model.head.parameters()), "param_names": ["head.weight", "head.bias"]}]
    assert [n for n, _ in named_parameters(groups)] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3",
                                                        "head.weight", "head.bias"]


# ----------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("max_norm", [1e3, 1.0, 1e-4])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_is_bit_for_bit_torch_clip_grad_norm(max_norm, norm_type):
    ours, theirs = many_parameters(), many_parameters()
    assert len(list(ours.parameters())) == 300
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
    monitor = GradMonitor(ours)
    total = monitor.clip_grad_norm_(max_norm, norm_type)
    assert torch.equal(total, expected)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert monitor.last_norms.shape == (300,)
    assert torch.allclose(torch.linalg.vector_norm(monitor.last_norms, norm_type), total)


def test_clip_with_some_gradients_missing_and_error_if_nonfinite():
    ours, theirs = many_parameters(), many_parameters()
    for model in (ours, theirs):
        model[3].weight.grad = None
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    monitor = GradMonitor(ours)
    assert torch.equal(monitor.clip_grad_norm_(0.5), expected)
    assert monitor.last_norms[6] == 0  # 3.weight
    ours[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        monitor.clip_grad_norm_(0.5, error_if_nonfinite=True)


# ----------------------------------------------------------------------------- TensorBoard


def test_event_files_hold_the_layer_statistics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = Blocks(6)
    writer = SummaryWriter(str(tmp_path))
    monitor = GradMonitor(model, writer=writer, log_every=2)
    expected = {}
    for step in range(5):
        model.zero_grad()
        backward(model, seed=step)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        monitor.clip_grad_norm_(1e9)  # no clipping: the logged values are the raw gradients
        if step % 2 == 0:
            layer = [grads["layers.0.weight"], grads["layers.0.bias"]]
            expected[step] = (float(torch.sqrt(sum(g.double().pow(2).sum() for g in layer))),
                              float(min(g.min() for g in layer)), float(max(g.max() for g in layer)))
    monitor.flush()
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for layer in ("layers.0", "layers.1", "layers.3", "layers.4", "layers.5"):
        for stat in ("grad_norm", "grad_min", "grad_max", "grad_absmax", "grad_share"):
            assert f"{stat}/{layer}" in tags
    norms = {e.step: e.value for e in events.Scalars("grad_norm/layers.0")}
    assert sorted(norms) == [0, 2, 4]
    for step, (norm, low, high) in expected.items():
        assert norms[step] == pytest.approx(norm, rel=1e-5)
        assert events.Scalars("grad_min/layers.0")[step // 2].value == pytest.approx(low, rel=1e-6)
        assert events.Scalars("grad_max/layers.0")[step // 2].value == pytest.approx(high, rel=1e-6)


def test_a_log_directory_gets_every_step_when_the_monitor_closes(tmp_path):
    """writer= a folder: the monitor makes the writer, and close() (here the with-block's end)
    writes the steps still waiting in a batch, then closes it; nothing is lost."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = Blocks(6)
    with GradMonitor(model, writer=tmp_path / "runs", log_every=1) as monitor:
        for step in range(7):  # fewer than WRITE_EVERY: all of them wait for close()
            model.zero_grad()
            backward(model, seed=step)
            monitor.clip_grad_norm_(1e9)
    assert monitor.writer is not None and monitor._owns_writer
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert [e.step for e in events.Scalars("grad_norm/layers.0")] == list(range(7))


def test_on_demand_window_logs_every_step(tmp_path):
    class Recorder:
        def __init__(self):
            self.steps = set()

        def add_scalar(self, tag, value, step):
            self.steps.add(step)

    model = Blocks(2)
    recorder = Recorder()
    monitor = GradMonitor(model, writer=recorder, log_every=1000)
    for step in range(8):
        if step == 3:
            monitor.enable(steps=3)
        backward(model)
        monitor.clip_grad_norm_(1e9)
    monitor.flush()
    assert recorder.steps == {0, 3, 4, 5}


# ----------------------------------------------------------------------------- dominance


def test_a_huge_gradient_is_named_first_with_most_of_the_norm(caplog):
    model = Blocks(6)
    backward(model)
    model.layers[4].weight.grad.mul_(1e4)
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    monitor = GradMonitor(model, clip_threshold=0.1)
    with caplog.at_level(logging.WARNING, logger="accumcheck.diagnostics"):
        monitor.clip_grad_norm_(1.0)
        reports = monitor.flush()
    assert len(reports) == 1
    first = reports[0].entries[0]
    assert first.name == "layers.4.weight" and first.share > 0.9
    # the share is of the sum of squares, the norms those of the gradients before clipping
    norms = {n: np.linalg.norm(g.astype(np.float64)) for n, g in grads.items()}
    total = sum(v**2 for v in norms.values())
    for entry in reports[0].entries:
        assert entry.norm == pytest.approx(norms[entry.name], rel=1e-6)
        assert entry.share == pytest.approx(norms[entry.name] ** 2 / total, rel=1e-5)
    assert reports[0].total_norm == pytest.approx(np.sqrt(total), rel=1e-6)
    assert "clipping scale" in reports[0].reason
    assert "layers.4.weight" in caplog.text


def test_non_finite_gradients_are_reported_not_crashed_on():
    model = Blocks(3)
    backward(model)
    model.layers[1].bias.grad[2] = float("inf")
    monitor = GradMonitor(model)
    monitor.clip_grad_norm_(1.0)
    report = monitor.flush()[0]
    assert report.reason == "non-finite gradient norm"
    assert report.entries[0].name == "layers.1.bias"
    assert report.entries[0].nonfinite == 1 and report.entries[0].largest_index == [2]


def test_normal_steps_report_nothing_and_the_function_works_alone():
    model = Blocks(3)
    backward(model)
    monitor = GradMonitor(model)
    monitor.clip_grad_norm_(1e9)
    assert monitor.flush() == []
    names = [n for n, _ in model.named_parameters()]
    report = dominance_report(names, list(model.parameters()), top_k=3)
    assert len(report.entries) == 3 and sum(e.share for e in report.entries) <= 1.0


class Scalars:
    def __init__(self):
        self.values = []

    def add_scalar(self, tag, value, step):
        self.values.append((tag, value, step))


class DeviceHostCopy(diagnostics_module._HostCopy):
    """The CUDA path's transfer for the simulated device: a non-blocking copy, read on arrival."""

    def __init__(self, tensor, payload):
        self.payload, self.event = payload, None
        self.host = tensor.to("cpu", non_blocking=True)


def monitored_steps(monkeypatch, steps=12, **monitor_options):
    """GradMonitor.clip_grad_norm_ over gradients on the simulated device, step by step; yields
    (the device, the monitor, the step's host reads, the gradients torch clips on the CPU)."""
    monkeypatch.setattr(diagnostics_module, "_HostCopy", DeviceHostCopy)
    model = Blocks(6)
    device = SimulatedDevice()
    with device.active():
        params = [(n, device.put(p.detach().clone()).requires_grad_()) for n, p in model.named_parameters()]
    monitor = GradMonitor(params, **monitor_options)
    for step in range(steps):
        model.zero_grad()
        backward(model, seed=step)
        for (_, twin), p in zip(params, model.parameters()):
            twin.grad = device.put(p.grad.clone())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        device.reads.clear()
        with device.active():
            monitor.clip_grad_norm_(0.5)
        yield device, monitor, list(device.reads), [p.grad for p in model.parameters()], params


@pytest.mark.parametrize("options", [dict(writer=None), dict(writer=Scalars(), log_every=1)],
                         ids=["no-writer", "statistics-every-step"])
def test_normal_steps_never_read_a_device_value_on_the_host(monkeypatch, options):
    """Every operator that reads a device value on the host is seen (see simulated_device.py);
    a normal step, with or without per-layer statistics, has none."""
    for step, (device, monitor, reads, clipped, params) in enumerate(monitored_steps(monkeypatch, **options)):
        assert reads == [], f"step {step}: {reads}"
        for (name, twin), expected in zip(params, clipped):  # the simulated device computed the real clip
            assert torch.equal(device.values(twin.grad), expected), name
    assert monitor.reports == []
    if options["writer"] is not None:
        monitor.flush()  # the statistics wait on the host and reach the writer in batches
        assert len({step for _, _, step in options["writer"].values}) == 12


HOST_READS = {
    "float()": lambda t: float(t),
    "bool()": lambda t: bool(t > 0),
    ".item()": lambda t: t.item(),
    ".tolist()": lambda t: t.tolist(),
    '.to("cpu")': lambda t: t.to("cpu"),
    ".cpu()": lambda t: t.cpu(),
    ".numpy()": lambda t: t.numpy(),
    "if t:": lambda t: 1 if t else 0,
}


@pytest.mark.parametrize("read", HOST_READS, ids=list(HOST_READS))
def test_the_host_read_detector_sees_each_kind_of_read(monkeypatch, read):
    """Negative control: one host read of the total norm slipped into the normal step is caught
    (recorded, or refused outright for .numpy())."""
    original = diagnostics_module.grad_norms

    def reading(*args, **kwargs):
        norms, total = original(*args, **kwargs)
        HOST_READS[read](total)
        return norms, total

    monkeypatch.setattr(diagnostics_module, "grad_norms", reading)
    try:
        _, _, reads, _, _ = next(monitored_steps(monkeypatch, writer=None))
    except TypeError as refused:  # a meta tensor cannot become a numpy array
        assert "numpy" in str(refused)
        return
    assert reads, f"{read} in the normal step went unseen"


@pytest.mark.gpu
def test_normal_steps_pass_sync_debug_mode_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    model = Blocks(6).cuda()
    monitor = GradMonitor(model)
    backward_cuda = lambda: torch.nn.functional.cross_entropy(  # noqa: E731
        model(torch.randint(0, 50, (4, 8), device="cuda")).reshape(-1, 50),
        torch.randint(0, 50, (32,), device="cuda")).backward()
    backward_cuda()
    monitor.clip_grad_norm_(1e9)  # warm-up: first calls may allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            model.zero_grad()
            backward_cuda()
            monitor.clip_grad_norm_(1e9)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_mxnet_statistics_and_dominance():
    mx = pytest.importorskip("mxnet")
    from mxnet import gluon

    from accumcheck.mxnet.diagnostics import clip_global_norm, layer_stats
    from accumcheck.mxnet.diagnostics import dominance_report as mx_report

    net = gluon.nn.HybridSequential()
    for _ in range(6):
        net.add(gluon.nn.Dense(8))
    net.initialize(mx.init.Xavier())
    with mx.autograd.record():
        loss = net(mx.nd.random.normal(shape=(4, 8))).sum()
    loss.backward()
    params = net.collect_params()
    names = list(params.keys())
    params[names[4]].grad()[:] *= 1e4  # dense2_weight
    grads = {n: p.grad().asnumpy().astype(np.float64) for n, p in params.items()}
    total, norms = clip_global_norm(params, max_norm=1.0)
    expected_total = np.sqrt(sum((g**2).sum() for g in grads.values()))
    assert float(total.asscalar()) == pytest.approx(expected_total, rel=1e-5)
    scaled = params[names[4]].grad().asnumpy()
    assert np.allclose(scaled, grads[names[4]] / (expected_total + 1e-6), rtol=1e-5)
    stats = layer_stats(params, norms, total)
    layers = list(dict.fromkeys(name.rsplit("_", 1)[0] for name in names))  # Gluon numbers them process-wide
    assert list(stats) == [layers[i] for i in (0, 1, 3, 4, 5)]  # 0, 1, n//2, -2, -1
    report = mx_report(params, norms)
    assert report.entries[0].name == names[4] and report.entries[0].share > 0.9
    params[names[1]].grad()[0] = float("nan")
    assert mx_report(params).entries[0].name == names[1]


def test_mxnet_statistics_reach_tensorboard_and_gradient_lists_clip(tmp_path):
    mx = pytest.importorskip("mxnet")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from accumcheck.diagnostics.tensorboard import ScalarWriter
    from accumcheck.mxnet.diagnostics import clip_global_norm, layer_stats, log_stats

    grads = [mx.nd.full((3, 3), 2.0), mx.nd.full((4,), 1.0)]
    total, norms = clip_global_norm(grads, max_norm=1.0)
    assert float(total.asscalar()) == pytest.approx(np.sqrt(9 * 4 + 4))
    assert float(grads[1].asnumpy()[0]) == pytest.approx(1 / np.sqrt(40), rel=1e-5)
    net = mx.gluon.nn.HybridSequential()
    for _ in range(3):
        net.add(mx.gluon.nn.Dense(4))
    net.initialize()
    with mx.autograd.record():
        loss = net(mx.nd.ones((2, 4))).sum()
    loss.backward()
    writer = ScalarWriter(str(tmp_path))
    stats = layer_stats(net.collect_params())
    log_stats(writer, stats, step=7)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    first, last = list(stats)[0], list(stats)[-1]  # Gluon numbers layers globally: dense0.. or dense6..
    assert len(stats) == 3 and first.startswith("dense")
    assert {f"grad_norm/{first}", f"grad_share/{last}", f"grad_absmax/{first}"} <= set(events.Tags()["scalars"])
    assert events.Scalars(f"grad_norm/{first}")[0].step == 7
    assert events.Scalars(f"grad_norm/{first}")[0].value == pytest.approx(stats[first]["norm"], rel=1e-6)


def test_the_divergence_example_names_the_dominating_parameter(capsys, caplog):
    from accumcheck.torch.examples import diverge

    with caplog.at_level(logging.WARNING, logger="accumcheck.diagnostics"):
        assert diverge.main(["--steps", "48", "--spike-at", "40"]) == 0
    out = capsys.readouterr().out
    assert "learning rate spiked" in out
    last = out.strip().splitlines()[-1]
    assert "dominance report(s); first: " in last and not last.endswith("none")
    assert "dominated by:" in caplog.text and "below 0.1" in caplog.text
    assert "step 39:" not in caplog.text  # nothing fired before the spike


def test_compare_logs_both_modes_layer_norms(tmp_path):
    from conftest import run_cli
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_cli("compare", "--case", "transformer-small", "--accum-steps", "4", "--inject", "scale",
                     "--grad-norms", str(tmp_path))
    assert result.returncode == 1
    assert "of the whole gradient's sum of squares" in result.stdout  # the flagged tensor's share
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"grad_norm_native/embed", "grad_norm_manual/embed", "grad_norm_native/block0"} <= tags
    native = events.Scalars("grad_norm_native/embed")[0]
    manual = events.Scalars("grad_norm_manual/embed")[0]
    assert native.step == 4 and native.value != manual.value  # the injected fault shows in the norm


@pytest.mark.parametrize("argument, message", [
    ({"log_every": 0}, "GradMonitor: log_every=0 is not a positive integer"),
    ({"log_every": -5}, "GradMonitor: log_every=-5 is not a positive integer"),
    ({"log_every": 2.5}, "GradMonitor: log_every=2.5 is not a positive integer"),
    ({"top_k": 0}, "GradMonitor: top_k=0 is not a positive integer"),
    ({"clip_threshold": 0}, "GradMonitor: clip_threshold=0 is not a positive number"),
    ({"clip_threshold": float("nan")}, "GradMonitor: clip_threshold=nan is not a positive number"),
])
def test_bad_arguments_are_refused_when_the_monitor_is_made(argument, message):
    """Not mid-training: log_every=0 used to pass, then divide by zero at the first step."""
    with pytest.raises(AccumcheckError) as info:
        GradMonitor(Blocks(), **argument)
    assert str(info.value).startswith(message), info.value


@pytest.mark.parametrize("steps", [0, -1, 1.5])
def test_a_window_of_no_steps_is_refused_as_gluons_monitor_refuses_it(steps):
    """enable(0) used to pass here and open a window that ended before it began."""
    monitor = GradMonitor(Blocks())
    with pytest.raises(AccumcheckError, match=f"^GradMonitor: steps={steps!r} is not a positive integer"):
        monitor.enable(steps)
    assert monitor.window_end == -1


def test_a_model_with_nothing_to_watch_is_refused_when_the_monitor_is_made():
    model = Blocks().requires_grad_(False)
    with pytest.raises(AccumcheckError, match="^GradMonitor: no parameter requires grad"):
        GradMonitor(model)


def test_the_monitor_takes_the_usual_arguments_as_they_are():
    monitor = GradMonitor(Blocks(), log_every=3, top_k=2, clip_threshold=0.5)
    assert (monitor.log_every, monitor.top_k, monitor.clip_threshold) == (3, 2, 0.5)
