"""A training loop over an FSDP2 model (``fully_shard`` on a CPU device mesh of 2, gloo), checked by
accumcheck.torch.AccumulationCheck: the gradient sync skipped on all but a window's last micro-step
(``set_requires_gradient_sync``), the loss divided by the N micro-steps, clipping, AdamW.

    torchrun --nproc_per_node 2 examples/fsdp2_loop.py               # faithful in float32, exit code 0
    torchrun --nproc_per_node 2 examples/fsdp2_loop.py --bf16-reduce # MixedPrecisionPolicy(reduce_dtype=
                                                                     # bfloat16): precision lost in the
                                                                     # reduction, exit code 1

A small MLP language model (embedding, two residual blocks, a head), each block and the root
sharded; 4 sequences of 16 tokens per micro-batch on each rank, N = 4. Every rank runs the check
(the sharded gradient the optimizer applies is gathered and judged against every rank's
micro-batches as one batch, on an unsharded float64 copy); rank 0 prints the report.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from accumcheck.render import render
from accumcheck.torch import AccumulationCheck

N, VOCAB, WIDTH = 4, 64, 32


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up, self.down = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if "--bf16-reduce" in argv else None)
    torch.manual_seed(0)  # the same weights on every rank before sharding
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data
    batches = [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, VOCAB, (4, 17), generator=data))
               for _ in range(2 * N)]

    # the loss of a window as one batch: the model's mean cross-entropy, before the loop's 1/N
    check = AccumulationCheck(model, optimizer, step=lambda m, batch: m(*batch))
    with check:
        for micro_step, (x, y) in enumerate(check.batches(batches)):
            last = (micro_step + 1) % N == 0
            model.set_requires_gradient_sync(last)
            (model(x, y) / N).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
    report = check.report  # a collective: every rank reads it
    if rank == 0:
        print(render(report, "table"))
    dist.destroy_process_group()
    return report.exit_code


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
