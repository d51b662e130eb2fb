"""A user's micro-batch on its way to a loss: moved to the model's device, met with the model as
the user's loop does (``accumcheck.usermodel``), and, for the full-batch check, N of them joined
into one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from ...errors import AccumcheckError
from ...usermodel import apply_loss, call_model, join_batches, map_leaves, model_error, own_loss, split_batch

IGNORE_INDEX = -100  # the label PyTorch's cross_entropy and Hugging Face models skip


def to_device(value: Any, device: Any, dtype: Any = None) -> Any:
    """``value`` with every tensor in it on ``device`` (floating ones in ``dtype`` when given),
    through tuples, lists, named tuples and mappings; anything else as it is."""
    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.to(device)
        return leaf.to(dtype) if dtype is not None and leaf.is_floating_point() else leaf

    return map_leaves(value, move)


def is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def micro_loss(model: Any, batch: Any, index: int | str, loss_fn: Callable[..., Any] | None,
               step: Callable[[Any, Any], Any] | None) -> Any:
    """The scalar loss of micro-batch ``index`` (or of the batch a string names), computed as the
    user's loop computes it."""
    try:
        if step is not None:
            loss, what = step(model, batch), "step"
        else:
            inputs, target = split_batch(batch, loss_fn is not None)
            output = call_model(model, inputs)
            loss, what = (apply_loss(loss_fn, output, target), "loss_fn") if loss_fn is not None else \
                (own_loss(output, is_scalar), "the model")
    except AccumcheckError:
        raise
    except Exception as exc:  # the user's model, loss or step failed on this batch
        culprit = "step" if step is not None else "the model or loss_fn" if loss_fn is not None else "the model"
        raise model_error(exc, index, culprit) from exc
    if not (is_scalar(loss) and loss.is_floating_point()):
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        where = f"micro-batch {index}" if isinstance(index, int) else index
        raise AccumcheckError(f"check: {what} must return a scalar loss tensor, got {got} on {where}; "
                              "reduce it with .mean() or .sum()")
    if not loss.requires_grad:
        raise AccumcheckError(f"check: the loss of micro-batch {index} does not depend on any parameter (no grad_fn); "
                              "is the forward run under torch.no_grad()?")
    return loss


def join(batches: list[Any], collate: Callable[[list[Any]], Any] | None) -> Any:
    """N micro-batches as one batch: ``collate(batches)``, or tensors concatenated along the batch
    axis (dim 0) through tuples, lists and mappings."""
    return join_batches(batches, collate, (torch.Tensor,), torch.cat, "tensor")


def item_count(batch: Any, loss_fn_given: bool) -> int | None:
    """Labelled items of a micro-batch (elements of the integer target, or of a Hugging Face
    ``labels``, that are not -100), or None where the batch does not say."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif loss_fn_given and isinstance(batch, (tuple, list)) and len(batch) == 2:
        labels = batch[1]
    else:
        labels = None
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dim() > 0:
        return int((labels != IGNORE_INDEX).sum())
    return None
