"""GradMonitor's per-layer statistics: computed from the clipping's own per-parameter norms and
one min/max pass, equal to the statistics computed directly from each layer's gradients (before
clipping), and written to a TensorBoard SummaryWriter as one event per step."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from accumcheck.torch.diagnostics import GradMonitor  # noqa: E402


class Blocks(torch.nn.Module):
    """Repeated blocks of unequal parameter counts (a LayerNorm in every other one), so that the
    layers' rows of the gathered matrices are padded."""

    def __init__(self, n=5):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 12)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(12, 12), *([torch.nn.LayerNorm(12)] if i % 2 else []))
            for i in range(n))
        self.head = torch.nn.Linear(12, 40)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def backward(model, seed):
    device = model.head.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(0, 40, (4, 6), generator=gen, device=device)
    (torch.nn.functional.cross_entropy(model(x).reshape(-1, 40), x.reshape(-1)) * 50).backward()


class Recorder:
    def __init__(self):
        self.values = {}

    def add_scalar(self, tag, value, step):
        self.values[(tag, step)] = value


def direct(monitor, grads, norm_type):
    """Each watched layer's statistics computed from its raw gradients, in float64."""
    names = monitor.names
    all_sq = sum(float(g.double().pow(2).sum()) for g in grads.values())
    out = {}
    for layer, indices in monitor.layers.items():
        zero = torch.zeros(1, dtype=torch.float64)
        flat = torch.cat([grads[names[i]].double().reshape(-1) if names[i] in grads else zero for i in indices])
        norm = float(torch.linalg.vector_norm(flat, norm_type))
        low, high = float(flat.min()), float(flat.max())
        out[layer] = {"grad_norm": norm, "grad_min": low, "grad_max": high,
                      "grad_absmax": max(abs(low), abs(high)),
                      "grad_share": float(flat.pow(2).sum()) / all_sq if norm_type == 2.0 else None}
    return out


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_layer_statistics_equal_those_computed_directly_before_clipping(norm_type):
    torch.manual_seed(0)
    model = Blocks()
    recorder = Recorder()
    monitor = GradMonitor(model, layers="all", writer=recorder, log_every=1)
    assert len({len(indices) for indices in monitor.layers.values()}) > 1  # rows of different lengths
    expected = {}
    for step in range(GradMonitor.WRITE_EVERY + 3):  # across a batch of writes
        model.zero_grad(set_to_none=True)
        backward(model, seed=step)
        if step == 2:
            model.layers[1][1].weight.grad = None  # a watched parameter without a gradient counts as zero
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        total = monitor.clip_grad_norm_(0.01, norm_type)  # clipping fires: the statistics are the raw gradients'
        assert float(total) > 0.1
        expected[step] = direct(monitor, grads, norm_type)
    monitor.flush()
    for step, layers in expected.items():
        for layer, stats in layers.items():
            for tag, value in stats.items():
                if value is not None:
                    assert recorder.values[(f"{tag}/{layer}", step)] == pytest.approx(value, rel=1e-5, abs=1e-12), \
                        (step, tag, layer)
    assert len(recorder.values) == len(expected) * len(monitor.layers) * len(GradMonitor.TAGS)


def test_statistics_wait_at_most_write_every_steps_and_not_after_a_report():
    torch.manual_seed(0)
    model = Blocks()
    recorder = Recorder()
    monitor = GradMonitor(model, writer=recorder, log_every=1)
    lag = GradMonitor.WRITE_EVERY
    for step in range(3 * lag):
        model.zero_grad()
        backward(model, seed=step)
        if step == 2 * lag + 3:
            model.layers[2][0].weight.grad.mul_(1e6)  # clipping fires hard: a dominance report
        monitor.clip_grad_norm_(1e3)
        written = {s for _, s in recorder.values}
        assert written == set(range(len(written)))  # in order, none skipped
        if step == 2 * lag + 3:
            assert len(monitor.reports) == 1 and written == set(range(step + 1))
        else:
            assert step + 2 - lag <= len(written) <= step + 1, step  # none waits WRITE_EVERY calls
    assert len(recorder.values) < 3 * lag * len(monitor.tags)
    monitor.flush()
    assert {s for _, s in recorder.values} == set(range(3 * lag))


def test_gradients_of_another_dtype_give_the_same_statistics():
    gen = torch.Generator().manual_seed(0)
    pairs = [(f"blocks.{i}.{kind}", torch.nn.Parameter(torch.zeros(5, dtype=dtype)))
             for i in range(3) for kind, dtype in (("weight", torch.float32), ("scale", torch.float16))]
    for _, p in pairs:
        p.grad = (torch.randn(5, generator=gen) * 3).to(p.dtype)
    grads = {n: p.grad.clone() for n, p in pairs}
    recorder = Recorder()
    monitor = GradMonitor(pairs, layers="all", writer=recorder, log_every=1)
    monitor.clip_grad_norm_(0.5)
    monitor.flush()
    for layer, stats in direct(monitor, grads, 2.0).items():
        for tag, value in stats.items():
            assert recorder.values[(f"{tag}/{layer}", 0)] == pytest.approx(value, rel=1e-3), (tag, layer)


def test_the_padding_of_short_layers_changes_no_statistic():
    """A short layer whose gradients are all positive (all negative) keeps its own minimum
    (maximum), whatever pads its row."""
    sizes = {"blocks.0": 3, "blocks.1": 1, "blocks.2": 2}
    signs = {"blocks.0": 1.0, "blocks.1": 1.0, "blocks.2": -1.0}
    pairs = [(f"{layer}.p{j}", torch.nn.Parameter(torch.zeros(4))) for layer, n in sizes.items() for j in range(n)]
    for k, (name, p) in enumerate(pairs):
        p.grad = signs[name.rsplit(".", 1)[0]] * torch.arange(1.0, 5.0) * (k + 1)
    grads = {n: p.grad.clone() for n, p in pairs}
    for norm_type in (2.0, -1.0):
        recorder = Recorder()
        monitor = GradMonitor(pairs, layers="all", writer=recorder, log_every=1)
        monitor.clip_grad_norm_(1e9, norm_type)
        monitor.flush()
        for layer, stats in direct(monitor, grads, norm_type).items():
            for tag, value in stats.items():
                if value is not None:
                    assert recorder.values[(f"{tag}/{layer}", 0)] == pytest.approx(value, rel=1e-5), (tag, layer)


def read_events(logdir):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        events += [e for e in EventFileLoader(str(path)).Load() if e.HasField("summary")]
    return events


def test_a_summary_writer_gets_every_step_as_one_event(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    model = Blocks()
    writer = SummaryWriter(str(tmp_path))
    recorder = Recorder()
    monitor = GradMonitor(model, writer=writer, log_every=1)
    twin = GradMonitor(model, writer=recorder, log_every=1)
    for step in range(6):
        model.zero_grad()
        backward(model, seed=step)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        monitor.clip_grad_norm_(1e9)
        for (_, p), g in zip(model.named_parameters(), grads.values()):
            p.grad = g
        twin.clip_grad_norm_(1e9)
    monitor.flush()
    twin.flush()
    writer.close()
    tags = [f"{tag}/{layer}" for layer in monitor.layers for tag in GradMonitor.TAGS]
    events = read_events(tmp_path)
    assert [e.step for e in events] == list(range(6))
    assert all([v.tag for v in e.summary.value] == tags for e in events)
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert set(accumulator.Tags()["scalars"]) == set(tags)
    for tag in tags:
        scalars = accumulator.Scalars(tag)
        assert [s.step for s in scalars] == list(range(6))
        for s in scalars:  # the values add_scalar would have written, one by one
            assert s.value == np.float32(recorder.values[(tag, s.step)])


def test_a_summary_writer_that_overrides_add_scalar_gets_add_scalar(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    class Counting(SummaryWriter):
        calls = 0

        def add_scalar(self, *args, **kwargs):
            Counting.calls += 1
            super().add_scalar(*args, **kwargs)

    model = Blocks()
    writer = Counting(str(tmp_path))
    monitor = GradMonitor(model, writer=writer, log_every=1)
    backward(model, seed=0)
    monitor.clip_grad_norm_(1.0)
    monitor.flush()
    writer.close()
    assert Counting.calls == len(monitor.layers) * len(GradMonitor.TAGS)
    assert len(read_events(tmp_path)) == Counting.calls


@pytest.mark.gpu
def test_statistics_every_step_pass_sync_debug_mode_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    torch.manual_seed(0)
    model = Blocks().cuda()
    recorder = Recorder()
    monitor = GradMonitor(model, writer=recorder, log_every=1)
    backward(model, seed=0)
    monitor.clip_grad_norm_(1e9)  # warm-up: the first logged step makes the gather plan
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 6):
            model.zero_grad()
            backward(model, seed=step)
            monitor.clip_grad_norm_(1e9)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    monitor.flush()
    assert {step for _, step in recorder.values} == set(range(6))
