"""A small transformer trained on the CPU until a learning-rate spike makes it diverge; the
gradient monitor names the parameter that dominates the gradient norm when clipping fires hard.

    python -m accumcheck.torch.examples.diverge [--steps 60] [--spike-at 40] [--logdir runs/diverge]

It trains a 2-layer encoder to copy random tokens with AdamW at lr 1e-3, then multiplies the
learning rate by 1000 from --spike-at on. Per-layer gradient statistics go to TensorBoard when
--logdir is given; the dominance reports are printed as they arrive (one step after the step
they describe: the normal path never waits for the device).
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from ..diagnostics import GradMonitor

VOCAB, WIDTH = 64, 64


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--spike-at", type=int, default=40)
    parser.add_argument("--logdir", default=None, help="TensorBoard folder for the per-layer statistics")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout)

    torch.manual_seed(0)
    model = Encoder()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = None
    if args.logdir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.logdir)
    monitor = GradMonitor(model, layers="all", writer=writer, log_every=5, clip_threshold=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        if step == args.spike_at:
            for group in optimizer.param_groups:
                group["lr"] *= 1000
            print(f"step {step}: learning rate spiked to {optimizer.param_groups[0]['lr']:g}")
        tokens = torch.randint(0, VOCAB, (16, 12), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        monitor.clip_grad_norm_(1.0)
        optimizer.step()
        if step % 10 == 0 or step >= args.spike_at:
            print(f"step {step}: loss {loss.item():.4f}")  # the example's own logging, not the monitor's
    reports = monitor.flush()
    if writer is not None:
        writer.close()
    print(f"{len(reports)} dominance report(s); first: {reports[0].entries[0].name if reports else 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
