"""The accumulated gradient against the whole window's in one backward pass, both in float64: does
the accumulation compute the gradient the user means (how the loss is normalised)? One comparison
(``full_batch_gap``) for a built-in case (on a float64 block of it; PyTorch's float64 model stands
in where MXNet lacks a float64 kernel, and the run says so) and for a user's block (on a float64
copy, so the block itself is not cast; its accumulation there is also the oracle)."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any, Callable

import numpy as np

from ..case.definition import IGNORE_LABEL, Case
from ..errors import USER_EXCEPTIONS, AccumcheckError
from ..run.backend import Progress
from ..run.results import FullBatchGap, Hypotheses, window_scale
from ..run.usermodel import join_batches, map_leaves, split_batch
from .blockstate import BATCH_NORM, clear_cached_ops, layers_for_check, materialised, unique_params
from .casemodel import case_step, prepared, whole_step
from .library import mx
from .passes import StepFn, manual_pass, micro_steps, native_pass, set_grad_req

MicroOf = Callable[[Any, Callable[[int], Any]], StepFn]


def full_batch_gap(params: dict[str, Any], whole: StepFn, accumulated: dict[str, np.ndarray], loss_reduction: str,
                   accum_steps: int, item_counts: list[int] | None, ctx: Any) -> FullBatchGap:
    """``accumulated`` (float64, over the N micro-batches; times 1/N for a "mean" loop, as
    training code divides) against the gradient of ``params`` from ``whole`` (micro-step 0: the
    N micro-batches joined into one batch), grad_req='write'."""
    set_grad_req(params, {}, "write", None)
    for param in params.values():
        param.zero_grad()
    list(micro_steps(whole, 1, []))
    full = {name: p.grad(ctx).asnumpy().astype(np.float64) for name, p in params.items()}
    scale, scaled_by = window_scale(loss_reduction, accum_steps)
    return FullBatchGap(normalisation=loss_reduction, accumulated_scaled_by=scaled_by,
                        accumulated={name: g * scale for name, g in accumulated.items()}, full=full,
                        item_counts=item_counts)


def case_full_batch(case: Case, weights: dict[str, np.ndarray], accum_steps: int, ctx: Any, hybridize: bool,
                    device: str, progress: Progress | None = None) -> tuple[FullBatchGap | None, str]:
    """A built-in case's gap: accumulated with grad_req='add' over the N micro-batches, against
    the N micro-batches joined into one batch; and where they were computed."""
    try:
        return _on_mxnet(case, weights, accum_steps, ctx, hybridize, progress), "mxnet float64"
    except mx.base.MXNetError as exc:
        reason = str(exc).strip().splitlines()[0][:160]
    if importlib.util.find_spec("torch") is None:
        return None, f"none: MXNet float64 failed ({reason}) and torch is not installed"
    from ..torch.builtin import full_batch_gap as torch_gap

    gap = torch_gap(case, weights, accum_steps, "cpu" if device == "cpu" else "cuda", progress)
    return gap, f"torch float64 (MXNet float64 failed: {reason})"


def _on_mxnet(case: Case, weights: dict[str, np.ndarray], accum_steps: int, ctx: Any, hybridize: bool,
              progress: Progress | None) -> FullBatchGap:
    block = prepared(case, weights, "float64", ctx, hybridize)
    micro, _, _ = native_pass(block.canonical, case_step(case, block, ctx, "float64", accum_steps), accum_steps, ctx,
                              None, progress, phase="full batch: float64 micro-batches")
    block = prepared(case, weights, "float64", ctx, hybridize)
    counts = [int((case.batch(k).labels != IGNORE_LABEL).sum()) for k in range(accum_steps)]
    return full_batch_gap(block.canonical, whole_step(case, block, ctx, accum_steps), micro, case.loss_reduction,
                          accum_steps, counts, ctx)


def float64_passes(block: Any, micro_of: MicroOf, batches: list[Any], whole: Any, ctx: Any, loss_reduction: str,
                   loss_fn_given: bool, train_mode: bool,
                   progress: Progress | None = None) -> tuple[dict[str, np.ndarray], FullBatchGap | None]:
    """On a float64 twin of a user's ``block``: the accumulated gradient over ``batches`` (the
    oracle: the manual pass's E), and where ``whole`` (the batches joined into one, ``join``) is
    given, its ``full_batch_gap``. ``micro_of(block, get_batch)`` is the check's micro-step on
    another block."""
    steps = len(batches)
    joined = None if whole is None else to_float64(whole)
    twin = float64_twin(block)
    params = {name: p for name, p in unique_params(twin)[0].items() if materialised(p) and p.grad_req != "null"}
    counts = [item_count(b, loss_fn_given) for b in batches]

    def passes(train: bool) -> tuple[dict[str, np.ndarray], FullBatchGap | None]:
        with layers_for_check(twin, train):
            micro = micro_of(twin, lambda k: to_float64(batches[k]))
            _, exact, _, _, _ = manual_pass(params, micro, steps, ctx, progress, counts={})
            accumulated = {name: np.asarray(g, np.float64) for name, g in exact.items()}
            if joined is None:
                return accumulated, None
            return accumulated, full_batch_gap(params, micro_of(twin, lambda _: joined), accumulated, loss_reduction,
                                               steps, None if None in counts else counts, ctx)

    accumulated, gap = passes(train_mode)
    # BatchNorm on each micro-batch's own statistics makes the window differ from one batch by
    # design: named, and the rest judged again on the running statistics
    by_design = batch_norm_layers(twin) if train_mode and gap is not None else []
    if by_design:
        gap.hypotheses = Hypotheses(by_design=by_design, rest=passes(False)[1])
    return accumulated, gap


def batch_norm_layers(block: Any) -> list[str]:
    """The BatchNorm layers of ``block`` as "BatchNorm 'batchnorm0'" (class and name)."""
    found: list[str] = []
    block.apply(lambda layer: found.append(f"{type(layer).__name__} '{layer.name}'")
                if isinstance(layer, BATCH_NORM) else None)
    return found


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
