"""JAX with optax: the backend (``optax.MultiSteps`` against a ``tree_map`` buffer) and your own
model's check. Public as ``accumcheck.jax``:

    import accumcheck.jax
    report = accumcheck.jax.check(params, loss_fn, batches, accum_steps=16)  # loss_fn(params, batch)
    accumcheck.assert_faithful(report)

Importing this package does not import JAX; using ``check`` does.
"""

from typing import Any

__all__ = ["check"]


def __getattr__(name: str) -> Any:
    if name == "check":
        from .usercheck import check

        return check
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
