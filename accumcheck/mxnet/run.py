"""A run on MXNet: the native pass, the manual pass and (with the oracle) the float64 model, as the
RunResult the judge reads. Both passes are hybridized (``static_alloc=True``, as in the original
bug reports) unless asked not to be."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case.definition import Case
from ..run.backend import Progress
from ..run.budget import TensorNeed, element_bytes, need
from ..run.config import RunConfig
from ..run.results import ParamAccumulation, RunResult
from .accumulator import accumulator_pass
from .casemodel import float16_on_cpu, resolve_context
from .fullbatch import full_batch_gap
from .library import mx
from .passes import case_step, manual_pass, micro_steps, native_pass, prepared, set_grad_req

# With grad_req='add' MXNet's backward kernels write into the gradient with kAddTo: the embedding
# backward, for one, adds each token's row straight into the running total, so a micro-step's inner
# terms are rounded at their own scale, which cancellation can make far larger than the
# micro-gradient. The native bound carries this allowance (in units of u, at the tensor's scale;
# bounds.ModeBound); docs/maths.md quotes the largest need measured on the built-in cases
# (ci/figures.py regenerates it).
KERNEL_ALLOWANCE = 4.0


def run(config: RunConfig, versions: dict[str, str], progress: Progress | None = None,
        weights: dict[str, np.ndarray] | None = None) -> RunResult:
    case, steps = config.case, config.accum_steps
    ctx = resolve_context(config.device)
    hybridize = config.option("hybridize", True)
    weights = case.weights() if weights is None else weights
    kinds = {p.name: p.kind for p in case.parameters()}
    dtype = config.dtype
    block = prepared(case, weights, dtype, ctx, hybridize)
    step = case_step(case, block, ctx, dtype, steps)
    native, native_loss, _ = _native(config, block.canonical, step, ctx, config.fault, progress)
    block = prepared(case, weights, dtype, ctx, hybridize)
    step = case_step(case, block, ctx, dtype, steps)
    manual, exact, absum, manual_loss, logits = manual_pass(block.canonical, step, steps, ctx, progress,
                                                            accum_dtype=config.accum_dtype)
    settings = _settings(config, hybridize)
    notes = ["hybridized" if hybridize else "imperative"]
    oracle_grads = None
    losses = {"mean_loss": native_loss, "manual_mean_loss": manual_loss}
    if config.oracle:
        oracle_grads, oracle_loss, settings["oracle"] = _oracle(case, weights, ctx, hybridize, steps, config.device,
                                                                 progress)
        notes.append(f"oracle {settings['oracle']}")
        if oracle_loss is not None:
            losses["oracle_mean_loss"] = oracle_loss
    gap = None
    if config.full_batch:
        gap, settings["full_batch_reference"] = full_batch_gap(case, weights, steps, ctx, hybridize, config.device,
                                                               progress)
        notes.append(f"full batch {settings['full_batch_reference']}")
    params = [ParamAccumulation(name=name, kind=kinds[name], native=native[name], manual=manual[name],
                                exact=exact[name], absum=absum[name],
                                oracle=None if oracle_grads is None else oracle_grads[name])
              for name in weights]
    return RunResult(params=params, framework="mxnet", versions=versions, device=str(ctx),
                     param_dtype=_param_dtype(config), accum_dtype=config.accum_dtype,
                     native_kernel_allowance=_allowance(config), losses=losses, settings=settings,
                     notes=notes + _dtype_notes(config, ctx), first_logits=logits, full_batch=gap)


def _native(config: RunConfig, params: dict[str, Any], step: Any, ctx: Any, fault: Any, progress: Progress | None,
            group: str = "") -> tuple[dict[str, np.ndarray], float, Any]:
    """The native slot: grad_req='add', or (``--mode accumulator|compensated``) a GradAccumulator."""
    where = f", {group}" if group else ""
    if config.mode == "native":
        grads, loss, first = native_pass(params, step, config.accum_steps, ctx, fault, progress,
                                         phase=f"native: grad_req='add'{where}")
        return {name: _float32(g) for name, g in grads.items()}, loss, first
    return accumulator_pass(params, step, config.accum_steps, ctx, fault, progress, config.mode == "compensated",
                            f"{config.mode}: GradAccumulator{where}")


def _float32(values: np.ndarray) -> np.ndarray:
    """float16 gradients as float32 (exactly), the judge's smallest float."""
    return values.astype(np.float32) if values.dtype == np.float16 else values


def _param_dtype(config: RunConfig) -> str:
    return config.dtype if config.mode == "native" else "float32"  # a GradAccumulator sums in float32


def _dtype_notes(config: RunConfig, ctx: Any) -> list[str]:
    notes = []
    if float16_on_cpu(config.dtype, ctx):
        notes.append("float16 parameters computed in float32 on the CPU (MXNet 1.x has no float16 FullyConnected "
                     "there); their gradients are float16")
    if config.option("multi_precision", False):
        notes.append("multi_precision gives the optimizer float32 master weights; grad_req='add' still sums the "
                     "float16 gradients in float16")
    return notes


def _settings(config: RunConfig, hybridize: bool) -> dict[str, Any]:
    native = "grad_req='add'" if config.mode == "native" else (
        f"GradAccumulator({'compensated=True' if config.mode == 'compensated' else 'plain'}): grad_req='write', "
        "float32 buffers, the total written back into p.grad()")
    return {"hybridize": hybridize, "static_alloc": hybridize, "native": native,
            "manual": "grad_req='write' + acc[:] += p.grad()"}


def _allowance(config: RunConfig) -> float:
    # A GradAccumulator takes grad_req='write' gradients, computed as the manual pass's are.
    return KERNEL_ALLOWANCE if config.mode == "native" else 0.0


def tensor_needs(config: RunConfig) -> list[TensorNeed]:
    """What each tensor of the case holds beside the model while its group runs and is judged: the
    native pass's gradient on the host; the manual pass's buffer, E and S, and the micro-step's
    gradient copied on MXNet's engine and read on the host (one tensor at a time); on a GPU the
    host copies of the buffer, E and S."""
    accum = 8 if config.accum_dtype == "float64" else 4
    host = 4 + (accum + 16 if config.device != "cpu" else 0)
    return [need(p.name, p.numel, element_bytes(4, accum, 4, host)) for p in config.case.parameters()]


def run_groups(config: RunConfig, groups: list[list[str]], versions: dict[str, str],
               progress: Progress | None = None) -> Iterator[RunResult]:
    """``run`` once per group of tensors (``Backend.run_groups``): both passes on fresh blocks from the
    same weights, the native gradients read and the manual buffers kept for that group only."""
    case, steps = config.case, config.accum_steps
    ctx = resolve_context(config.device)
    hybridize = config.option("hybridize", True)
    weights = case.weights()
    kinds = {p.name: p.kind for p in case.parameters()}
    settings = _settings(config, hybridize)
    for index, names in enumerate(groups):
        phase = f"group {index + 1} of {len(groups)}"
        fault = config.fault if config.fault is not None and config.fault.param in names else None
        block = prepared(case, weights, config.dtype, ctx, hybridize)
        native, native_loss, _ = _native(config, {name: block.canonical[name] for name in names},
                                         case_step(case, block, ctx, config.dtype, steps), ctx, fault, progress, phase)
        block = prepared(case, weights, config.dtype, ctx, hybridize)
        manual, exact, absum, manual_loss, logits = manual_pass({name: block.canonical[name] for name in names},
                                                                case_step(case, block, ctx, config.dtype, steps), steps,
                                                                ctx, progress, accum_dtype=config.accum_dtype)
        del block
        params = [ParamAccumulation(name=name, kind=kinds[name], native=native[name], manual=manual[name],
                                    exact=exact[name], absum=absum[name]) for name in names]
        del native, manual, exact, absum
        result = RunResult(params=params, framework="mxnet", versions=versions, device=str(ctx),
                           param_dtype=_param_dtype(config), accum_dtype=config.accum_dtype,
                           native_kernel_allowance=_allowance(config),
                           losses={"mean_loss": native_loss, "manual_mean_loss": manual_loss}, settings=settings,
                           notes=["hybridized" if hybridize else "imperative"] + _dtype_notes(config, ctx),
                           first_logits=logits if index == 0 else None)
        del params, logits
        yield result
        del result  # before the next group runs


def micro_gradients(config: RunConfig, names: list[str], progress: Progress | None = None,
                    weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The manual pass's micro-gradients of the tensors ``names`` again, one micro-step at a time:
    a fresh block from the same weights, grad_req='write', as ``manual_pass`` reads them."""
    case, steps = config.case, config.accum_steps
    ctx = resolve_context(config.device)
    block = prepared(case, case.weights() if weights is None else weights, config.dtype, ctx,
                     config.option("hybridize", True))
    params = block.canonical
    set_grad_req(params, {}, "write", None)
    for index, _ in micro_steps(case_step(case, block, ctx, config.dtype, steps), steps, []):
        yield {name: _float32(params[name].grad().asnumpy()) for name in names}
        if progress is not None:
            progress("second pass: the flagged tensors' micro-gradients", index + 1, steps)


def _oracle(case: Case, weights: dict[str, np.ndarray], ctx: Any, hybridize: bool, accum_steps: int,
            device: str, progress: Progress | None) -> tuple[dict | None, float | None, str]:
    """The whole model in float64 with grad_req='add'; PyTorch's float64 model where MXNet lacks a
    float64 kernel for one of the case's operators."""
    try:
        block = prepared(case, weights, "float64", ctx, hybridize)
        grads, loss, _ = native_pass(block.canonical, case_step(case, block, ctx, "float64", accum_steps), accum_steps,
                                     ctx, None, progress, phase="float64 oracle")
        return grads, loss, "mxnet float64"
    except mx.base.MXNetError as exc:
        reason = str(exc).strip().splitlines()[0][:160]
    try:
        from ..torch.run import float64_oracle
    except ImportError:
        return None, None, f"none: MXNet float64 failed ({reason}) and torch is not installed"
    grads, loss = float64_oracle(case, weights, accum_steps, "cpu" if device == "cpu" else "cuda", progress)
    return grads, loss, f"torch float64 (MXNet float64 failed: {reason})"
