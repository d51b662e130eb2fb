"""GradAccumulator: float32 main-gradient buffers for gradient accumulation, optionally
compensated. The fix a training loop adopts in two lines."""

from __future__ import annotations

from typing import Any

import torch


class GradAccumulator:
    """Float32 main-grad buffers for gradient accumulation (as Megatron-LM's ``main_grad``), with
    an optional compensated (Neumaier) mode that keeps the sum within about one float32 ulp.

        acc = GradAccumulator(model, compensated=True)
        for inputs, target in micro_batches:
            loss_fn(model(inputs), target).backward()
            acc.add()                 # .grad into the buffers; .grad cleared
        acc.apply()                   # the sums into .grad, in the parameters' dtype
        optimizer.step()
        acc.zero()

    Parameters in bfloat16 or float16 then accumulate in float32 instead of their own dtype.
    """

    def __init__(self, params: Any, dtype: Any = None, compensated: bool = False) -> None:
        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        self.params = [p for p in params if p.requires_grad]
        self.dtype = dtype or torch.float32
        self.compensated = compensated
        self.sums = [torch.zeros_like(p, dtype=self.dtype) for p in self.params]
        self.carries = [torch.zeros_like(p, dtype=self.dtype) for p in self.params] if compensated else None

    def add(self) -> None:
        """Add each parameter's ``.grad`` (one micro-step's gradient) and clear it."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                grad = p.grad.to(self.dtype)
                if self.carries is None:
                    self.sums[i].add_(grad)
                else:  # Neumaier: keep what each addition rounds away
                    total = self.sums[i] + grad
                    lost = torch.where(self.sums[i].abs() >= grad.abs(), (self.sums[i] - total) + grad,
                                       (grad - total) + self.sums[i])
                    self.carries[i].add_(lost)
                    self.sums[i].copy_(total)
                p.grad = None

    def totals(self) -> list[Any]:
        """The accumulated gradients, in the buffer dtype."""
        if self.carries is None:
            return list(self.sums)
        return [s + c for s, c in zip(self.sums, self.carries)]

    def apply(self) -> None:
        """Write the accumulated gradients into ``.grad``, in each parameter's dtype."""
        for p, total in zip(self.params, self.totals()):
            p.grad = total.to(p.dtype)

    def zero(self) -> None:
        for buffers in (self.sums, self.carries or []):
            for b in buffers:
                b.zero_()
