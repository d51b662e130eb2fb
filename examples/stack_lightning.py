"""A Lightning fit with gradient accumulation, checked step by step: a callback judges the gradient
of every optimizer step (read before Lightning clips it) against its window's micro-batches as one
batch (in float64, the module and optimizer put back after the fit).

    python examples/stack_lightning.py                     # eight micro-batches, N = 4: faithful, exit code 0
    python examples/stack_lightning.py --short-last-window  # ten: Lightning steps the last two micro-batches
                                                            # divided by N = 4, not by 2 (k/N), exit code 1
    python examples/stack_lightning.py --short-last-window --devices 2   # the same on 2 CPU processes
                                      # (strategy="ddp"): twenty micro-batches, ten per rank, each step's
                                      # window every rank's micro-batches of it; the short one is k/N

A small classifier with a mean cross-entropy per micro-batch of eight samples.
"""

import logging
import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

import accumcheck.render
from accumcheck.integrations.lightning import AccumulationCheck

N = 4


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(micro_batches: int = 2 * N, devices: int = 1) -> int:
    torch.manual_seed(0)
    # Lightning's DistributedSampler deals micro-batch i to rank i % devices
    batches = [(torch.randn(8, 10), torch.randint(0, 3, (8,))) for _ in range(micro_batches * devices)]
    check = AccumulationCheck()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # Lightning's start-up lines
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=1,
                         accumulate_grad_batches=N, gradient_clip_val=0.5, callbacks=[check], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(), torch.utils.data.DataLoader(batches, batch_size=None))
    report = check.report  # every rank reads it (a collective); rank 0 prints it
    if trainer.global_rank == 0:
        print(accumcheck.render.render(report, "table"))
    return report.exit_code


if __name__ == "__main__":
    arguments = sys.argv[1:]
    devices = int(arguments[arguments.index("--devices") + 1]) if "--devices" in arguments else 1
    sys.exit(main(2 * N + 2 if "--short-last-window" in arguments else 2 * N, devices))
