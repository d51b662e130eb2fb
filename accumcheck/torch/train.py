"""``accumcheck train`` on PyTorch: K optimizer steps of manual accumulation, with native
accumulation and a control fed the very same micro-gradients, each stepping parameters of its own.

Per-step gradient differences that are pure round-off can still grow: Adam divides by the square
root of tiny second moments, so on ~1e-10 gradients a one-ulp difference becomes a difference in
the update itself (what apache/mxnet#16686 saw: 16 accumulation steps trained, 32 diverged).
Manual (a float32 buffer, zeroed ``.grad`` each micro-step) trains the case for K steps. In each
micro-step's one backward pass ``.grad`` also accumulates natively (with any injected fault) and
the micro-gradient is kept; after the window native's total steps native's parameters, and the kept
micro-gradients added last to first (the control: another valid order) step the control's, each
with an optimizer of its own from the same start. So native and the control differ from manual by
their accumulation alone, and what their optimizers make of it over the steps; never by gradients
taken at other parameters, whose kinks (a ReLU that flips) would set trajectories apart whatever
the accumulation. With the oracle the whole model trains in float64 beside them. Per step the
parameters go to ``accumcheck.run.trajectory``, which judges them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..report import TrajectoryReport
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.trajectory import MODES, Trajectory
from .casemodel import build_model, case_loss, deterministic, isolated, resolve_device, to_inputs, to_numpy
from .passes import accumulate

OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def train(config: RunConfig, steps: int, optimizer: str, lr: float, versions: dict[str, str],
          progress: Progress | None = None) -> TrajectoryReport:
    """Run ``steps`` optimizer steps of the configured case, each over ``config.accum_steps``
    micro-steps: manual's training, native and the control fed its micro-gradients (and the
    float64 model with the oracle)."""
    the_case, n, fault = config.case, config.accum_steps, config.fault
    dev = resolve_device(config.device)
    weights = the_case.weights()
    make = OPTIMIZERS[optimizer]
    total = the_case.token_count(n) if the_case.loss_reduction == "token_count" else None

    def step_loss(model: Any, outer: int) -> Any:
        dtype = next(model.parameters()).dtype

        def run(micro: int) -> Any:
            batch = the_case.batch(outer * n + micro)
            labels = torch.from_numpy(batch.labels).to(dev)
            return case_loss(the_case, model(to_inputs(batch.inputs, dev, dtype), batch.index), labels, total)
        return run

    trace = Trajectory({p.name: p.kind for p in the_case.parameters()}, oracle=config.oracle)
    with deterministic(dev), isolated(dev):
        # manual's model runs every forward and backward; native's and the control's hold parameters only
        models = {mode: build_model(the_case, weights, torch.float32, dev) for mode in MODES}
        if config.oracle:
            models["float64"] = build_model(the_case, weights, torch.float64, dev)
        optimizers = {mode: make(model.parameters(), lr=lr) for mode, model in models.items()}
        settings = {"manual": "zeroed .grad each micro-step, added into a float32 buffer",
                    "native": ".grad accumulating over manual's backward passes (any fault injected there)",
                    "control": "manual's micro-gradients added into a float32 buffer last to first",
                    "optimizer": f"torch.optim.{make.__name__}(lr={lr:g}), one for each"}
        for k in range(steps):
            # An injected fault hits micro-step N//2 of every optimizer step.
            totals, loss = _window(models["manual"], step_loss(models["manual"], k), n, fault)
            trace.loss("manual", k, loss)
            if "float64" in models:
                twin = models["float64"]
                trace.loss("float64", k, accumulate(twin.canonical, step_loss(twin, k), n, None, None,
                                                    "float64")["loss"])
            overflowed = False
            for mode, model in models.items():
                for name, param in model.canonical.items():
                    if mode in totals:
                        param.grad = totals[mode][name]
                try:
                    optimizers[mode].step()
                except RuntimeError as exc:
                    if "overflow" not in str(exc):
                        raise
                    # torch refuses an update past float32's range (Adam's lr / bias correction): the
                    # run has left finite numbers at this step; the steps after it are not run
                    trace.diverged("optimizer update (overflow" + ("" if mode == "native" else f", {mode}") + ")", k,
                                   mode)
                    overflowed = True
            if overflowed:
                break
            trace.record(k, *(_host(models[mode]) for mode in MODES),
                         _host(models["float64"]) if config.oracle else None)
            if progress is not None:
                progress("train", k + 1, steps)
    return trace.report(the_case.name, optimizer, lr, n, steps, fault, versions, settings)


def _window(model: Any, step_loss: Any, accum_steps: int, fault: Any) -> tuple[dict[str, dict[str, Any]], float]:
    """One window of micro-steps on manual's model, one backward pass each: ``.grad`` accumulates
    natively (the fault, if any, injected into it) while a hook keeps each micro-gradient as it
    arrives. Returns each mode's total by name (manual: the micro-gradients added first to last,
    the control: last to first, both into a float32 buffer) and the mean loss."""
    params = model.canonical
    kept: dict[str, list[Any]] = {name: [] for name in params}
    # registered before ``accumulate``'s hooks: each sees the micro-gradient before any fault touches it
    handles = [param.register_hook(lambda grad, name=name: kept[name].append(grad.detach().clone()))
               for name, param in params.items()]
    try:
        result = accumulate(params, step_loss, accum_steps, fault, None, "native")
    finally:
        for handle in handles:
            handle.remove()
    totals: dict[str, dict[str, Any]] = {"native": {name: g.detach().clone() for name, g in result["native"].items()}}
    for mode, order in (("manual", lambda grads: grads), ("control", lambda grads: grads[::-1])):
        totals[mode] = {}
        for name, param in params.items():
            buffer = torch.zeros_like(param)
            for grad in order(kept[name]):
                buffer.add_(grad)
            totals[mode][name] = buffer
    return totals, result["loss"]


def _host(model: Any) -> dict[str, np.ndarray]:
    return {name: to_numpy(p.detach()) for name, p in model.canonical.items()}
