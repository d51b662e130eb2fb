"""optax, imported once for the package (``from .library import optax``), JAX's dtypes by name, and
the versions a report records."""

import warnings

with warnings.catch_warnings():
    # chex 0.1.7 (the last beside numpy < 1.24) reads jax names jax 0.4.23 deprecates: its warnings,
    # raised on optax's import, say nothing about the user's code.
    warnings.simplefilter("ignore", DeprecationWarning)
    import optax

import jax.numpy as jnp  # noqa: E402  (imported by optax already, inside the filter above)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


def versions() -> dict[str, str]:
    """The versions a JAX report records."""
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__}


__all__ = ["DTYPES", "optax", "versions"]
