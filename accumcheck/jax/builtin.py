"""A built-in case's run on JAX: the case's weights, loss and micro-batches handed to the engine
(``engine.run_model``), as the RunResult the judge reads, and its micro-gradients again for the
judge's second pass (``micro_gradients``)."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..errors import AccumcheckError
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.results import RunResult
from .casemodel import CaseParams, case_batches, grad_function
from .devices import resolve_device
from .engine import MicroSteps, Model, replay, run_model
from .multisteps import accumulator_note, harmonic_note
from .multisteps import settings as multisteps_settings


def case_model(config: RunConfig, weights: dict[str, np.ndarray], device: Any) -> Model:
    """The case of ``config`` as the engine's model: its weights in the run's dtype (float32 master
    weights cast in the forward, where asked), its loss and micro-batches on ``device``."""
    master = _master_weights(config)
    params = CaseParams(config.case, weights, "float32" if master else config.dtype, config.accum_dtype, device)
    grad_of = grad_function(config.case, config.option("jit", True), config.dtype if master else None)
    return Model(params, grad_of, case_batches(config.case, config.accum_steps, config.dtype, device), aux=True)


def oracle_model(config: RunConfig, params: CaseParams, device: Any) -> Model:
    """The float64 oracle's: the same weights and loss, the micro-batches' features in float64."""
    return Model(params, grad_function(config.case, config.option("jit", True)),
                 case_batches(config.case, config.accum_steps, "float64", device), aux=True)


def run(config: RunConfig, versions: dict[str, str], progress: Progress | None = None,
        weights: dict[str, np.ndarray] | None = None) -> RunResult:
    device = resolve_device(config.device)
    model = case_model(config, config.case.weights() if weights is None else weights, device)
    result, _ = run_model(model, config.accum_steps, jit=config.option("jit", True),
                          grad_mean=config.option("grad_mean", True), fault=config.fault,
                          oracle=oracle_model(config, model.params, device) if config.oracle else None,
                          progress=progress, versions=versions, settings=settings(config), notes=notes(config))
    return result


def micro_gradients(config: RunConfig, names: list[str], progress: Progress | None = None,
                    weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The run's micro-gradients of ``names`` again, one micro-step at a time (the same compiled
    gradient from the same weights: bit for bit those the run fed both modes)."""
    model = case_model(config, config.case.weights() if weights is None else weights, resolve_device(config.device))
    yield from replay(MicroSteps(model, model.params.arrays()), config.accum_steps, progress, names)


def _master_weights(config: RunConfig) -> bool:
    if not config.option("master_weights", False):
        return False
    if config.dtype == "float32":
        raise AccumcheckError("--master-weights: float32 parameters are their own master weights; "
                              "give --dtype bfloat16 or drop --master-weights")
    return True


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
        notes.append(accumulator_note(config.dtype))
    return notes
