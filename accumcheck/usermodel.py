"""What ``accumcheck.torch.check`` and ``accumcheck.mxnet.check`` share: reading the user's
batches and the number of micro-steps."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .errors import AccumcheckError

Batch = tuple[Any, Any]


def batch_source(batches: Any, accum_steps: int | None) -> tuple[Callable[[int], Batch], int]:
    """A function of the micro-step index giving its ``(inputs, target)``, and the number of
    micro-steps. ``batches`` is a sequence, an iterable (read once: both passes need every batch)
    or a function of the index (then ``accum_steps`` is required)."""
    if callable(batches):
        count = None
        get = batches
    else:
        if not isinstance(batches, Sequence):
            batches = list(batches)
        if not batches:
            raise AccumcheckError("check: batches is empty; give (inputs, target) pairs")
        count = len(batches)
        get = batches.__getitem__
    steps = accum_steps if accum_steps is not None else count
    if steps is None:
        raise AccumcheckError("check: batches is a function; pass accum_steps as well")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise AccumcheckError(f"check: accum_steps must be a positive integer, got {steps!r}")
    if count is not None and steps > count:
        raise AccumcheckError(f"check: accum_steps={steps} but only {count} batches were given")
    return get, steps
