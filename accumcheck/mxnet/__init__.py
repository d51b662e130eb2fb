"""MXNet Gluon: the backend, your own block's check, GradAccumulator, gradient diagnostics. Public as
``accumcheck.mxnet``:

    import accumcheck.mxnet
    report = accumcheck.mxnet.check(net, loss_fn, batches, accum_steps=16, device=mx.cpu())
    monitor = accumcheck.mxnet.GradMonitor(net, writer="runs/x")   # gradient diagnostics
    acc = accumcheck.mxnet.GradAccumulator(net, compensated=True)

Importing this package does not import MXNet; using ``check``, ``GradMonitor`` or ``GradAccumulator`` does.
"""

from typing import Any

__all__ = ["GradAccumulator", "GradMonitor", "check"]


def __getattr__(name: str) -> Any:
    if name == "check":
        from .usercheck import check

        return check
    if name == "GradMonitor":
        from .diagnostics import GradMonitor

        return GradMonitor
    if name == "GradAccumulator":
        from .accumulator import GradAccumulator

        return GradAccumulator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
