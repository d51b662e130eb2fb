"""A single-process run: the case's N micro-steps with native and manual accumulation (and the
float64 model with the oracle, and the full batch), as the RunResult the judge reads."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from ..case.definition import Case
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.results import ParamAccumulation, RunResult
from .casemodel import build_model, case_loss, deterministic, isolated, resolve_device, to_inputs, to_numpy
from .fullbatch import full_batch_gap
from .judging import device_arrays, judged_on_device
from .passes import case_sums


def run_single(config: RunConfig, versions: dict[str, str], progress: Progress | None = None,
               weights: dict[str, np.ndarray] | None = None) -> RunResult:
    case = config.case
    dev = resolve_device(config.device)
    dtype, accum = getattr(torch, config.dtype), getattr(torch, config.accum_dtype)
    weights = case.weights() if weights is None else weights
    kinds = {p.name: p.kind for p in case.parameters()}
    with deterministic(dev) as settings, isolated(dev):
        model = build_model(case, weights, dtype, dev)
        sums = case_sums(case, model, config.accum_steps, dev, config.fault, progress, "native + manual", accum,
                         config.mode)
        exact_oracle = None
        if config.oracle:
            model64 = build_model(case, weights, torch.float64, dev)
            exact_oracle = case_sums(case, model64, config.accum_steps, dev, None, progress, "float64 oracle")
        logits = to_numpy(sums["first_logits"])
        params = []
        for name in model.canonical:
            manual, exact, absum = sums["buffers"][name]
            params.append(ParamAccumulation(
                name=name, kind=kinds[name], **arrays(sums["native"][name], manual, exact, absum),
                oracle=None if exact_oracle is None else to_numpy(exact_oracle["native"][name])))
    gap = None
    if config.full_batch:
        with deterministic(dev), isolated(dev):
            gap = full_batch_gap(case, weights, config.accum_steps, dev, progress)
    losses = {"mean_loss": sums["loss"]}
    if exact_oracle is not None:
        losses["oracle_mean_loss"] = exact_oracle["loss"]
    return _result(config, params, versions, dev, losses, settings, logits, gap)


def arrays(native: Any, manual: Any, exact: Any, absum: Any) -> dict[str, Any]:
    """ParamAccumulation's arrays: judged where they are on a GPU (only scalars come back), host
    copies for the compiled host kernel on the CPU."""
    if judged_on_device(native.device):
        return device_arrays(native, manual, exact, absum)
    return dict(native=to_numpy(native), manual=to_numpy(manual), exact=to_numpy(exact), absum=to_numpy(absum))


def _result(config: RunConfig, params: list[ParamAccumulation], versions: dict[str, str], dev: Any,
            losses: dict[str, float], settings: dict[str, Any], logits: np.ndarray | None, gap: Any = None) -> RunResult:
    return RunResult(params=params, framework="torch", versions=versions, device=device_name(dev),
                     # the GradAccumulator sums in float32, whatever the parameters' dtype
                     param_dtype=config.dtype if config.mode == "native" else "float32", accum_dtype=config.accum_dtype,
                     losses=losses, settings=settings, first_logits=logits, full_batch=gap)


def run_groups(config: RunConfig, groups: list[list[str]], versions: dict[str, str],
               progress: Progress | None = None) -> Iterator[RunResult]:
    """``run_single`` once per group of tensors (``Backend.run_groups``): one model, its ``.grad``
    cleared and the random state as found before each group's N micro-steps, hooks and buffers
    for that group's parameters only."""
    case = config.case
    dev = resolve_device(config.device)
    dtype, accum = getattr(torch, config.dtype), getattr(torch, config.accum_dtype)
    kinds = {p.name: p.kind for p in case.parameters()}
    with isolated(dev):
        model = build_model(case, case.weights(), dtype, dev)
    for index, names in enumerate(groups):
        with deterministic(dev) as settings, isolated(dev):
            for param in model.parameters():
                param.grad = None
            group = {name: model.canonical[name] for name in names}
            fault = config.fault if config.fault is not None and config.fault.param in group else None
            sums = case_sums(case, model, config.accum_steps, dev, fault, progress,
                             f"native + manual, group {index + 1} of {len(groups)}", accum, config.mode, group)
            params = [ParamAccumulation(name=name, kind=kinds[name], **arrays(sums["native"][name], *sums["buffers"][name]))
                      for name in names]
            result = _result(config, params, versions, dev, {"mean_loss": sums["loss"]}, settings,
                             to_numpy(sums["first_logits"]) if index == 0 else None)
            del sums, params, group
        yield result
        del result  # before the next group runs


def micro_gradients(config: RunConfig, names: list[str], progress: Progress | None = None,
                    weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The run's micro-gradients of the tensors ``names`` again, one micro-step at a time: the same
    model, batches and settings as ``run_single``, no fault, ``.grad`` cleared before each step."""
    case, steps = config.case, config.accum_steps
    dev = resolve_device(config.device)
    dtype = getattr(torch, config.dtype)
    weights = case.weights() if weights is None else weights
    total = case.token_count(steps) if case.loss_reduction == "token_count" else None
    with deterministic(dev), isolated(dev):
        model = build_model(case, weights, dtype, dev)
        params = model.canonical
        for step in range(steps):
            for param in params.values():
                param.grad = None
            batch = case.batch(step)
            labels = torch.from_numpy(batch.labels).to(dev)
            case_loss(case, model(to_inputs(batch.inputs, dev, dtype), batch.index), labels, total).backward()
            yield {name: to_numpy(params[name].grad).copy() if params[name].grad is not None
                   else np.zeros(tuple(params[name].shape), np.float32) for name in names}
            if progress is not None:
                progress("second pass: the flagged tensors' micro-gradients", step + 1, steps)


def device_name(dev: Any) -> str:
    return f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "cpu"


def float64_oracle(case: Case, weights: dict[str, np.ndarray], accum_steps: int, device: str,
                   progress: Progress | None = None) -> tuple[dict[str, np.ndarray], float]:
    """Accumulated gradients of the whole model in float64, and its mean loss (for other backends)."""
    dev = resolve_device(device)
    with deterministic(dev), isolated(dev):
        model = build_model(case, weights, torch.float64, dev)
        result = case_sums(case, model, accum_steps, dev, None, progress, "float64 oracle (torch)")
    return {name: to_numpy(g) for name, g in result["native"].items()}, result["loss"]
