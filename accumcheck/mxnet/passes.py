"""MXNet's two passes: native (``grad_req='add'``) and manual (``grad_req='write'`` plus a buffer).

MXNet cannot give both modes from one backward pass: the mode is a property of the parameter. So
a run makes two passes from the same weights and batches: the native pass with ``grad_req='add'``
(gradients zeroed once, then N micro-steps), the manual pass with ``grad_req='write'`` where each
micro-step's ``p.grad()`` is added into a buffer (``acc[:] += p.grad()``, as users write it) and
into the float64 sums E and S.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
from mxnet import autograd

from ..judge.hostsums import add_step
from ..run.backend import Progress
from ..run.faults import Fault, FaultInjector, round_to_bfloat16
from .library import mx

# A step function runs one micro-step's forward under autograd.record() and returns (loss, output).
StepFn = Callable[[int], tuple[Any, Any]]


def set_grad_req(params: dict[str, Any], req: dict[str, str], default: str, refresh: Callable[[], None] | None) -> None:
    for name, param in params.items():
        param.grad_req = req.get(name, default)
    if refresh is not None:
        refresh()


def native_pass(params: dict[str, Any], step: StepFn, accum_steps: int, ctx: Any, fault: Fault | None,
                progress: Progress | None, phase: str = "native: grad_req='add'",
                refresh: Callable[[], None] | None = None) -> tuple[dict[str, np.ndarray], float, Any]:
    """grad_req='add', zeroed once, N micro-steps. Returns the gradients, the mean loss and the
    output of micro-step 0. A faulted parameter is accumulated by the fault injector instead,
    from its exact micro-gradients (grad_req='write')."""
    target = fault.param if fault is not None else None
    set_grad_req(params, {target: "write"} if target else {}, "add", refresh)
    for param in params.values():
        param.zero_grad()
    injector = None
    if fault is not None:
        injector = FaultInjector(fault, accum_steps,
                                 lambda t: mx.nd.array(round_to_bfloat16(t.asnumpy()), ctx=ctx, dtype=t.dtype))
    total = None
    losses: list[Any] = []
    for index, _ in micro_steps(step, accum_steps, losses):
        if injector is not None:
            grad = params[target].grad().copy()
            contribution = injector.contribution(index, grad, total)
            total = contribution.copy() if total is None else total + contribution
            replaced = injector.after_add(index, total)
            total = total if replaced is None else replaced
        if progress is not None:
            progress(phase, index + 1, accum_steps)
    grads = {name: p.grad().asnumpy() for name, p in params.items()}
    if target is not None:
        grads[target] = total.asnumpy()
    return grads, float(losses[1].asscalar()) / accum_steps, losses[0]


def manual_pass(params: dict[str, Any], step: StepFn, accum_steps: int, ctx: Any, progress: Progress | None,
                refresh: Callable[[], None] | None = None,
                counts: dict[str, int] | None = None,
                accum_dtype: str | None = None) -> tuple[dict, dict, dict, float, np.ndarray]:
    """grad_req='write'; each micro-step's p.grad() goes into acc (``accum_dtype``, default the
    parameter's), E and S (float64). Returns acc, E, S (numpy), the mean loss and the output of
    micro-step 0 (numpy). With
    ``counts`` every gradient is zeroed before each micro-step and counts[name] becomes the number
    of micro-steps whose gradient was not all zero."""
    set_grad_req(params, {}, "write", refresh)
    # grad_req='write' leaves the gradient of a parameter outside this micro-step's graph as it was.
    zero = counts is not None
    hits = {name: 0 for name in params} if zero else None
    if zero:
        for param in params.values():
            param.zero_grad()
    # On the CPU each gradient is added by one compiled pass into numpy buffers (MXNet's
    # elementwise operators and concat are slow there); on a GPU the adds stay on the device.
    # Element by element both are acc[name][:] += p.grad().
    on_cpu = ctx.device_type == "cpu"
    if on_cpu:
        acc = {name: np.zeros(p.shape, np.dtype(accum_dtype or p.dtype)) for name, p in params.items()}
        exact = {name: np.zeros(p.shape, np.float64) for name, p in params.items()}
        absum = {name: np.zeros(p.shape, np.float64) for name, p in params.items()}
    else:
        acc = {name: mx.nd.zeros(p.shape, ctx=ctx, dtype=accum_dtype or p.dtype) for name, p in params.items()}
        exact = {name: mx.nd.zeros(p.shape, ctx=ctx, dtype="float64") for name, p in params.items()}
        absum = {name: mx.nd.zeros(p.shape, ctx=ctx, dtype="float64") for name, p in params.items()}
    losses: list[Any] = []
    pending: dict[str, Any] = {}
    for index, _ in micro_steps(step, accum_steps, losses):
        if on_cpu:
            # Copy on MXNet's engine, read on the host one micro-step later: the host waits for a
            # gradient only while the engine already runs the next micro-step.
            _add_on_host(pending, acc, exact, absum, hits)
            pending = {name: param.grad().copy() for name, param in params.items()}
        else:
            for name, param in params.items():
                grad = param.grad()
                acc[name][:] += grad.astype(acc[name].dtype, copy=False)
                wide = grad.astype("float64")
                exact[name][:] += wide
                absum[name][:] += mx.nd.abs(wide)
                if zero:
                    hits[name] = hits[name] + (grad != 0).max()
        if zero:
            for param in params.values():
                param.zero_grad()
        if progress is not None:
            progress("manual: grad_req='write' + buffer", index + 1, accum_steps)
    _add_on_host(pending, acc, exact, absum, hits)
    if zero:
        counts.update({name: int(hit if isinstance(hit, int) else hit.asscalar()) for name, hit in hits.items()})

    def split(values: dict[str, Any]) -> dict[str, np.ndarray]:
        return values if on_cpu else {name: v.asnumpy() for name, v in values.items()}

    first, loss_sum = losses
    logits = first.asnumpy() if hasattr(first, "asnumpy") else None
    return split(acc), split(exact), split(absum), float(loss_sum.asscalar()) / accum_steps, logits


def micro_steps(step: StepFn, accum_steps: int, losses: list[Any]) -> Iterator[tuple[int, Any]]:
    """Forward under autograd.record() and backward, micro-step by micro-step; yields (index,
    output). Leaves [output of micro-step 0, summed mean loss] in ``losses`` (NDArrays)."""
    losses[:] = [None, None]
    for index in range(accum_steps):
        with autograd.record():
            loss, out = step(index)
        loss.backward()
        losses[1] = loss.mean() if losses[1] is None else losses[1] + loss.mean()
        if index == 0:
            losses[0] = out
        yield index, out


def _add_on_host(grads: dict[str, Any], acc: dict, exact: dict, absum: dict, hits: dict[str, Any] | None) -> None:
    for name, grad in grads.items():
        flat = grad.asnumpy().reshape(-1)
        if flat.dtype == np.float16:  # the compiled adds take float32 (which holds every float16)
            flat = flat.astype(np.float32)
        add_step(flat, acc[name].reshape(-1), exact[name].reshape(-1), absum[name].reshape(-1))
        if hits is not None and flat.any():
            hits[name] += 1
