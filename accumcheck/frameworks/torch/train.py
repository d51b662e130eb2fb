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

import math
from typing import Any

import numpy as np
import torch

from ...backend import Progress
from ...config import RunConfig
from ...report import TrajectoryReport
from .accumulate import accumulate
from .model import build_model, case_loss, deterministic, isolated, resolve_device, to_inputs

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

    losses: dict[str, list[float]] = {"native": [], "manual": []}
    diffs: dict[str, list[float]] = {k: [] for k in sorted(set(kinds.values()))}
    ratios: dict[str, list[float]] = {k: [] for k in diffs}
    oracle_diff: dict[str, list[float]] = {k: [] for k in diffs} if oracle else {}
    first_out: dict[str, int] = {}
    non_finite: dict[str, int] = {}
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
                losses["native"].append(result["loss"])
                opt_native.step()
                losses["manual"].append(_manual_step(manual, step_loss(manual, k), n))
                opt_manual.step()
                if twin is not None:
                    losses.setdefault("float64", []).append(
                        accumulate(twin.canonical, step_loss(twin, k), n, None, None, "float64")["loss"])
                    opt_twin.step()
            except RuntimeError as exc:
                if "overflow" not in str(exc):
                    raise
                # torch refuses an update past float32's range (Adam's lr / bias correction): the
                # run has left finite numbers at this step; the steps after it are not run
                non_finite.setdefault("optimizer update (overflow)", k)
                break
            for mode, trace in losses.items():
                if not math.isfinite(trace[-1]):
                    non_finite.setdefault(f"loss ({mode})", k)
            per_kind: dict[str, float] = {}
            per_ratio: dict[str, float] = {}
            broken: set[str] = set()  # kinds with a non-finite tensor: their figures are nan
            per_oracle: dict[str, float] = {}
            for name, p in native.canonical.items():
                a, b = p.detach().double(), manual.canonical[name].detach().double()
                if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                    non_finite.setdefault(name, k)
                    broken.add(kinds[name])
                    continue  # a difference of inf or nan is no distance from the band
                diff = float((a - b).abs().max())
                band = float(np.spacing(np.float32(a.abs().max())))
                kind = kinds[name]
                per_kind[kind] = max(per_kind.get(kind, 0.0), diff)
                per_ratio[kind] = max(per_ratio.get(kind, 0.0), diff / band if band else 0.0)
                if diff > band and name not in first_out:
                    first_out[name] = k
                if twin is not None:
                    gap = float((a - twin.canonical[name].detach()).abs().max())
                    per_oracle[kind] = max(per_oracle.get(kind, 0.0), gap)
            for kind in diffs:
                diffs[kind].append(math.nan if kind in broken else per_kind.get(kind, 0.0))
                ratios[kind].append(math.nan if kind in broken else per_ratio.get(kind, 0.0))
                if twin is not None:
                    oracle_diff[kind].append(per_oracle.get(kind, 0.0))
            if progress is not None:
                progress("train", k + 1, steps)
    for trace in [*losses.values(), *diffs.values(), *ratios.values(), *oracle_diff.values()]:
        trace.extend([math.nan] * (steps - len(trace)))  # the steps not run, after an overflow
    return TrajectoryReport(case=the_case.name, optimizer=optimizer, lr=lr, accum_steps=n, steps=steps,
                            inject=None if fault is None else str(fault), versions=versions, losses=losses,
                            max_diff=diffs, band_ratio=ratios, first_out_of_band=first_out, oracle_diff=oracle_diff,
                            non_finite=non_finite)


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
