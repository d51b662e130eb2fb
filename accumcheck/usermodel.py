"""What ``accumcheck.torch.check`` and ``accumcheck.mxnet.check`` share: reading the user's
batches and the number of micro-steps."""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Sequence

from .errors import AccumcheckError

Batch = tuple[Any, Any]
MAX_UNCOUNTED_BATCHES = 4096  # an iterable read to its end without accum_steps: at most this many


def batch_source(batches: Any, accum_steps: int | None) -> tuple[Callable[[int], Batch], int]:
    """A function of the micro-step index giving its ``(inputs, target)``, and the number of
    micro-steps. ``batches`` is a sequence, an iterable (read once: both passes need every batch;
    only the first ``accum_steps`` are taken, so an endless one such as ``itertools.cycle`` is
    fine) or a function of the index (then ``accum_steps`` is required)."""
    if callable(batches):
        count = None
        get = batches
    else:
        if not isinstance(batches, Sequence):
            _positive(accum_steps)
            batches = list(islice(batches, accum_steps if accum_steps is not None else MAX_UNCOUNTED_BATCHES + 1))
            if accum_steps is None and len(batches) > MAX_UNCOUNTED_BATCHES:
                raise AccumcheckError(f"check: batches is an iterable of more than {MAX_UNCOUNTED_BATCHES} batches "
                                      "(perhaps endless); pass accum_steps to say how many to take")
        if not batches:
            raise AccumcheckError("check: batches is empty; give (inputs, target) pairs")
        count = len(batches)
        get = batches.__getitem__
    steps = accum_steps if accum_steps is not None else count
    if steps is None:
        raise AccumcheckError("check: batches is a function; pass accum_steps as well")
    _positive(steps)
    if count is not None and steps > count:
        raise AccumcheckError(f"check: accum_steps={steps} but only {count} batches were given")
    return get, steps


def _positive(steps: Any) -> None:
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise AccumcheckError(f"check: accum_steps must be a positive integer, got {steps!r}")
