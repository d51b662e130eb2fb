"""Check gradient accumulation on your own MXNet Gluon block.

    import accumcheck.mxnet
    report = accumcheck.mxnet.check(net, loss_fn, batches, accum_steps=16, ctx=mx.cpu())
    assert report.exit_code == 0, [t.name for t in report.flagged]

The block runs once with ``grad_req='add'`` and once with ``grad_req='write'`` plus a buffer, on
the same batches; each parameter tensor is judged as ``accumcheck compare`` judges a case. The
block's parameters, their ``grad_req`` and their gradients are as they were afterwards.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ...backend import ParamAccumulation, Progress, RunResult
from ...cases import infer_kind
from ...errors import AccumcheckError
from ...faults import parse_fault, resolve_fault
from ...judge import build_report
from ...report import Report
from ...usermodel import Batch, batch_source
from .library import mx
from .passes import manual_pass, native_pass
from .run import KERNEL_ALLOWANCE


def check(block: Any, loss_fn: Callable[[Any, Any], Any], batches: Sequence[Batch] | Iterable[Batch] | Callable[[int], Batch],
          accum_steps: int | None = None, ctx: Any = None, inject: str | None = None,
          progress: Progress | None = None) -> Report:
    """Accumulate ``accum_steps`` micro-batches natively and by hand, and judge every parameter.

    ``block`` is an initialised Gluon Block (hybridized or not); ``loss_fn(output, label)`` returns
    the loss NDArray whose ``backward()`` gives the gradients; ``batches`` is a sequence or
    iterable of ``(data, label)`` pairs (the first ``accum_steps`` are used; default all) or a
    function of the micro-step index. ``ctx`` defaults to the parameters' first context.
    ``inject`` (e.g. ``"scale"`` or ``"drop-step:dense0_weight"``) perturbs the native
    accumulation to prove the check fires. Returns a Report; raises AccumcheckError for bad input.
    """
    started = time.perf_counter()
    params = {name: p for name, p in block.collect_params().items() if p.grad_req != "null"}
    if not params:
        raise AccumcheckError("check: the block has no parameter with a gradient (all grad_req='null')")
    get_batch, steps = batch_source(batches, accum_steps)
    ctx = ctx if ctx is not None else next(iter(params.values())).list_ctx()[0]
    kinds = {name: infer_kind(name, len(p.shape)) for name, p in params.items()}
    fault = None
    if inject is not None:
        fault = resolve_fault(parse_fault(inject), list(kinds.items()), steps)

    def step(index: int) -> tuple[Any, Any]:
        data, label = get_batch(index)
        out = block(data.as_in_context(ctx))
        return loss_fn(out, label.as_in_context(ctx)), out

    saved = _save(params)
    refresh = getattr(block, "_clear_cached_op", None)  # a hybridized block rebuilds its graph for the new grad_req
    try:
        native, native_loss, _ = native_pass(params, step, steps, ctx, fault, progress, refresh=refresh)
        manual, exact, absum, manual_loss, _ = manual_pass(params, step, steps, ctx, progress, refresh=refresh)
    finally:
        _restore(params, saved, refresh)
    run = RunResult(
        params=[ParamAccumulation(name, kinds[name], native[name], manual[name], exact[name], absum[name])
                for name in params],
        framework="mxnet", versions={"mxnet": mx.__version__}, device=str(ctx),
        param_dtype=np.dtype(next(iter(params.values())).dtype).name,
        accum_dtype="float32", native_kernel_allowance=KERNEL_ALLOWANCE,
        losses={"mean_loss": native_loss, "manual_mean_loss": manual_loss},
        settings={"hybridize": bool(getattr(block, "_active", False))},
        notes=["hybridized" if getattr(block, "_active", False) else "imperative"])
    return build_report(None, run, steps, fault, False, time.perf_counter() - started,
                        config={"model": type(block).__name__})


def _save(params: dict[str, Any]) -> dict[str, tuple[str, list[Any]]]:
    saved = {}
    for name, p in params.items():
        grads = [g.copy() for g in p.list_grad()] if p.grad_req != "null" else []
        saved[name] = (p.grad_req, grads)
    return saved


def _restore(params: dict[str, Any], saved: dict[str, tuple[str, list[Any]]], refresh: Callable[[], None] | None) -> None:
    for name, p in params.items():
        req, grads = saved[name]
        p.grad_req = req
        for target, value in zip(p.list_grad(), grads):
            target[:] = value
    if refresh is not None:
        refresh()
