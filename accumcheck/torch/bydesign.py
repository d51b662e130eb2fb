"""The modules that compute over the batch, so that a window's micro-batches differ from the
window as one batch whatever the accumulation: BatchNorm (and SyncBatchNorm, the lazy ones) in
train mode normalises each micro-batch by that micro-batch's own mean and variance."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn.modules.batchnorm import _BatchNorm


def batch_level_modules(model: torch.nn.Module) -> list[str]:
    """Each module of ``model`` that normalises by the batch's statistics now, as "BatchNorm2d
    'features.1'" (its class and name)."""
    return [f"{type(m).__name__} '{name}'" for name, m in model.named_modules() if _by_batch(m)]


@contextmanager
def batch_statistics_off(model: torch.nn.Module) -> Iterator[bool]:
    """Every such module in eval mode (its running statistics instead of the batch's) inside the
    block, its mode put back after. Yields whether that removed every one: a BatchNorm without
    running statistics normalises by the batch in eval mode too."""
    switched = [m for m in model.modules() if _by_batch(m) and m.track_running_stats]
    for m in switched:
        m.training = False
    try:
        yield not any(_by_batch(m) for m in model.modules())
    finally:
        for m in switched:
            m.training = True


def _by_batch(module: torch.nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and (module.training or not module.track_running_stats)
