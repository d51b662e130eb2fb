"""The one PyTorch engine: a subject (a model, the loss of each of its N micro-batches, and those
micro-batches as one batch) accumulated natively and by hand, whatever it came from: a built-in
case (``builtin.CaseSubject``) or a user's model (``usercheck.ModelSubject``).

``record`` runs the N micro-steps once (``passes.accumulate``) and returns the arrays the judge
reads; ``in_groups`` does it group by group of tensors under a memory budget; ``float64_pass``
runs the subject's float64 twin, which gives the oracle and the full-batch reference; ``replay``
hands the judge's second pass the micro-gradients again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import numpy as np
import torch

from ..errors import USER_EXCEPTIONS, AccumcheckError
from ..run.backend import Progress
from ..run.faults import Fault
from ..run.results import FullBatchGap, Hypotheses, window_scale
from .bydesign import batch_level_modules, batch_statistics_off
from .casemodel import deterministic, isolated, to_numpy
from .judging import device_arrays, judged_on_device
from .passes import accumulate


class Subject:
    """What the engine runs. ``model`` holds ``params`` (each trainable tensor once, by its
    canonical name) on ``device``; ``steps`` micro-batches; ``reduction`` how the loop normalises
    its loss ("mean", "sum", "token_count"). ``strict``: deterministic kernels are required (a
    user's model may use an operation without one: it only warns). ``hold_refs``: the recorder may
    hold the micro-gradients themselves (see ``passes.StepRecorder``). ``scale``: the loss scale of
    a GradScaler (the arrays are judged unscaled)."""

    model: Any
    params: dict[str, Any]
    device: Any
    steps: int
    reduction: str = "mean"
    strict: bool = True
    hold_refs: bool = False
    scale: float | None = None

    def step_loss(self, net: Any) -> Callable[[int], Any]:
        """The loss of micro-batch k on ``net`` (the model, or its float64 twin)."""
        raise NotImplementedError

    def prepare(self, net: Any) -> None:
        """Put ``net`` in the mode the micro-steps run in."""

    def settle(self) -> None:
        """After a pass over the model: its values as they were before it."""

    def float64_twin(self) -> tuple[Any, dict[str, Any]]:
        """A float64 copy of the model with the model's values now, and its parameters by name."""
        raise NotImplementedError

    def whole_batch(self) -> Any:
        """The N micro-batches, for ``whole_loss`` (taken before the float64 twin's pass)."""
        return None

    def whole_loss(self, twin: Any, batches: Any) -> Any:
        """The loss of ``batches`` joined into one batch, on the float64 twin."""
        raise NotImplementedError

    def item_counts(self) -> list[int] | None:
        """Labelled items of each micro-batch, or None where the batches do not say."""
        return None

    def kept(self) -> ContextManager[Any]:
        """The model as it was, after a replay (also one stopped midway)."""
        return contextlib.nullcontext()

    def backward_error(self, exc: BaseException, index: int | str) -> Exception | None:
        """The error to raise for what a backward pass raised (the user's hooks ran in it), or None
        to let it through."""
        return None


@dataclass
class Sums:
    """One pass's record, judged unscaled: each tensor's ParamAccumulation arrays (host arrays, or a
    GPU tensor's reductions), the mean loss, and the micro-steps with a gradient of the tensors
    that missed some."""

    arrays: dict[str, dict[str, Any]]
    loss: float
    steps_with_grad: dict[str, int]
    settings: dict[str, Any]


@dataclass
class Float64Pass:
    """The float64 twin's accumulated gradients (the oracle), its mean loss, and the full-batch
    comparison where one was asked for."""

    accumulated: dict[str, np.ndarray]
    loss: float
    full_batch: FullBatchGap | None


def record(subject: Subject, part: dict[str, Any], fault: Fault | None, accum_dtype: Any, mode: str, phase: str,
           progress: Progress | None, hold_steps: bool) -> tuple[dict[str, Any], float, dict[str, int]]:
    """The N micro-steps with ``part``'s tensors recorded (native, and manual, E and S): their
    arrays (``Sums.arrays``), the mean loss, the steps with a gradient. The model's values are put
    back after (``Subject.settle``)."""
    fault = fault if fault is not None and fault.param in part else None
    result = accumulate(part, subject.step_loss(subject.model), subject.steps, fault, progress, phase, accum_dtype,
                        mode, hold_steps=hold_steps, hold_refs=subject.hold_refs,
                        backward_error=_backward_error(subject))
    scale = subject.scale
    if scale is None and judged_on_device(subject.device):  # judged on the GPU: only scalars come back
        arrays = {name: device_arrays(g, *result["buffers"][name]) for name, g in result["native"].items()}
    else:
        arrays = {}
        for name, g in result["native"].items():
            found = dict(native=to_numpy(g), **dict(zip(("manual", "exact", "absum"),
                                                        map(to_numpy, result["buffers"][name]))))
            if scale is not None:  # judged unscaled: the scale is a power of two, so dividing is exact
                found = {key: a / np.asarray(scale, a.dtype) for key, a in found.items()}
            arrays[name] = found
    subject.settle()
    return arrays, result["loss"] / (scale or 1.0), result["steps_with_grad"]


def run_whole(subject: Subject, fault: Fault | None, accum_dtype: Any, mode: str, oracle: bool, full_batch: bool,
              progress: Progress | None, hold_steps: bool = True) -> tuple[Sums, Float64Pass | None]:
    """Every tensor at once, and the float64 twin's pass where ``oracle`` or ``full_batch`` asks."""
    with deterministic(subject.device, warn_only=not subject.strict) as settings, isolated(subject.device):
        twin = subject.float64_twin() if oracle or full_batch else None  # before any pass: the model as found
        subject.prepare(subject.model)
        arrays, loss, with_grad = record(subject, subject.params, fault, accum_dtype, mode, "native + manual",
                                         progress, hold_steps)
        wide = None
        if twin is not None:
            wide = float64_pass(subject, *twin, full_batch, progress)
            del twin
    return Sums(arrays, loss, with_grad, settings), wide


def in_groups(subject: Subject, groups: list[list[str]], fault: Fault | None, accum_dtype: Any, mode: str,
              progress: Progress | None) -> Iterator[tuple[list[str], Sums]]:
    """The N micro-steps once per group of tensors (a memory budget's): ``.grad`` cleared and the
    random state as found before each group, hooks and buffers for that group's tensors only,
    nothing held beyond one micro-step. Each group's record is yielded before the next runs."""
    for index, names in enumerate(groups):
        with deterministic(subject.device, warn_only=not subject.strict) as settings, isolated(subject.device):
            subject.prepare(subject.model)
            for param in subject.params.values():
                param.grad = None
            part = {name: subject.params[name] for name in names}
            arrays, loss, with_grad = record(subject, part, fault, accum_dtype, mode,
                                             f"native + manual, group {index + 1} of {len(groups)}", progress,
                                             hold_steps=False)
            sums = Sums(arrays, loss, with_grad, settings)
            del part, arrays
        yield names, sums
        del sums  # before the next group runs


def float64_pass(subject: Subject, twin: Any, params: dict[str, Any], full_batch: bool,
                 progress: Progress | None) -> Float64Pass:
    """The N micro-steps on the float64 twin (the oracle), and with ``full_batch`` the gradient of
    the N micro-batches as one batch on it: the accumulated gradient scaled as the loop scales it
    ("mean": divided by N; "sum" and "token_count" as they are) against the whole batch's. Where
    the twin has modules that compute over the batch (BatchNorm in train mode), a window differs
    from one batch by design: they are named, and both gradients taken again with them in eval
    mode, so that the rest is judged."""
    subject.prepare(twin)
    batches = subject.whole_batch() if full_batch else None
    accumulated, loss = _twin_accumulated(subject, twin, params, progress)
    if not full_batch:
        return Float64Pass(accumulated, loss, None)
    gap = _full_batch_gap(subject, twin, params, batches, accumulated)
    by_design = batch_level_modules(twin) if isinstance(twin, torch.nn.Module) else []
    if by_design:
        with batch_statistics_off(twin) as removed:
            rest = _full_batch_gap(subject, twin, params, batches,
                                   _twin_accumulated(subject, twin, params, progress)[0]) if removed else None
        gap.hypotheses = Hypotheses(by_design=by_design, rest=rest)
    return Float64Pass(accumulated, loss, gap)


def _twin_accumulated(subject: Subject, twin: Any, params: dict[str, Any],
                      progress: Progress | None) -> tuple[dict[str, np.ndarray], float]:
    """The twin's N micro-steps: its accumulated gradients and its mean loss."""
    result = accumulate(params, subject.step_loss(twin), subject.steps, None, progress, "float64 model",
                        hold_refs=subject.hold_refs, backward_error=_backward_error(subject))
    return {name: to_numpy(g) for name, g in result["native"].items()}, result["loss"]


def _full_batch_gap(subject: Subject, twin: Any, params: dict[str, Any], batches: Any,
                    accumulated: dict[str, np.ndarray]) -> FullBatchGap:
    """The twin's gradient of the micro-batches as one batch, beside ``accumulated`` scaled as
    the loop scales it."""
    for p in params.values():
        p.grad = None
    _backward(subject, subject.whole_loss(twin, batches), "the micro-batches joined into one batch")
    full = {name: to_numpy(p.grad) if p.grad is not None else np.zeros(tuple(p.shape)) for name, p in params.items()}
    scale, scaled_by = window_scale(subject.reduction, subject.steps)
    return FullBatchGap(normalisation=subject.reduction, accumulated_scaled_by=scaled_by,
                        accumulated={name: g * scale for name, g in accumulated.items()}, full=full,
                        item_counts=subject.item_counts())


def replay(subject: Subject, names: list[str], progress: Progress | None) -> Iterator[dict[str, np.ndarray]]:
    """The micro-gradients of ``names`` again, one micro-step at a time, as the first pass computed
    them (no fault, ``.grad`` cleared before each step, unscaled): the judge's second pass."""
    params, steps, scale = subject.params, subject.steps, subject.scale
    with subject.kept(), deterministic(subject.device, warn_only=not subject.strict), isolated(subject.device):
        subject.prepare(subject.model)
        loss_of = subject.step_loss(subject.model)
        for index in range(steps):
            for p in params.values():
                p.grad = None
            _backward(subject, loss_of(index), index)
            yield {name: _unscaled(params[name], scale) for name in names}
            if progress is not None:
                progress("second pass: the flagged tensors' micro-gradients", index + 1, steps)


def _backward(subject: Subject, loss: Any, where: int | str) -> None:
    """``loss.backward()``; what the user's hooks raise in it as ``Subject.backward_error`` has it."""
    try:
        loss.backward()
    except AccumcheckError:
        raise
    except USER_EXCEPTIONS as exc:
        error = subject.backward_error(exc, where)
        if error is None:
            raise
        raise error from exc


def _unscaled(param: Any, scale: float | None) -> np.ndarray:
    """A parameter's micro-gradient on the host, divided by the loss scale (a power of two: exact)."""
    grad = to_numpy(param.grad) if param.grad is not None else np.zeros(tuple(param.shape), np.float32)
    return grad / np.asarray(scale, grad.dtype) if scale is not None else grad.copy()


def _backward_error(subject: Subject) -> Callable[[BaseException, int], Exception] | None:
    if type(subject).backward_error is Subject.backward_error:
        return None
    return subject.backward_error  # type: ignore[return-value]
