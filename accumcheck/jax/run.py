"""A run on JAX: each micro-step's gradient computed once and fed to both modes, as the RunResult
the judge reads.

JAX is functional: a micro-step's gradient is a value, so one backward pass feeds native
(``optax.MultiSteps``' accumulator), manual (a buffer added with ``jax.tree_util.tree_map``) and
the float64 sums E and S (on the host) with the very same micro-gradients. See ``accumulate``.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from jax.experimental import enable_x64

from ..case.definition import Case
from ..errors import AccumcheckError
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.results import ParamAccumulation, RunResult
from .casemodel import batch_arrays, case_params, grad_function
from .devices import device_name, resolve_device
from .multisteps import harmonic_note, mean_allowance
from .multisteps import settings as multisteps_settings
from .passes import accumulate, host_float


def _total_tokens(case: Case, accum_steps: int) -> float | None:
    return float(case.token_count(accum_steps)) if case.loss_reduction == "token_count" else None


def case_sums(config: RunConfig, params: dict[str, Any], device: Any, progress: Progress | None,
              fault: Any = None) -> dict[str, Any]:
    """The case's N micro-steps through ``accumulate``, and the logits of micro-batch 0."""
    case, steps = config.case, config.accum_steps
    jit = config.option("jit", True)
    grad_of = grad_function(case, jit, config.dtype if _master_weights(config) else None)
    total = _total_tokens(case, steps)
    first: list[Any] = []

    def micro_step(step: int) -> tuple[Any, Any]:
        inputs, labels, gates = batch_arrays(case, step, config.dtype, device)
        (loss, logits), grads = grad_of(params, inputs, labels, total, gates)
        if step == 0:
            first.append(host_float(logits))
        return loss, grads

    sums = accumulate(params, micro_step, steps, config.accum_dtype, jit, config.option("grad_mean", True), fault,
                      progress)
    sums["first_logits"] = first[0]
    return sums


def float64_oracle(case: Case, weights: dict[str, np.ndarray], accum_steps: int, device: Any, jit: bool,
                   progress: Progress | None) -> tuple[dict[str, np.ndarray], float]:
    """The whole model in float64 (JAX's 64-bit mode for this pass only): the micro-gradients
    summed in float64, and the mean loss."""
    with enable_x64():
        params = case_params(case, weights, "float64", device)
        grad_of = grad_function(case, jit)
        sums = {name: np.zeros(p.shape) for name, p in params.items()}
        total, loss_sum = _total_tokens(case, accum_steps), 0.0
        for step in range(accum_steps):
            inputs, labels, gates = batch_arrays(case, step, "float64", device)
            (loss, _), grads = grad_of(params, inputs, labels, total, gates)
            for name, g in grads.items():
                sums[name] += np.asarray(g)
            loss_sum += float(loss)
            if progress is not None:
                progress("float64 oracle", step + 1, accum_steps)
    return sums, loss_sum / accum_steps


def run(config: RunConfig, versions: dict[str, str], progress: Progress | None = None,
        weights: dict[str, np.ndarray] | None = None) -> RunResult:
    case, steps = config.case, config.accum_steps
    device = resolve_device(config.device)
    weights = case.weights() if weights is None else weights
    kinds = {p.name: p.kind for p in case.parameters()}
    params = case_params(case, weights, "float32" if _master_weights(config) else config.dtype, device)
    sums = case_sums(config, params, device, progress, config.fault)
    oracle, losses = None, {"mean_loss": sums["loss"]}
    if config.oracle:
        oracle, losses["oracle_mean_loss"] = float64_oracle(case, weights, steps, device, config.option("jit", True),
                                                            progress)
    result = [ParamAccumulation(name=name, kind=kinds[name], native=sums["native"][name], manual=sums["manual"][name],
                                exact=sums["exact"][name], absum=sums["absum"][name],
                                oracle=None if oracle is None else oracle[name])
              for name in weights]
    return RunResult(params=result, framework="jax", versions=versions, device=device_name(device),
                     param_dtype="float32" if _master_weights(config) else config.dtype, accum_dtype=config.accum_dtype,
                     native_kernel_allowance=_allowance(config), losses=losses, settings=settings(config),
                     notes=notes(config), first_logits=sums["first_logits"])


def _master_weights(config: RunConfig) -> bool:
    if not config.option("master_weights", False):
        return False
    if config.dtype == "float32":
        raise AccumcheckError("--master-weights: float32 parameters are their own master weights; "
                              "give --dtype bfloat16 or drop --master-weights")
    return True


def _allowance(config: RunConfig) -> float:
    return mean_allowance(config.accum_steps) if config.option("grad_mean", True) else 0.0


def settings(config: RunConfig) -> dict[str, Any]:
    return multisteps_settings(config.accum_steps, config.option("jit", True), config.option("grad_mean", True),
                               config.accum_dtype)


def notes(config: RunConfig) -> list[str]:
    notes = ["jit" if config.option("jit", True) else "op by op (no jit)"]
    if config.option("grad_mean", True):
        notes.append(harmonic_note(config.accum_steps))
    if _master_weights(config):
        notes.append(f"float32 master weights cast to {config.dtype} in the forward: MultiSteps, initialised on "
                     "them, accumulates in float32")
    elif config.dtype != "float32":
        notes.append(f"MultiSteps' accumulator takes the parameters' dtype ({config.dtype})")
    return notes


def micro_gradients(config: RunConfig, names: list[str], progress: Progress | None = None,
                    weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The run's micro-gradients of ``names`` again, one micro-step at a time (the same compiled
    gradient from the same weights: bit for bit those the run fed both modes)."""
    case, steps = config.case, config.accum_steps
    device = resolve_device(config.device)
    params = case_params(case, case.weights() if weights is None else weights,
                         "float32" if _master_weights(config) else config.dtype, device)
    grad_of = grad_function(case, config.option("jit", True), config.dtype if _master_weights(config) else None)
    total = _total_tokens(case, steps)
    for step in range(steps):
        inputs, labels, gates = batch_arrays(case, step, config.dtype, device)
        _, grads = grad_of(params, inputs, labels, total, gates)
        yield {name: host_float(grads[name]) for name in names}
        if progress is not None:
            progress("second pass: the flagged tensors' micro-gradients", step + 1, steps)
