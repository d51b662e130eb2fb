"""Check gradient accumulation on your own PyTorch model.

    import accumcheck.torch
    report = accumcheck.torch.check(model, loss_fn, batches, accum_steps=16)
    accumcheck.assert_faithful(report)

One backward pass per micro-batch feeds both modes: ``.grad`` accumulating natively, and a
manual float32 buffer with float64 sums E and S, fed from the same micro-gradients. Each named
parameter is judged as ``accumcheck compare`` judges a case. The model runs in eval mode (dropout
off, batch-norm statistics frozen) and is left as it was found: parameters, ``.grad`` and the
training flag.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from ...backend import ParamAccumulation, Progress, RunResult
from ...cases import infer_kind
from ...errors import AccumcheckError
from ...faults import parse_fault, resolve_fault
from ...judge import build_report
from ...report import Report
from ...usermodel import Batch, batch_source
from .accumulate import accumulate
from .model import deterministic, isolated, to_numpy


def check(model: Any, loss_fn: Callable[[Any, Any], Any],
          batches: Sequence[Batch] | Iterable[Batch] | Callable[[int], Batch],
          accum_steps: int | None = None, device: str | None = None, oracle: bool = False,
          inject: str | None = None, progress: Progress | None = None) -> Report:
    """Accumulate ``accum_steps`` micro-batches natively and by hand, and judge every parameter.

    ``model`` is any ``torch.nn.Module``; ``loss_fn(output, target)`` returns a scalar loss;
    ``batches`` is a sequence or iterable of ``(inputs, target)`` pairs (the first
    ``accum_steps`` are used; default all) or a function of the micro-step index. ``device`` must
    be where the model is (default: there); batches are moved to it. ``oracle`` also runs a
    float64 copy of the model. ``inject`` (e.g. ``"scale"``, ``"drop-step:fc.weight"``) perturbs
    the native accumulation to prove the check fires. Returns a Report; raises AccumcheckError
    for bad input.
    """
    started = time.perf_counter()
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise AccumcheckError("check: the model has no parameter that requires grad")
    first = next(iter(params.values()))
    where = first.device
    if device is not None and torch.device("cuda" if device == "gpu" else device) != where and \
            not (device in ("gpu", "cuda") and where.type == "cuda"):
        raise AccumcheckError(f"check: the model is on {where}, not {device}; move it there or pass device={str(where)!r}")
    get_batch, steps = batch_source(batches, accum_steps)
    kinds = {name: infer_kind(name, p.dim()) for name, p in params.items()}
    fault = resolve_fault(parse_fault(inject), list(kinds.items()), steps) if inject is not None else None

    def step_loss(model: Any, dtype: Any) -> Callable[[int], Any]:
        def run(index: int) -> Any:
            inputs, target = get_batch(index)
            loss = loss_fn(model(_to(inputs, where, dtype)), _to(target, where, dtype))
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise AccumcheckError("check: loss_fn must return a scalar tensor (reduce it with .mean() or .sum())")
            return loss
        return run

    saved_grads = {name: (None if p.grad is None else p.grad.detach().clone()) for name, p in params.items()}
    was_training = model.training
    try:
        with deterministic(where), isolated(where):
            model.eval()
            result = accumulate(params, step_loss(model, first.dtype), steps, fault, progress, "native + manual")
            buffers = {name: tuple(to_numpy(t) for t in result["buffers"][name]) for name in params}
            native = {name: to_numpy(g) for name, g in result["native"].items()}
            oracle_grads = None
            if oracle:
                twin = copy.deepcopy(model).double()
                twin_params = {name: p for name, p in twin.named_parameters() if p.requires_grad}
                twin_result = accumulate(twin_params, step_loss(twin, torch.float64), steps, None, progress,
                                         "float64 oracle")
                oracle_grads = {name: to_numpy(g) for name, g in twin_result["native"].items()}
    finally:
        model.train(was_training)
        for name, p in params.items():
            p.grad = saved_grads[name]
    run = RunResult(
        params=[ParamAccumulation(name, kinds[name], native[name], *buffers[name],
                                  oracle=None if oracle_grads is None else oracle_grads[name]) for name in params],
        framework="torch", versions={"torch": torch.__version__}, device=str(where),
        param_dtype=str(first.dtype).replace("torch.", ""), accum_dtype=str(first.dtype).replace("torch.", ""),
        losses={"mean_loss": result["loss"]}, notes=["model in eval mode"])
    return build_report(None, run, steps, fault, oracle, time.perf_counter() - started,
                        config={"model": type(model).__name__})


def _to(value: Any, device: Any, dtype: Any) -> Any:
    """Move a tensor (or a tuple/list/dict of them) to ``device``; floating ones to ``dtype``."""
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value
