"""``accumcheck train`` on MXNet Gluon: K optimizer steps with ``gluon.Trainer`` from the same
weights, native against manual accumulation, as apache/mxnet#16686 describes them.

Native: ``grad_req='add'``, the gradients zeroed before each window of N micro-steps, then
``trainer.step()``. Manual, the report's workaround: ``grad_req='write'``, each micro-step's
``p.grad()`` added into a buffer, the buffer written back into the gradient before
``trainer.step()``. Both call ``trainer.step(N)`` where the loss is each micro-batch's mean (the
window's mean gradient, N a power of two in every built-in case: an exact rescale) and
``trainer.step(1)`` where the loss is already normalised over the window or is a sum. With the
oracle a float64 copy of the model trains too. ``dtype`` float16 runs the parameters in float16;
``multi_precision`` gives the optimizer float32 master weights, which changes the update's
rounding and not the gradients: grad_req='add' still sums them in float16.
"""

from __future__ import annotations

from typing import Any

from mxnet import gluon

from ..case.definition import Case
from ..report import TrajectoryReport
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.trajectory import Trajectory
from .casemodel import case_step, prepared, resolve_context
from .library import mx
from .passes import StepFn, manual_pass, native_pass


def train(config: RunConfig, steps: int, optimizer: str, lr: float, versions: dict[str, str],
          progress: Progress | None = None) -> TrajectoryReport:
    """Run ``steps`` optimizer steps of the configured case natively and manually (and in
    float64 with the oracle), each over ``config.accum_steps`` micro-steps."""
    case, n, fault = config.case, config.accum_steps, config.fault
    ctx = resolve_context(config.device)
    hybridize = config.option("hybridize", True)
    dtype = config.dtype
    multi_precision = bool(config.option("multi_precision", False))
    weights = case.weights()
    rescale = n if case.loss_reduction == "mean" else 1
    settings = {"trainer": f"gluon.Trainer(params, {optimizer!r}, {{'learning_rate': {lr:g}"
                           f"{', ' + repr('multi_precision') + ': True' if multi_precision else ''}}})",
                "optimizer step": f"trainer.step({rescale})",
                "native": "grad_req='add', zero_grad() before each window",
                "manual": "grad_req='write', acc[:] += p.grad(), p.grad()[:] = acc before trainer.step()",
                "params": dtype, "hybridize": str(hybridize)}
    native = prepared(case, weights, dtype, ctx, hybridize)
    manual = prepared(case, weights, dtype, ctx, hybridize)
    twin = prepared(case, weights, "float64", ctx, hybridize) if config.oracle else None

    def trainer(block: Any, mp: bool = multi_precision) -> Any:
        return gluon.Trainer(list(block.canonical.values()), optimizer,
                             {"learning_rate": lr, "multi_precision": mp})

    trainers = {"native": trainer(native), "manual": trainer(manual)}
    if twin is not None:
        trainers["float64"] = trainer(twin, False)
    trace = Trajectory({p.name: p.kind for p in case.parameters()}, oracle=twin is not None)
    for k in range(steps):
        # An injected fault hits micro-step N//2 of every optimizer step.
        grads, loss, _ = native_pass(native.canonical, _window(case, native, ctx, dtype, n, k), n, ctx, fault, None)
        if fault is not None:  # the faulted total, as the injector accumulated it
            native.canonical[fault.param].grad()[:] = grads[fault.param]
        trainers["native"].step(rescale)
        trace.loss("native", k, loss)
        buffers, _, _, loss, _ = manual_pass(manual.canonical, _window(case, manual, ctx, dtype, n, k), n, ctx, None,
                                             accum_dtype="float32")
        for name, param in manual.canonical.items():
            param.grad()[:] = buffers[name]  # written back in the gradient's dtype, as the workaround does
        trainers["manual"].step(rescale)
        trace.loss("manual", k, loss)
        if twin is not None:
            twin = _float64_step(twin, trainers["float64"], _window(case, twin, ctx, "float64", n, k), n, ctx,
                                 rescale, trace, k, settings)
        trace.record(k, _host(native), _host(manual), _host(twin) if twin is not None else None)
        if progress is not None:
            progress("train", k + 1, steps)
    return trace.report(case.name, optimizer, lr, n, steps, fault, versions, settings)


def _window(case: Case, block: Any, ctx: Any, dtype: str, accum_steps: int, window: int) -> StepFn:
    """Micro-step ``i`` of optimizer step ``window``: the case's micro-batch ``window * N + i``."""
    step = case_step(case, block, ctx, dtype, accum_steps)
    return lambda index: step(window * accum_steps + index)


def _float64_step(twin: Any, trainer: Any, step: StepFn, accum_steps: int, ctx: Any, rescale: int,
                  trace: Trajectory, k: int, settings: dict[str, str]) -> Any:
    """One optimizer step of the float64 model; None (no oracle from here on, the settings say
    why) where MXNet lacks a float64 kernel for one of the case's operators."""
    try:
        _, loss, _ = native_pass(twin.canonical, step, accum_steps, ctx, None, None, phase="float64")
        trainer.step(rescale)
        mx.nd.waitall()  # an operator without a float64 kernel fails here, not later
    except mx.base.MXNetError as exc:
        reason = str(exc).strip().splitlines()[0][:160]
        settings["oracle"] = f"none from step {k}: MXNet float64 failed ({reason})"
        trace.oracle_diff.clear()
        return None
    trace.loss("float64", k, loss)
    return twin


def _host(block: Any) -> dict[str, Any]:
    return {name: p.data().asnumpy() for name, p in block.canonical.items()}

