"""A run of a built-in case on MXNet: the case as a block, a loss and batches (``casemodel``) handed
to the engine, the native slot and the manual pass (and with the oracle the float64 model), as the
RunResult the judge reads. The block is hybridized (``static_alloc=True``, as in the original bug
reports) unless asked not to be."""

from __future__ import annotations

import importlib.util
from typing import Any, Iterator

import numpy as np

from ..case.definition import Case
from ..run.backend import Progress
from ..run.budget import TensorNeed, element_bytes, need
from ..run.config import RunConfig
from ..run.results import RunResult
from .casemodel import case_step, float16_on_cpu, prepared, resolve_context
from .engine import KERNEL_ALLOWANCE, Gradients, Model, accumulate, accumulations, float32, group_passes, passes, replay
from .fullbatch import case_full_batch
from .library import mx


def case_model(case: Case, weights: dict[str, np.ndarray], dtype: str, ctx: Any, hybridize: bool,
               accum_steps: int) -> Model:
    """The case as the engine runs it: a block holding ``weights`` in ``dtype``, every parameter judged."""
    block = prepared(case, weights, dtype, ctx, hybridize)
    # Both passes (and a second pass) run the same micro-batches: each is made once.
    return Model(block, dict(block.canonical), case_step(case, block, ctx, dtype, accum_steps, keep=True), ctx,
                 accum_steps)


def run(config: RunConfig, versions: dict[str, str], progress: Progress | None = None,
        weights: dict[str, np.ndarray] | None = None) -> RunResult:
    case, steps = config.case, config.accum_steps
    ctx = resolve_context(config.device)
    hybridize = config.option("hybridize", True)
    weights = case.weights() if weights is None else weights
    model = case_model(case, weights, config.dtype, ctx, hybridize, steps)
    grads = passes(model, config.mode, config.fault, progress, accum_dtype=config.accum_dtype)
    settings = _settings(config, hybridize)
    notes = ["hybridized" if hybridize else "imperative"]
    oracle_grads = None
    if config.oracle:
        oracle_grads, oracle_loss, settings["oracle"] = _oracle(case, weights, ctx, hybridize, steps, config.device,
                                                                 progress)
        notes.append(f"oracle {settings['oracle']}")
        if oracle_loss is not None:
            grads.losses["oracle_mean_loss"] = oracle_loss
    gap = None
    if config.full_batch:
        gap, settings["full_batch_reference"] = case_full_batch(case, weights, steps, ctx, hybridize, config.device,
                                                                progress)
        notes.append(f"full batch {settings['full_batch_reference']}")
    return _result(config, model, grads, versions, settings, notes, oracle_grads, gap)


def run_groups(config: RunConfig, groups: list[list[str]], versions: dict[str, str],
               progress: Progress | None = None) -> Iterator[RunResult]:
    """``run`` once per group of tensors (``Backend.run_groups``), by the engine's group loop: the
    native gradients read and the manual buffers kept for that group only."""
    ctx = resolve_context(config.device)
    hybridize = config.option("hybridize", True)
    model = case_model(config.case, config.case.weights(), config.dtype, ctx, hybridize, config.accum_steps)
    settings = _settings(config, hybridize)
    grouped = group_passes(model, groups, config.mode, config.fault, progress, accum_dtype=config.accum_dtype)
    notes = ["hybridized" if hybridize else "imperative"]
    for index, (names, grads) in enumerate(zip(groups, grouped)):
        if index:
            grads.logits = None  # micro-step 0's output, once
        result = _result(config, model.only(names), grads, versions, settings, notes)
        del grads
        yield result
        del result  # before the next group runs


def micro_gradients(config: RunConfig, names: list[str], progress: Progress | None = None,
                    weights: dict[str, np.ndarray] | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The manual pass's micro-gradients of the tensors ``names`` again (the engine's replay), on
    a fresh block from the same weights."""
    case = config.case
    model = case_model(case, case.weights() if weights is None else weights, config.dtype,
                       resolve_context(config.device), config.option("hybridize", True), config.accum_steps)
    yield from replay(model, names, progress)


def _result(config: RunConfig, model: Model, grads: Gradients, versions: dict[str, str], settings: dict[str, Any],
            notes: list[str], oracle: dict[str, np.ndarray] | None = None, gap: Any = None) -> RunResult:
    if config.mode == "native":
        grads.native = {name: float32(g) for name, g in grads.native.items()}
    kinds = {p.name: p.kind for p in config.case.parameters()}
    return RunResult(params=accumulations(model, grads, kinds, oracle), framework="mxnet", versions=versions,
                     device=str(model.ctx), param_dtype=_param_dtype(config), accum_dtype=config.accum_dtype,
                     native_kernel_allowance=KERNEL_ALLOWANCE if config.mode == "native" else 0.0,
                     losses=grads.losses, settings=settings, notes=notes + _dtype_notes(config, model.ctx),
                     first_logits=grads.logits, full_batch=gap)


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


def tensor_needs(config: RunConfig) -> list[TensorNeed]:
    """What each tensor of the case holds beside the model while its group runs and is judged: the
    native pass's gradient on the host; the manual pass's buffer, E and S, and the micro-step's
    gradient copied on MXNet's engine and read on the host (one tensor at a time); on a GPU the
    host copies of the buffer, E and S."""
    accum = 8 if config.accum_dtype == "float64" else 4
    host = 4 + (accum + 16 if config.device != "cpu" else 0)
    return [need(p.name, p.numel, element_bytes(4, accum, 4, host)) for p in config.case.parameters()]


def _oracle(case: Case, weights: dict[str, np.ndarray], ctx: Any, hybridize: bool, accum_steps: int,
            device: str, progress: Progress | None) -> tuple[dict | None, float | None, str]:
    """The whole model in float64 with grad_req='add'; PyTorch's float64 model where MXNet lacks a
    float64 kernel for one of the case's operators."""
    try:
        model = case_model(case, weights, "float64", ctx, hybridize, accum_steps)
        grads, loss, _ = accumulate(model, "native", None, progress, phase="float64 oracle")
        return grads, loss, "mxnet float64"
    except mx.base.MXNetError as exc:
        reason = str(exc).strip().splitlines()[0][:160]
    if importlib.util.find_spec("torch") is None:
        return None, None, f"none: MXNet float64 failed ({reason}) and torch is not installed"
    from ..torch.builtin import float64_oracle

    grads, loss = float64_oracle(case, weights, accum_steps, "cpu" if device == "cpu" else "cuda", progress)
    return grads, loss, f"torch float64 (MXNet float64 failed: {reason})"
