"""JAX with optax: the backend (``optax.MultiSteps`` against a ``tree_map`` buffer). Public as
``accumcheck.jax``. Importing this package does not import JAX."""
