"""MXNet Gluon: the backend, your own block's check, gradient diagnostics. Public as
``accumcheck.mxnet``:

    import accumcheck.mxnet
    report = accumcheck.mxnet.check(net, loss_fn, batches, accum_steps=16, ctx=mx.cpu())

Importing this package does not import MXNet; using ``check`` does.
"""

from typing import Any

__all__ = ["check"]


def __getattr__(name: str) -> Any:
    if name == "check":
        from .model_check import check

        return check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
