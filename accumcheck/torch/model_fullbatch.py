"""A user's model in float64: the accumulated gradient of its micro-batches (the oracle), and the
gradient of the same micro-batches joined into one batch (the full-batch check)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import USER_EXCEPTIONS, AccumcheckError
from ..run.backend import Progress
from ..run.results import FullBatchGap, window_scale
from .casemodel import to_numpy
from .passes import accumulate
from .userbatch import backward_error, item_count, join, micro_loss, to_device


def full_batch_gap(twin: Any, params: dict[str, Any], step_loss: Callable[[int], Any], batches: list[Any] | None,
                   accum_steps: int, loss_fn: Callable[..., Any] | None, step: Callable[[Any, Any], Any] | None,
                   collate: Callable[[list[Any]], Any] | None, loss_reduction: str,
                   progress: Progress | None = None) -> tuple[FullBatchGap | None, dict[str, np.ndarray]]:
    """``twin`` is the float64 copy of the model and ``params`` its parameters by name. Returns
    the full-batch comparison (None without ``batches``) and the accumulated float64 gradients."""
    micro = accumulate(params, step_loss, accum_steps, None, progress, "float64 model",
                       backward_error=backward_error)["native"]
    accumulated = {name: to_numpy(g) for name, g in micro.items()}
    if batches is None:
        return None, accumulated
    device = next(iter(params.values())).device
    what = "the micro-batches joined into one batch"
    whole = to_device(join(batches, collate), device, torch.float64, what)
    for p in params.values():
        p.grad = None
    try:
        micro_loss(twin, whole, what, loss_fn, step).backward()
    except AccumcheckError:
        raise
    except USER_EXCEPTIONS as exc:
        raise backward_error(exc, what) from exc
    full = {name: to_numpy(p.grad) if p.grad is not None else np.zeros(tuple(p.shape)) for name, p in params.items()}
    scale, scaled_by = window_scale(loss_reduction, accum_steps)
    counts = [item_count(b, loss_fn is not None) for b in batches]
    return FullBatchGap(normalisation=loss_reduction, accumulated_scaled_by=scaled_by,
                        accumulated={name: g * scale for name, g in accumulated.items()}, full=full,
                        item_counts=None if None in counts else counts), accumulated
