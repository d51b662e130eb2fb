"""A user's micro-batch on its way to a loss: moved to the model's device, met with the model as
the user's loop does (``accumcheck.run.usermodel``), and, for the full-batch check, N of them joined
into one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from ..errors import USER_EXCEPTIONS, AccumcheckError, UserCodeError, first_line
from ..run.usermodel import apply_loss, call_model, join_batches, map_leaves, model_error, own_loss, split_batch

IGNORE_INDEX = -100  # the label PyTorch's cross_entropy and Hugging Face models skip


def to_device(value: Any, device: Any, dtype: Any = None, index: int | str | None = None) -> Any:
    """``value`` with every tensor in it on ``device`` (floating ones in ``dtype`` when given),
    through tuples, lists, named tuples and mappings; anything else as it is. ``index``: the
    micro-batch ``value`` is (or the batch a string names), for a batch the user's own tensors
    keep from moving (a tensor on the meta device, a subclass raising): a UserCodeError."""
    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.to(device)
        return leaf.to(dtype) if dtype is not None and leaf.is_floating_point() else leaf

    try:
        return map_leaves(value, move)
    except USER_EXCEPTIONS as exc:
        if index is None:
            raise
        where = f"micro-batch {index}" if isinstance(index, int) else index
        raise UserCodeError(f"check: moving {where} to {device} raised {type(exc).__name__}: {first_line(exc)}; "
                            "give batches of tensors with values (not on the meta device)") from exc


def backward_error(exc: BaseException, index: int | str) -> UserCodeError:
    """The one-line error for an exception raised in the backward pass of micro-batch ``index``
    (or of the batch a string names): a gradient hook or autograd function of the user's. Raise it
    ``from exc``."""
    where = f"micro-batch {index}" if isinstance(index, int) else index
    return UserCodeError(f"check: the backward pass raised {type(exc).__name__} on {where}: {first_line(exc)}; a "
                         "gradient hook (register_hook, register_post_accumulate_grad_hook) or an autograd function "
                         "of the model raised")


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
    except USER_EXCEPTIONS as exc:  # the user's model, loss or step failed on this batch (or exited)
        culprit = "step" if step is not None else "the model or loss_fn" if loss_fn is not None else "the model"
        raise model_error(exc, index, culprit) from exc
    where = f"micro-batch {index}" if isinstance(index, int) else index
    if not (is_scalar(loss) and loss.is_floating_point()):
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise AccumcheckError(f"check: {what} must return a scalar loss tensor, got {got} on {where}; "
                              "reduce it with .mean() or .sum()")
    if not loss.requires_grad:
        raise AccumcheckError(f"check: the loss of {where} does not depend on any parameter (no grad_fn); "
                              "is the forward run under torch.no_grad()?")
    if loss.grad_fn is None:
        raise AccumcheckError(f"check: the loss of {where} is a leaf tensor (requires_grad, but no grad_fn), so it "
                              "depends on no parameter; return the loss computed from the model's output, not a new "
                              "tensor such as torch.tensor(value, requires_grad=True)")
    return loss


def join(batches: list[Any], collate: Callable[[list[Any]], Any] | None) -> Any:
    """N micro-batches as one batch: ``collate(batches)``, or tensors concatenated along the batch
    axis (dim 0) through tuples, lists and mappings."""
    return join_batches(batches, collate, (torch.Tensor,), torch.cat, "tensor")


def labels_of(batch: Any, loss_fn_given: bool) -> torch.Tensor | None:
    """A micro-batch's integer labels (the target of an (inputs, target) batch, or a Hugging Face
    ``labels``), or None where the batch has none."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif loss_fn_given and isinstance(batch, (tuple, list)) and len(batch) == 2:
        labels = batch[1]
    else:
        labels = None
    ok = isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dim() > 0
    return labels if ok else None


def item_count(batch: Any, loss_fn_given: bool) -> int | None:
    """Labelled items of a micro-batch (elements of ``labels_of``'s labels that are not -100), or
    None where the batch does not say."""
    labels = labels_of(batch, loss_fn_given)
    return None if labels is None else int((labels != IGNORE_INDEX).sum())
