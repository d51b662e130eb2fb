"""The accumulated gradient against the whole window's in one backward pass, both in float64 on
MXNet: does the accumulation compute the gradient the user means (how the loss is normalised)?
PyTorch's float64 model stands in where MXNet lacks a float64 kernel, and the run says so."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..case.definition import IGNORE_LABEL, Case
from ..run.backend import Progress
from ..run.results import FullBatchGap, window_scale
from .casemodel import case_loss
from .library import mx
from .passes import case_step, micro_steps, native_pass, prepared


def full_batch_gap(case: Case, weights: dict[str, np.ndarray], accum_steps: int, ctx: Any, hybridize: bool,
                   device: str, progress: Progress | None = None) -> tuple[FullBatchGap | None, str]:
    """The accumulated gradient (grad_req='add' over the N micro-batches, divided by N for a "mean"
    loss as training code does) and the gradient of the N micro-batches joined into one batch,
    both float64 numpy arrays per parameter; and where they were computed."""
    try:
        return _on_mxnet(case, weights, accum_steps, ctx, hybridize, progress), "mxnet float64"
    except mx.base.MXNetError as exc:
        reason = str(exc).strip().splitlines()[0][:160]
    try:
        from ..torch.casemodel import deterministic, isolated, resolve_device
        from ..torch.fullbatch import full_batch_gap as torch_gap
    except ImportError:
        return None, f"none: MXNet float64 failed ({reason}) and torch is not installed"
    dev = resolve_device("cpu" if device == "cpu" else "cuda")
    with deterministic(dev), isolated(dev):
        gap = torch_gap(case, weights, accum_steps, dev, progress)
    return gap, f"torch float64 (MXNet float64 failed: {reason})"


def _on_mxnet(case: Case, weights: dict[str, np.ndarray], accum_steps: int, ctx: Any, hybridize: bool,
              progress: Progress | None) -> FullBatchGap:
    block = prepared(case, weights, "float64", ctx, hybridize)
    micro, _, _ = native_pass(block.canonical, case_step(case, block, ctx, "float64", accum_steps), accum_steps, ctx,
                              None, progress, phase="full batch: float64 micro-batches")
    batches = [case.batch(k) for k in range(accum_steps)]  # the whole window at once: memory grows with N
    inputs = np.concatenate([b.inputs for b in batches])
    labels = np.concatenate([b.labels for b in batches])
    # The whole batch's mean over its labelled tokens is the token-count loss's sum over the window.
    whole = case if case.loss_reduction != "token_count" else case.with_reduction("mean")
    block = prepared(case, weights, "float64", ctx, hybridize)
    for param in block.canonical.values():
        param.grad_req = "write"
    list(micro_steps(lambda _: _whole_loss(whole, block, inputs, labels, ctx), 1, []))
    scale, scaled_by = window_scale(case.loss_reduction, accum_steps)
    return FullBatchGap(normalisation=case.loss_reduction, accumulated_scaled_by=scaled_by,
                        accumulated={name: g * scale for name, g in micro.items()},
                        full={name: p.grad().asnumpy() for name, p in block.canonical.items()},
                        item_counts=[int((b.labels != IGNORE_LABEL).sum()) for b in batches])


def _whole_loss(case: Case, block: Any, inputs: np.ndarray, labels: np.ndarray, ctx: Any) -> tuple[Any, Any]:
    # Embedding takes its indices as floats (exact below 2**24), as in passes.case_step.
    out = block(mx.nd.array(inputs, ctx=ctx, dtype="float64"))
    return case_loss(case, out, mx.nd.array(labels, ctx=ctx, dtype="float64")), out
