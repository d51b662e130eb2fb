"""A user's Gluon block in float64 (``check(oracle=True)`` and ``check(full_batch=True)``): the
gradient of its micro-batches accumulated (the oracle), and of the same micro-batches joined into
one batch. Both run on a float64 copy, so the block itself is not cast."""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from ..errors import USER_EXCEPTIONS, AccumcheckError
from ..run.backend import Progress
from ..run.results import FullBatchGap, window_scale
from ..run.usermodel import join_batches, map_leaves, split_batch
from .blockstate import clear_cached_ops, layers_for_check, materialised, unique_params
from .library import mx
from .passes import manual_pass

MicroOf = Callable[[Any, Callable[[int], Any]], Callable[[int], tuple[Any, Any]]]


def float64_twin(block: Any) -> Any:
    """A float64 copy of ``block``: its parameters' values exactly, widened."""
    clear_cached_ops(block)  # a hybridized block's cached graph holds C handles that cannot be copied
    try:
        twin = copy.deepcopy(block)
    except USER_EXCEPTIONS as exc:
        raise AccumcheckError(f"check: oracle and full_batch need a float64 copy of the block, and copy.deepcopy "
                              f"failed ({type(exc).__name__}: {exc}); run without them") from exc
    twin.cast("float64")
    return twin


def float64_passes(block: Any, micro_of: MicroOf, batches: list[Any], whole: Any, ctx: Any, loss_reduction: str,
                   loss_fn_given: bool, train_mode: bool,
                   progress: Progress | None = None) -> tuple[dict[str, np.ndarray], FullBatchGap | None]:
    """On a float64 twin of ``block``: the accumulated gradient over ``batches`` (the oracle), and
    where ``whole`` (the batches joined into one, ``join``) is given, its comparison with that
    batch's gradient (the accumulated times 1/N for a "mean" loop). ``micro_of(block, get_batch)``
    is the check's micro-step on another block."""
    steps = len(batches)
    full_batch = whole is not None
    whole = to_float64(whole) if full_batch else None
    twin = float64_twin(block)
    params = {name: p for name, p in unique_params(twin)[0].items() if materialised(p) and p.grad_req != "null"}
    with layers_for_check(twin, train_mode):
        micro = micro_of(twin, lambda k: to_float64(batches[k]))
        _, exact, _, _, _ = manual_pass(params, micro, steps, ctx, progress, counts={})
        accumulated = {name: np.asarray(g, np.float64) for name, g in exact.items()}
        if not full_batch:
            return accumulated, None
        joined = micro_of(twin, lambda _: whole)
        for param in params.values():
            param.zero_grad()
        with mx.autograd.record():
            loss, _ = joined(0)
        loss.backward()
        full = {name: p.grad(ctx).asnumpy().astype(np.float64) for name, p in params.items()}
    scale, scaled_by = window_scale(loss_reduction, steps)
    counts = [item_count(b, loss_fn_given) for b in batches]
    return accumulated, FullBatchGap(normalisation=loss_reduction, accumulated_scaled_by=scaled_by,
                                     accumulated={name: g * scale for name, g in accumulated.items()}, full=full,
                                     item_counts=None if None in counts else counts)


def to_float64(batch: Any) -> Any:
    """Floating NDArrays and numpy arrays of ``batch`` as float64 NDArrays (``mx.nd.array`` would
    make a numpy array float32); integer ones as they are."""
    def widen(leaf: Any) -> Any:
        if isinstance(leaf, mx.nd.NDArray) and np.issubdtype(np.dtype(leaf.dtype), np.floating):
            return leaf.astype("float64")
        if isinstance(leaf, np.ndarray) and np.issubdtype(leaf.dtype, np.floating):
            return mx.nd.array(leaf, dtype="float64")
        return leaf

    return map_leaves(batch, widen)


def join(batches: list[Any], collate: Callable[[list[Any]], Any] | None) -> Any:
    """N micro-batches as one: ``collate(batches)``, or NDArrays and numpy arrays concatenated
    along axis 0 through tuples, lists and mappings."""
    def concat(parts: list[Any]) -> Any:
        if all(isinstance(p, np.ndarray) for p in parts):
            return np.concatenate(parts)
        return mx.nd.concat(*(p if isinstance(p, mx.nd.NDArray) else mx.nd.array(p, dtype=p.dtype) for p in parts),
                            dim=0)

    return join_batches(batches, collate, (mx.nd.NDArray, np.ndarray), concat, "array")


def item_count(batch: Any, loss_fn_given: bool) -> int | None:
    """The items of a micro-batch: the elements of its target (``(inputs, target)`` with
    ``loss_fn``), or None where the batch has none."""
    if not loss_fn_given:
        return None
    _, target = split_batch(batch, True)
    if isinstance(target, (mx.nd.NDArray, np.ndarray)) and len(target.shape) > 0:
        return int(np.prod(target.shape))
    return None
