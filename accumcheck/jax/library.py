"""optax, imported once for the package (``from .library import optax``), JAX's dtypes by name,
its 64-bit mode as a context, and the versions a report records."""

import warnings
from typing import Any

with warnings.catch_warnings():
    # chex 0.1.7 (the last beside numpy < 1.24) reads jax names jax 0.4.23 deprecates: its warnings,
    # raised on optax's import, say nothing about the user's code.
    warnings.simplefilter("ignore", DeprecationWarning)
    import optax

import jax.numpy as jnp  # noqa: E402  (imported by optax already, inside the filter above)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def enable_x64() -> Any:
    """JAX's 64-bit mode inside a ``with`` block, put back as found on leaving it: ``jax.enable_x64``
    from JAX 0.8 on (later releases dropped ``jax.experimental.enable_x64``), the experimental one before."""
    import jax

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as experimental

    return experimental()


def versions() -> dict[str, str]:
    """The versions a JAX report records."""
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__}


__all__ = ["DTYPES", "enable_x64", "optax", "versions"]
