"""The accumulated gradient against the whole batch's in one backward pass, both in float64: does
the accumulation compute the gradient the user means (how the loss is normalised)?"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..case.definition import IGNORE_LABEL, Case
from ..run.backend import Progress
from ..run.results import FullBatchGap, window_scale
from .casemodel import build_model, case_loss, to_inputs, to_numpy
from .passes import case_sums


def full_batch_gap(case: Case, weights: dict[str, np.ndarray], accum_steps: int, dev: Any,
                   progress: Progress | None = None) -> FullBatchGap:
    """The accumulated gradient and the whole batch's, both float64 numpy arrays per parameter,
    and the labelled tokens of each micro-batch. With a "mean" loss the accumulated sum is
    divided by N, as training code does; "sum" and "token_count" compare as they are."""
    micro = case_sums(case, build_model(case, weights, torch.float64, dev), accum_steps, dev, None, progress,
                      "float64 micro-batches")["native"]
    batches = [case.batch(k) for k in range(accum_steps)]  # the whole batch at once: memory grows with N
    inputs = to_inputs(np.concatenate([b.inputs for b in batches]), dev, torch.float64)
    labels = torch.from_numpy(np.concatenate([b.labels for b in batches])).to(dev)
    model = build_model(case, weights, torch.float64, dev)
    whole = case if case.loss_reduction != "token_count" else case.with_reduction("mean")
    case_loss(whole, model(inputs), labels).backward()
    # scaled in place, and shared with numpy on the CPU: no third float64 copy of the model
    scale, scaled_by = window_scale(case.loss_reduction, accum_steps)
    return FullBatchGap(normalisation=case.loss_reduction, accumulated_scaled_by=scaled_by,
                        accumulated={name: to_numpy(micro[name].mul_(scale)) for name in model.canonical},
                        full={name: to_numpy(p.grad) for name, p in model.canonical.items()},
                        item_counts=[int((b.labels != IGNORE_LABEL).sum()) for b in batches])
