"""Your own PyTorch loop with gradient accumulation, checked for what each optimizer step did with
the gradient: one optimizer step, one scheduler step and one clipping per window, the parameters
still between its micro-batches, and the update equal to AdamW applied once to the window's
gradient (replayed in float64 from the optimizer's state before the window).

    python examples/loop_step.py                             # the correct loop: faithful, exit code 0
    python examples/loop_step.py --scheduler-every-micro-batch   # the learning rate decays N x too fast
    python examples/loop_step.py --step-every-micro-batch    # the window applied as several updates
    python examples/loop_step.py --keras-19990               # weight decay, clipping and Adam's step
                                                             # count at every micro-step (keras#19990)

A small classifier, AdamW(weight_decay=0.1), a StepLR scheduler, clipping, N = 4, three windows.
"""

import sys

import torch
import torch.nn.functional as F

import accumcheck.render
from accumcheck.torch import AccumulationCheck

N, STEPS = 4, 3


def main(fault: str | None = None) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    data = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(N * STEPS)]

    check = AccumulationCheck(model, optimizer, loss_fn=F.cross_entropy, scheduler=scheduler)
    with check:
        for i, (x, y) in enumerate(check.batches(data)):
            (F.cross_entropy(model(x), y) / N).backward()
            last = (i + 1) % N == 0
            if fault == "keras-19990":  # what Keras 3.0-3.4 did at every micro-step of a window
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if not last:
                    with torch.no_grad():
                        for group in optimizer.param_groups:
                            for p in group["params"]:
                                p.mul_(1 - group["lr"] * group["weight_decay"])
                                if p in optimizer.state:
                                    optimizer.state[p]["step"] += 1
            if fault == "scheduler-every-micro-batch":
                scheduler.step()
            if fault == "step-every-micro-batch":
                optimizer.step()
            if last:
                if fault != "keras-19990":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if fault != "step-every-micro-batch":
                    optimizer.step()
                if fault != "scheduler-every-micro-batch":
                    scheduler.step()
                optimizer.zero_grad()
    report = check.report
    print(accumcheck.render.render(report, "table"))
    return report.exit_code


if __name__ == "__main__":
    flags = [a.removeprefix("--") for a in sys.argv[1:]]
    sys.exit(main(flags[0] if flags else None))
