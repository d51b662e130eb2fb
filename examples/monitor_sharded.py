"""Gradient diagnostics on an FSDP2 model: per-layer gradient norms, minima and maxima to TensorBoard,
and the parameter that dominates the norm when clipping fires, from gradients sharded across ranks.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/monitor_sharded.py [LOGDIR]

Two ranks on the CPU (gloo), each holding its share of every parameter (``fully_shard`` per block
and at the root). ``GradMonitor(model, ...)`` sees the DTensor parameters: each rank computes its
shards' figures, one collective per step joins them, every rank clips by the global norm, and rank
0 alone writes the events (LOGDIR, default runs/monitor_sharded; ``tensorboard --logdir runs``).
At step 30 the gradient of one block's weight is multiplied by 1e4 (its value unchanged: a stand-in
for a layer whose gradient blows up); the dominance report names it, on every rank. At the end rank
0 prints the per-layer figures its TensorBoard events hold beside the same figures computed from
the whole gradients (gathered for this printout only: the monitor gathers no gradient whole).
Needs tensorboard (pip install 'accumcheck[diagnostics]').
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from accumcheck.torch import GradMonitor

STEPS, LOG_EVERY, SPIKE_STEP = 40, 10, 30


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.grad_scale = 1.0  # multiplies the gradient of this block's weight, not its value

    def forward(self, x):
        weight = self.linear.weight
        if self.grad_scale != 1.0:  # the same value, its gradient times grad_scale
            weight = weight * self.grad_scale - (weight * (self.grad_scale - 1.0)).detach()
        return x + torch.tanh(F.linear(x, weight, self.linear.bias))


class Net(torch.nn.Module):
    def __init__(self, width=32, depth=6):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def whole_figures(model, layers):
    """[norm, min, max] of each layer's whole gradient (an all-gather per parameter: for the printout)."""
    grads = {name: p.grad.full_tensor().reshape(-1) for name, p in model.named_parameters()}
    return {layer: [f(torch.cat([g for name, g in grads.items() if name.startswith(layer + ".")]))
                    for f in (lambda g: float(g.norm()), lambda g: float(g.min()), lambda g: float(g.max()))]
            for layer in layers}


def events(logdir):
    """The scalars in rank 0's event files: {(tag, step): value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = EventAccumulator(logdir, size_guidance={"scalars": 0})
    found.Reload()
    return {(tag, e.step): e.value for tag in found.Tags()["scalars"] for e in found.Scalars(tag)}


def main():
    logdir = sys.argv[1] if len(sys.argv) > 1 else "runs/monitor_sharded"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Every rank makes the monitor and calls it alike; rank 0 alone writes.
    monitor = GradMonitor(model, layers="0,n//2,-1", writer=logdir, log_every=LOG_EVERY)
    layers, whole = list(monitor.layers), {}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)  # the same global batch on every rank; each takes its rows
        x = torch.randn(16 * world, 8, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        model.blocks[2].grad_scale = 1e4 if step == SPIKE_STEP else 1.0
        loss = F.mse_loss(model(x[rank::world]), y[rank::world])
        loss.backward()
        if step % LOG_EVERY == 0:
            whole[step] = whole_figures(model, layers)  # before clipping, as the monitor logs them
        monitor.clip_grad_norm_(1.0)  # instead of torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()  # the last statistics written; the writer it made closed
    for report in monitor.reports:  # every rank has the same reports (each logged as a warning, too)
        name, share = report.entries[0].name, report.entries[0].share
        print(f"rank {rank}: step {report.step} clipped by {report.clip_coef:.3g}: {name} holds {share:.1%} "
              f"of the squared gradient norm {report.total_norm:.5g}", flush=True)
    dist.barrier()
    if rank == 0:
        logged = events(logdir)
        print(f"per-layer gradient figures in {logdir} (rank 0's events) | from the whole gradient")
        for step, figures in whole.items():
            for layer, reference in figures.items():
                mine = [logged[(f"{tag}/{layer}", step)] for tag in ("grad_norm", "grad_min", "grad_max")]
                print(f"step {step:2d} {layer:<9} norm {mine[0]:.7g} | {reference[0]:.7g}   "
                      f"min {mine[1]:.7g} | {reference[1]:.7g}   max {mine[2]:.7g} | {reference[2]:.7g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
