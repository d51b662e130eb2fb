"""``accumcheck train`` on MXNet Gluon: K optimizer steps with ``gluon.Trainer`` from the same
weights, manual's training with native accumulation and a control fed the same micro-batches at
manual's parameters, as apache/mxnet#16686 describes the two loops.

Manual, the report's workaround, trains: ``grad_req='write'``, each micro-step's ``p.grad()``
added into a float32 buffer, the buffer written back into the gradient before ``trainer.step()``.
Native: a second block, given manual's parameters before each window, runs the window with
``grad_req='add'`` (the gradients zeroed first); its summed gradients step parameters of native's
own. The control: manual's micro-gradients (the same values) added into the buffer last to first
step the control's own parameters: another valid order. Each of the three has a Trainer of its own
from the same start, so native and the control differ from manual by their accumulation alone, and
what their optimizers make of it; never by gradients taken at other parameters, whose kinks would
set trajectories apart whatever the accumulation. All call ``trainer.step(N)`` where the loss is
each micro-batch's mean (the window's mean gradient, N a power of two in every built-in case: an
exact rescale) and ``trainer.step(1)`` where the loss is already normalised over the window or is
a sum. With the oracle a float64 copy of the model trains too. ``dtype`` float16 runs the
parameters in float16; ``multi_precision`` gives the optimizer float32 master weights, which
changes the update's rounding and not the gradients: grad_req='add' still sums them in float16.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mxnet import gluon

from ..case.definition import Case
from ..report import TrajectoryReport
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.trajectory import MODES, Trajectory
from .casemodel import case_step, prepared, resolve_context
from .library import mx
from .passes import StepFn, micro_steps, native_pass, set_grad_req


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
                "native": "grad_req='add', zero_grad() before each window, at manual's parameters",
                "manual": "grad_req='write', acc[:] += p.grad(), p.grad()[:] = acc before trainer.step()",
                "control": "manual's micro-steps' p.grad() added into acc last to first",
                "params": dtype, "hybridize": str(hybridize)}
    blocks = {mode: prepared(case, weights, dtype, ctx, hybridize) for mode in MODES}  # manual's runs
    feeder = prepared(case, weights, dtype, ctx, hybridize)  # native's window, at manual's parameters
    twin = prepared(case, weights, "float64", ctx, hybridize) if config.oracle else None

    def trainer(block: Any, mp: bool = multi_precision) -> Any:
        return gluon.Trainer(list(block.canonical.values()), optimizer,
                             {"learning_rate": lr, "multi_precision": mp})

    trainers = {mode: trainer(block) for mode, block in blocks.items()}
    if twin is not None:
        trainers["float64"] = trainer(twin, False)
    trace = Trajectory({p.name: p.kind for p in case.parameters()}, oracle=twin is not None)
    manual = blocks["manual"]
    for k in range(steps):
        for name, param in feeder.canonical.items():
            param.set_data(manual.canonical[name].data())
        # An injected fault hits micro-step N//2 of every optimizer step.
        native, _, _ = native_pass(feeder.canonical, _window(case, feeder, ctx, dtype, n, k), n, ctx, fault, None)
        kept, loss = _write_pass(manual.canonical, _window(case, manual, ctx, dtype, n, k), n)
        trace.loss("manual", k, loss)
        totals = {"native": native, "manual": _summed(kept, manual.canonical), "control": _summed(kept[::-1],
                                                                                               manual.canonical)}
        for mode, block in blocks.items():
            for name, param in block.canonical.items():
                param.grad()[:] = totals[mode][name]  # in the gradient's dtype, as the workaround writes it
                for data in param.list_data():
                    data._fresh_grad = True  # native's and the control's own parameters ran no backward
            trainers[mode].step(rescale)
        if twin is not None:
            twin = _float64_step(twin, trainers["float64"], _window(case, twin, ctx, "float64", n, k), n, ctx,
                                 rescale, trace, k, settings)
        trace.record(k, *(_host(blocks[mode]) for mode in MODES), _host(twin) if twin is not None else None)
        if progress is not None:
            progress("train", k + 1, steps)
    return trace.report(case.name, optimizer, lr, n, steps, fault, versions, settings)


def _write_pass(params: dict[str, Any], step: StepFn, accum_steps: int) -> tuple[list[dict[str, np.ndarray]], float]:
    """grad_req='write', each micro-step's p.grad() kept (on the host); returns them and the mean
    loss."""
    set_grad_req(params, {}, "write", None)
    kept: list[dict[str, np.ndarray]] = []
    losses: list[Any] = []
    for _ in micro_steps(step, accum_steps, losses):
        kept.append({name: p.grad().asnumpy() for name, p in params.items()})
    return kept, float(losses[1].asscalar()) / accum_steps


def _summed(kept: list[dict[str, np.ndarray]], params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The micro-gradients ``kept`` added into float32 buffers in the order given (acc[:] += p.grad())."""
    totals = {}
    for name, param in params.items():
        buffer = np.zeros(param.shape, np.float32)
        for grads in kept:
            buffer += grads[name].astype(np.float32)
        totals[name] = buffer
    return totals


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

