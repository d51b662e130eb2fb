"""PyTorch: the backend, your own model's check, GradAccumulator, data parallel, ``accumcheck
train``, gradient diagnostics. Public as ``accumcheck.torch``:

    import accumcheck.torch
    report = accumcheck.torch.check(model, loss_fn, batches, accum_steps=16)
    acc = accumcheck.torch.GradAccumulator(model, compensated=True)
    check = accumcheck.torch.AccumulationCheck(model, optimizer)      # your own loop, DDP or FSDP2
    monitor = accumcheck.torch.GradMonitor(model, writer="runs/x")   # gradient diagnostics

Importing this package does not import PyTorch; using ``check``, ``AccumulationCheck``, ``GradMonitor`` or
``GradAccumulator`` does.
"""

from typing import Any

__all__ = ["AccumulationCheck", "GradAccumulator", "GradMonitor", "check"]


def __getattr__(name: str) -> Any:
    if name == "check":
        from .usercheck import check

        return check
    if name == "GradMonitor":
        from .diagnostics import GradMonitor

        return GradMonitor
    if name == "AccumulationCheck":
        from .loopcheck import AccumulationCheck

        return AccumulationCheck
    if name == "GradAccumulator":
        from .accumulator import GradAccumulator

        return GradAccumulator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
