"""A nanoGPT-style training loop under DistributedDataParallel, checked by
accumcheck.torch.AccumulationCheck: gradient sync only on a window's last micro-step
(``require_backward_grad_sync``), the loss divided by the N micro-steps, clipping, AdamW.

    torchrun --nproc_per_node 2 examples/ddp_loop.py                # faithful, exit code 0
    torchrun --nproc_per_node 2 examples/ddp_loop.py --forget-division   # the loss not divided by N: exit 1
    torchrun --nproc_per_node 2 examples/ddp_loop.py --sync-every-micro-step   # faithful; the extra
                                                                             # all-reduces named as a cost

A small GPT-shaped model (token and position embeddings, one pre-norm attention block, a tied
head) on random tokens, 4 sequences of 16 tokens per micro-batch on each rank, N = 4. Every rank
runs the check; rank 0 prints the report.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from accumcheck.render import render
from accumcheck.torch import AccumulationCheck

N, VOCAB, BLOCK, WIDTH = 4, 96, 16, 32


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.positions = torch.nn.Embedding(BLOCK, WIDTH)
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.attention = torch.nn.MultiheadAttention(WIDTH, 4, dropout=0.1, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight  # tied, as nanoGPT ties them

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        h = self.norm1(x)
        causal = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool), 1)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same weights on every rank
    model = DDP(TinyGPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data
    batches = [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, VOCAB, (4, BLOCK + 1), generator=data))
               for _ in range(3 * N)]
    divide = "--forget-division" not in argv
    sync_always = "--sync-every-micro-step" in argv

    # the loss of a window as one batch: the model's mean cross-entropy, before the loop's 1/N
    check = AccumulationCheck(model, optimizer, step=lambda m, batch: m(*batch))
    with check:
        for micro_step, (x, y) in enumerate(check.batches(batches)):
            last = (micro_step + 1) % N == 0
            model.require_backward_grad_sync = last or sync_always
            loss = model(x, y)
            (loss / N if divide else loss).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    report = check.report  # a collective: every rank reads it
    if rank == 0:
        print(render(report, "table"))
    dist.destroy_process_group()
    return report.exit_code


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
