"""PyTorch: the backend, your own model's check, GradAccumulator, data parallel, ``accumcheck
train``, gradient diagnostics. Public as ``accumcheck.torch``:

    import accumcheck.torch
    report = accumcheck.torch.check(model, loss_fn, batches, accum_steps=16)
    acc = accumcheck.torch.GradAccumulator(model, compensated=True)

Importing this package does not import PyTorch; using ``check`` or ``GradAccumulator`` does.
"""

from typing import Any

__all__ = ["GradAccumulator", "check"]


def __getattr__(name: str) -> Any:
    if name == "check":
        from .model_check import check

        return check
    if name == "GradAccumulator":
        from .accumulator import GradAccumulator

        return GradAccumulator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
