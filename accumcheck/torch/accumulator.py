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
                self.add_to(i, p.grad)
                p.grad = None

    def add_to(self, index: int, grad: Any) -> None:
        """Add ``grad`` into parameter ``index``'s buffer."""
        with torch.no_grad():
            grad = grad.to(self.dtype)
            if self.carries is None:
                self.sums[index].add_(grad)
                return
            # Neumaier: keep what each addition rounds away
            total = self.sums[index] + grad
            lost = torch.where(self.sums[index].abs() >= grad.abs(), (self.sums[index] - total) + grad,
                               (grad - total) + self.sums[index])
            self.carries[index].add_(lost)
            self.sums[index].copy_(total)

    def totals(self) -> list[Any]:
        """The accumulated gradients, in the buffer dtype."""
        return [self.total(i) for i in range(len(self.sums))]

    def total(self, index: int) -> Any:
        """The accumulated gradient of parameter ``index`` so far, in the buffer dtype."""
        return self.sums[index] if self.carries is None else self.sums[index] + self.carries[index]

    def replace(self, index: int, total: Any) -> None:
        """Set parameter ``index``'s accumulated gradient to ``total`` (its carry to zero)."""
        self.sums[index].copy_(total)
        if self.carries is not None:
            self.carries[index].zero_()

    def apply(self) -> None:
        """Write the accumulated gradients into ``.grad``, in each parameter's dtype."""
        for p, total in zip(self.params, self.totals()):
            p.grad = total.to(p.dtype)

    def zero(self) -> None:
        for buffers in (self.sums, self.carries or []):
            for b in buffers:
                b.zero_()
