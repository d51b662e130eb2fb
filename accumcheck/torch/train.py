"""``accumcheck train`` on PyTorch: K optimizer steps with native and manual accumulation from the
same start.

Per-step gradient differences that are pure round-off can still grow: Adam divides by the square
root of tiny second moments, so on ~1e-10 gradients a one-ulp difference becomes a difference in
the update itself (what apache/mxnet#16686 saw: 16 accumulation steps trained, 32 diverged).
This runs the case for K steps three ways — native (``.grad`` accumulating, with any injected
fault), manual (a float32 buffer), optionally the whole model in float64 — and records, per step,
each loss and each tensor's largest parameter difference between native and manual, against a
round-off band of one float32 ulp of the tensor's largest parameter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..report import TrajectoryReport
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.trajectory import Trajectory
from .casemodel import build_model, case_loss, deterministic, isolated, resolve_device, to_inputs, to_numpy
from .passes import accumulate

OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def train(config: RunConfig, steps: int, optimizer: str, lr: float, versions: dict[str, str],
          progress: Progress | None = None) -> TrajectoryReport:
    """Run ``steps`` optimizer steps of the configured case natively and manually (and in
    float64 with the oracle), each optimizer step over ``config.accum_steps`` micro-steps."""
    the_case, n, fault = config.case, config.accum_steps, config.fault
    oracle = config.oracle
    dev = resolve_device(config.device)
    weights = the_case.weights()
    kinds = {p.name: p.kind for p in the_case.parameters()}
    make = OPTIMIZERS[optimizer]
    total = the_case.token_count(n) if the_case.loss_reduction == "token_count" else None

    def step_loss(model: Any, outer: int) -> Any:
        dtype = next(model.parameters()).dtype

        def run(micro: int) -> Any:
            batch = the_case.batch(outer * n + micro)
            labels = torch.from_numpy(batch.labels).to(dev)
            return case_loss(the_case, model(to_inputs(batch.inputs, dev, dtype), batch.index), labels, total)
        return run

    trace = Trajectory(kinds, oracle=oracle)
    with deterministic(dev), isolated(dev):
        native = build_model(the_case, weights, torch.float32, dev)
        manual = build_model(the_case, weights, torch.float32, dev)
        twin = build_model(the_case, weights, torch.float64, dev) if oracle else None
        opt_native, opt_manual = make(native.parameters(), lr=lr), make(manual.parameters(), lr=lr)
        opt_twin = make(twin.parameters(), lr=lr) if twin is not None else None
        for k in range(steps):
            # An injected fault hits micro-step N//2 of every optimizer step.
            try:
                result = accumulate(native.canonical, step_loss(native, k), n, fault, None, "native")
                trace.loss("native", k, result["loss"])
                opt_native.step()
                trace.loss("manual", k, _manual_step(manual, step_loss(manual, k), n))
                opt_manual.step()
                if twin is not None:
                    trace.loss("float64", k, accumulate(twin.canonical, step_loss(twin, k), n, None, None,
                                                        "float64")["loss"])
                    opt_twin.step()
            except RuntimeError as exc:
                if "overflow" not in str(exc):
                    raise
                # torch refuses an update past float32's range (Adam's lr / bias correction): the
                # run has left finite numbers at this step; the steps after it are not run
                trace.diverged("optimizer update (overflow)", k)
                break
            trace.record(k, _host(native), _host(manual), _host(twin) if twin is not None else None)
            if progress is not None:
                progress("train", k + 1, steps)
    return trace.report(the_case.name, optimizer, lr, n, steps, fault, versions)


def _host(model: Any) -> dict[str, np.ndarray]:
    return {name: to_numpy(p.detach()) for name, p in model.canonical.items()}


def _manual_step(model: Any, step_loss: Any, accum_steps: int) -> float:
    """zero_grad each micro-step, add into a float32 buffer, hand the sum to the optimizer."""
    params = list(model.canonical.values())
    buffers = [torch.zeros_like(p) for p in params]
    total = 0.0
    for micro in range(accum_steps):
        for p in params:
            p.grad = None
        loss = step_loss(micro)
        loss.backward()
        total += float(loss.detach())
        for buf, p in zip(buffers, params):
            if p.grad is not None:
                buf.add_(p.grad)
    for buf, p in zip(buffers, params):
        p.grad = buf
    return total / accum_steps
