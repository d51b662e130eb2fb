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

import numpy as np

from .api import build_report
from .backends.base import ParamAccumulation, Progress, RunResult
from .backends.torch_backend import accumulate, deterministic
from .cases import infer_kind
from .errors import AccumcheckError
from .faults import parse_fault, resolve_fault
from .report import Report
from .usermodel import Batch, batch_source


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
    import torch

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
        with deterministic(where), torch.random.fork_rng(devices=[where] if where.type == "cuda" else []):
            model.eval()
            result = accumulate(params, step_loss(model, first.dtype), steps, fault, progress, "native + manual")
            buffers = {name: tuple(_numpy(t) for t in result["buffers"][name]) for name in params}
            native = {name: _numpy(g) for name, g in result["native"].items()}
            oracle_grads = None
            if oracle:
                twin = copy.deepcopy(model).double()
                twin_params = {name: p for name, p in twin.named_parameters() if p.requires_grad}
                twin_result = accumulate(twin_params, step_loss(twin, torch.float64), steps, None, progress,
                                         "float64 oracle")
                oracle_grads = {name: _numpy(g) for name, g in twin_result["native"].items()}
    finally:
        model.train(was_training)
        for name, p in params.items():
            p.grad = saved_grads[name]
    run = RunResult(
        params=[ParamAccumulation(name, kinds[name], native[name], *buffers[name],
                                  oracle=None if oracle_grads is None else oracle_grads[name]) for name in params],
        framework="torch", versions={"torch": torch.__version__}, device=str(where),
        param_dtype=str(first.dtype).replace("torch.", ""), accum_dtype=str(first.dtype).replace("torch.", ""),
        losses={"mean_loss": result["loss"]}, settings={"requested_device": str(where), "mode": "eval"})
    return build_report(None, run, steps, fault, oracle, time.perf_counter() - started, model=type(model).__name__)


def _to(value: Any, device: Any, dtype: Any) -> Any:
    """Move a tensor (or a tuple/list/dict of them) to ``device``; floating ones to ``dtype``."""
    import torch

    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value


def _numpy(tensor: Any) -> np.ndarray:
    return tensor.detach().cpu().numpy()


class GradAccumulator:
    """Float32 main-grad buffers for gradient accumulation (as Megatron-LM's ``main_grad``), with
    an optional compensated (Neumaier) mode that keeps the sum within about one float32 ulp.

        acc = GradAccumulator(model, compensated=True)
        for inputs, target in micro_batches:
            loss_fn(model(inputs), target).backward()
            acc.add()                 # .grad into the buffers; .grad cleared
        acc.apply()                   # the sums into .grad, in the parameters' dtype
        optimizer.step()
        acc.zero()

    Parameters in bfloat16 or float16 then accumulate in float32 instead of their own dtype.
    """

    def __init__(self, params: Any, dtype: Any = None, compensated: bool = False) -> None:
        import torch

        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        self.params = [p for p in params if p.requires_grad]
        self.dtype = dtype or torch.float32
        self.compensated = compensated
        self.sums = [torch.zeros_like(p, dtype=self.dtype) for p in self.params]
        self.carries = [torch.zeros_like(p, dtype=self.dtype) for p in self.params] if compensated else None

    def add(self) -> None:
        """Add each parameter's ``.grad`` (one micro-step's gradient) and clear it."""
        import torch

        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                grad = p.grad.to(self.dtype)
                if self.carries is None:
                    self.sums[i].add_(grad)
                else:  # Neumaier: keep what each addition rounds away
                    total = self.sums[i] + grad
                    lost = torch.where(self.sums[i].abs() >= grad.abs(), (self.sums[i] - total) + grad,
                                       (grad - total) + self.sums[i])
                    self.carries[i].add_(lost)
                    self.sums[i].copy_(total)
                p.grad = None

    def totals(self) -> list[Any]:
        """The accumulated gradients, in the buffer dtype."""
        if self.carries is None:
            return list(self.sums)
        return [s + c for s, c in zip(self.sums, self.carries)]

    def apply(self) -> None:
        """Write the accumulated gradients into ``.grad``, in each parameter's dtype."""
        for p, total in zip(self.params, self.totals()):
            p.grad = total.to(p.dtype)

    def zero(self) -> None:
        for buffers in (self.sums, self.carries or []):
            for b in buffers:
                b.zero_()
