"""One rank of the sharded GradMonitor tests (test_sharded_diagnostics.py), started by torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node 2 sharded_monitor_worker.py OUT_DIR SCENARIO ...

SCENARIOs: "fsdp2" (an FSDP2 model, fully_shard per layer and at the root, on a 1-D CPU mesh, gloo;
SGD), "zero1", "zero2" (a DeepSpeed engine, AdamW, gradient_accumulation_steps 2, the monitor
clipping: the engine's gradient_clipping 0 and compute_grad_norm false), "zero1:observe",
"zero2:observe" (the engine clips, gradient_clipping 1.0; the monitor observes). FSDP2 and DeepSpeed
scenarios go to separate runs (each initialises the process group its own way).

Each step the model's gradient is compared with an unsharded float64 copy of the model holding the
same weights (copied over before the step) on the same data, the whole global batch: the monitor's
per-parameter norms, total and clipping scale, the gradients after clipping, the collectives the
monitor's call ran (CommDebugMode) and the host reads it made. The last step multiplies one layer's
weight gradient by 1e4 (Layer.factor, in the model and its copy alike). Rank r writes
OUT_DIR/rank-R.json: by scenario, the steps, the dominance reports, and on rank 0 the TensorBoard
scalars read back from its log directory; both ranks list the event files under their own.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore")
STEPS, LOG_EVERY, SPIKE_LAYER, SPIKE = 6, 2, 1, 1e4
MICRO, GAS = 4, 2  # DeepSpeed: micro-batch size, gradient_accumulation_steps


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, factor):
        ctx.factor = factor
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class Layer(torch.nn.Linear):
    """A Linear whose weight gradient is multiplied by ``factor`` (1: untouched)."""

    factor = 1.0

    def forward(self, x):
        weight = self.weight if self.factor == 1.0 else ScaleGrad.apply(self.weight, self.factor)
        return F.linear(x, weight, self.bias)


class Net(torch.nn.Module):
    """Blocks layers.0-2 (16 x 16: 8 rows a rank), proj (5 x 16: 3 rows and 2) and head (1 x 5: one
    rank's FSDP2 shard is empty); the flat DeepSpeed partition splits a parameter between the ranks."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(16, 16) for _ in range(3))
        self.proj = Layer(16, 5)
        self.head = Layer(5, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(torch.tanh(self.proj(x)))


def data(step, rows):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 16, generator=gen), torch.randn(rows, 1, generator=gen)


def set_spike(model, on):
    for name, module in model.named_modules():
        if isinstance(module, Layer):
            module.factor = SPIKE if on and name == f"layers.{SPIKE_LAYER}" else 1.0


def reference_step(ref, x, y):
    """The float64 model's gradient on the whole global batch: per-parameter grads by name."""
    ref.zero_grad()
    F.mse_loss(ref(x.double()), y.double()).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def layer_figures(grads):
    """[norm, min, max] per layer (a parameter's name less its last part), from the float64 grads."""
    layers = {}
    for name, grad in grads.items():
        layers.setdefault(name.rsplit(".", 1)[0], []).append(grad.reshape(-1))
    return {k: [float(torch.cat(v).norm()), float(torch.cat(v).min()), float(torch.cat(v).max())]
            for k, v in layers.items()}


class HostReads:
    """Counts the tensor reads that would wait for a device (item, tolist, cpu, float, bool)."""

    NAMES = ("item", "tolist", "cpu", "__float__", "__bool__")

    def __enter__(self):
        self.count, self.saved = 0, {n: getattr(torch.Tensor, n) for n in self.NAMES}
        for name, original in self.saved.items():
            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def monitored_call(call):
    """``call()`` with the collectives it ran and its host reads counted."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm, HostReads() as reads:
        result = call()
    ops = {str(op).split("'")[1] if "'" in str(op) else str(op): n for op, n in comm.get_comm_counts().items()}
    return result, {"collectives": comm.get_total_counts(), "ops": ops, "host_reads": reads.count}


def tensorboard_scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def event_files(logdir):
    return sorted(str(p.relative_to(logdir)) for p in Path(logdir).rglob("events.out.tfevents.*")) \
        if Path(logdir).exists() else []


def record(monitor, grads, counts):
    """A step's comparison: the monitor's figures against the float64 gradient ``grads`` (by name),
    with what the monitor's call spent (``counts``)."""
    names = monitor.names
    ref_norms = [float(grads[n].norm()) for n in names]
    return {"norms": [float(v) for v in monitor.last_norms], "ref_norms": ref_norms,
            "total": float(monitor.last_total), "ref_total": math.sqrt(sum(v * v for v in ref_norms)),
            "coef": float(monitor.last_coef), "layers": layer_figures(grads), **counts, "engine_total": None}


def fsdp2(out, rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from accumcheck.torch import GradMonitor

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model).double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in [*model.layers, model.proj, model.head]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logdir = Path(out, "fsdp2", f"rank{rank}")
    monitor = GradMonitor(model, layers="all", writer=str(logdir), log_every=LOG_EVERY)
    world, steps = dist.get_world_size(), []
    torch_clip = None
    for step in range(STEPS):
        with torch.no_grad():  # the reference holds the model's weights (one all-gather each, outside the monitor)
            for (_, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
                r.copy_(p.full_tensor().double())
        spike = step == STEPS - 1
        set_spike(model, spike)
        set_spike(ref, spike)
        x, y = data(step, 4 * world)
        grads = reference_step(ref, x, y)
        F.mse_loss(model(x[rank::world]), y[rank::world]).backward()
        if step == 1:  # what torch's own clip_grad_norm_ spends on these DTensor gradients (max_norm: no clipping)
            _, torch_clip = monitored_call(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e30))
        _, counts = monitored_call(lambda: monitor.clip_grad_norm_(1.0))
        entry = record(monitor, grads, counts)
        coef = entry["coef"]
        entry["clipped_error"] = max(float((p.grad.full_tensor().double() - grads[n] * coef).abs().max()
                                           / (grads[n] * coef).abs().max().clamp_min(1e-30))
                                     for n, p in model.named_parameters())
        steps.append(entry)
        optimizer.step()
        optimizer.zero_grad()
    return finish(monitor, logdir, rank, steps, {"torch_clip": torch_clip, "writers": writers(model, rank)})


class Recorder:
    def __init__(self):
        self.tags = set()

    def add_scalar(self, tag, value, step):
        self.tags.add(tag)


def writers(model, rank):
    """A writer given to rank 0 alone (the other rank's monitor logs the same steps, writing nothing),
    and one given to rank 1 alone (refused on every rank)."""
    from accumcheck.errors import AccumcheckError
    from accumcheck.torch import GradMonitor

    alone = GradMonitor(model, writer=Recorder() if rank == 0 else None, log_every=1)
    F.mse_loss(model(torch.randn(4, 16)), torch.zeros(4, 1)).backward()
    alone.clip_grad_norm_(1.0)
    alone.flush()
    try:
        GradMonitor(model, writer=Recorder() if rank == 1 else None)
        refused = None
    except AccumcheckError as exc:
        refused = str(exc)
    return {"kind": type(alone.writer).__name__, "tags": len(getattr(alone.writer, "tags", ())), "refused": refused}


def zero(out, rank, stage, observe):
    import deepspeed

    from accumcheck.torch import GradMonitor

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model).double()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": stage, **({} if observe else {"compute_grad_norm": False})},
              "gradient_clipping": 1.0 if observe else 0.0, "zero_allow_untested_optimizer": True,
              "steps_per_print": 2 ** 31}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    name = f"zero{stage}" + (":observe" if observe else "")
    logdir = Path(out, name.replace(":", "-"), f"rank{rank}")
    monitor = GradMonitor(engine, layers="all", writer=str(logdir), log_every=LOG_EVERY)
    world, steps = dist.get_world_size(), []
    boundaries = 4
    for step in range(boundaries):
        with torch.no_grad():  # ZeRO-1/2: every rank holds the whole weights
            for (_, p), (_, r) in zip(engine.module.named_parameters(), ref.named_parameters()):
                r.copy_(p.double())
        spike = step == boundaries - 1
        set_spike(engine.module, spike)
        set_spike(ref, spike)
        x, y = data(step, MICRO * GAS * world)
        grads = reference_step(ref, x, y)
        for micro in range(GAS):  # engine.step() after each micro-batch: the engine steps at the boundary
            rows = slice((micro * world + rank) * MICRO, (micro * world + rank + 1) * MICRO)
            engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
            result, counts = monitored_call(monitor.observe if observe else lambda: monitor.clip_grad_norm_(1.0))
            if micro < GAS - 1:
                assert result is None
                off_boundary = counts
                engine.step()
        entry = record(monitor, grads, counts)
        entry["off_boundary"] = off_boundary
        if not observe:  # the engine's partitions after the monitor clipped them (a collective each, test only)
            from deepspeed.utils import safe_get_full_grad

            coef = entry["coef"]
            entry["clipped_error"] = max(float((safe_get_full_grad(p).double() - grads[n] * coef).abs().max()
                                               / (grads[n] * coef).abs().max().clamp_min(1e-30))
                                         for n, p in engine.module.named_parameters())
        engine.step()
        norm = engine.get_global_grad_norm()
        entry["engine_total"] = None if norm is None else float(norm)
        steps.append(entry)
    return finish(monitor, logdir, rank, steps, {"engine_clipping": engine.gradient_clipping()})


def finish(monitor, logdir, rank, steps, extra):
    monitor.close()
    result = {"steps": steps, "names": monitor.names, "files": event_files(logdir), **extra,
              "reports": [{"step": r.step, "total": r.total_norm, "coef": r.clip_coef,
                           "entries": [[e.name, e.share, e.norm] for e in r.entries]} for r in monitor.reports]}
    if rank == 0:
        result["scalars"] = tensorboard_scalars(logdir)
    return result


def main():
    out, scenarios = Path(sys.argv[1]), sys.argv[2:]
    if any(s.startswith("zero") for s in scenarios):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, results = dist.get_rank(), {}
    for scenario in scenarios:
        name, *options = scenario.split(":")
        if name == "fsdp2":
            results[scenario] = fsdp2(out, rank)
        else:
            results[scenario] = zero(out, rank, int(name[4:]), "observe" in options)
        Path(out, f"rank-{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    # The FSDP2 modules, their mesh and the engines hold the group through reference cycles: freed
    # here, before the group goes, not at interpreter shutdown, where gloo's teardown can abort.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
