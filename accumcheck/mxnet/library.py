"""MXNet itself, imported quietly: it logs a line for every storage fallback unless told not to
before it is imported."""

import os

os.environ.setdefault("MXNET_STORAGE_FALLBACK_LOG_VERBOSE", "0")
os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")

import mxnet as mx  # noqa: E402  (after the environment it reads at import)

__all__ = ["mx"]
