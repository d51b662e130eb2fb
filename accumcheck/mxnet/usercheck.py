"""Check gradient accumulation on your own MXNet Gluon block.

    import accumcheck.mxnet
    report = accumcheck.mxnet.check(net, loss_fn, batches, accum_steps=16)
    accumcheck.assert_faithful(report)

The block runs once with ``grad_req='add'`` and once with ``grad_req='write'`` plus a buffer, on
the same batches; each parameter tensor is judged as ``accumcheck compare`` judges a case. The
block is left as it was found, also when the check raises: parameters (BatchNorm's running
statistics too, and weights the user's code edited), their ``grad_req`` and gradients, parameters
still waiting for deferred initialisation, Dropout rates, the blocks' attributes; and Python's and
NumPy's random states.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..case.definition import infer_kind
from ..errors import AccumcheckError, NothingJudgedError, UserCodeError
from ..judge import build_report
from ..report import Report
from ..run.backend import Progress
from ..run.checkargs import CheckShape
from ..run.faults import resolve_fault
from ..run.resources import check_resources, estimate_model
from ..run.results import FullBatchGap, RunResult
from ..run.usermodel import Batch, batch_source, host_random_states
from .blockstate import (
    AuxState,
    WeightsKept,
    attributes_kept,
    deferred_kept,
    materialised,
    never_initialised,
    unique_params,
)
from .engine import KERNEL_ALLOWANCE, Gradients, Model, accumulations, passes, replay
from .fullbatch import float64_passes, join
from .library import mx
from .microstep import MicroStep, StepFunction, backward_error, guarded

Batches = Sequence[Batch] | Iterable[Batch] | Callable[[int], Batch]
# The shared options it honours: all but memory_budget. A loss_reduction of None is Gluon's
# convention: per-example losses, which backward() sums.
SHAPE = CheckShape("accumcheck.mxnet.check", frozenset(
    ("device", "step", "mode", "oracle", "inject", "full_batch", "collate", "loss_reduction", "train_mode", "force",
     "progress")), reduction="sum",
    why_not={"memory_budget": "it runs every parameter at once; PyTorch's check runs them in groups"},
    renamed={"block": "model", "ctx": "device"})


def check(model: Any, loss_fn: Callable[..., Any] | None = None, batches: Batches | None = None,
          accum_steps: int | None = None, *, device: Any = None, step: StepFunction | None = None,
          mode: str = "native", oracle: bool = False, inject: str | None = None, full_batch: bool = False,
          collate: Callable[[list[Batch]], Batch] | None = None, loss_reduction: str | None = None,
          train_mode: bool = False, memory_budget: int | str | None = None, force: bool = False,
          progress: Progress | None = None) -> Report:
    """Accumulate ``accum_steps`` micro-batches natively and by hand, and judge every parameter.

    ``model`` is an initialised Gluon Block (hybridized or not; deferred initialisation is fine).
    ``batches`` is a sequence or iterable of batches (the first ``accum_steps`` are used; default
    all) or a function of the micro-step index. A batch is ``(inputs, label)`` for
    ``loss_fn(output, label)``; ``(inputs,)``, ``(inputs, None)`` or bare inputs for
    ``loss_fn(output)``; without ``loss_fn`` the block's inputs, and the block returns its own loss.
    Inputs are passed as ``block(x)``, ``block(*tuple)``, or a dict by the names of the block's
    forward parameters; NDArrays and numpy arrays are moved to ``device``: an ``mx.Context`` or
    "cpu", "gpu", "gpu:N", "cuda:N" (default: the parameters' first context; it must be one of
    theirs). ``step(block, batch)`` instead computes the loss itself.

    It takes the call shape every framework's check shares (``accumcheck.run.checkargs``) and
    honours all of it but ``memory_budget``, refused when given (it runs every parameter at once).
    ``mode`` fills the native slot with ``grad_req='add'`` ("native") or
    ``accumcheck.mxnet.GradAccumulator`` ("accumulator", "compensated": float32 buffers fed by
    ``grad_req='write'``, the totals written back into the gradients). ``train_mode`` records with
    BatchNorm on batch statistics (Dropout stays off). ``oracle`` also accumulates on a float64
    copy of the block (your floating inputs widened) and reports each mode's distance from it.
    ``full_batch`` also runs the N micro-batches as one batch (joined along axis 0, or by
    ``collate``) on a float64 copy of the block and judges the accumulated gradient against it: as
    it is for a ``loss_reduction`` "sum" loop (Gluon's per-example losses, whose backward() sums
    them), divided by N for "mean" (each micro-batch's mean loss); None is Gluon's convention,
    "sum". ``inject`` (e.g. ``"scale"``, ``"drop-step:dense0_weight"``) perturbs the native
    accumulation to prove the check fires. A check that would need more memory beside the block
    than is available is refused unless ``force``. Returns a Report; raises AccumcheckError for bad
    input, UserCodeError for an exception raised by the batches, the block, the loss or the step
    function (SystemExit too; a backward() of their own, weights they edit), NothingJudgedError
    when no parameter received a gradient. The block and the random states are left as found,
    also when it raises.
    """
    started = time.perf_counter()
    shared = SHAPE.validate(loss_fn=loss_fn, batches=batches, accum_steps=accum_steps, device=device, step=step,
                            mode=mode, oracle=oracle, inject=inject, full_batch=full_batch, collate=collate,
                            loss_reduction=loss_reduction, train_mode=train_mode, memory_budget=memory_budget,
                            force=force, progress=progress)
    fault, loss_reduction = shared.fault, shared.loss_reduction
    if not isinstance(model, mx.gluon.Block):
        raise AccumcheckError(f"check: model must be a gluon.Block, got a {type(model).__name__}")
    block = model
    everything, aliases = unique_params(block)
    _check_initialised(everything)
    ctx = _context(everything, device)
    with _as_found(block, everything) as weights, deferred_kept(everything, block) as deferred:
        get_batch, steps = batch_source(batches, accum_steps)
        # The float64 passes' micro-batches, read once; ones that do not join are refused before anything runs.
        listed = [guarded(k, "batches", get_batch, k) for k in range(steps)] if oracle or full_batch else []
        whole = join(listed, collate) if full_batch else None
        micro = MicroStep(block, get_batch, ctx, loss_fn, step)
        notes = ["hybridized" if getattr(block, "_active", False) else "imperative", _mode_note(train_mode)]
        if deferred:
            micro(0)  # no recording: the forward that initialises them, as the block's first call would
            notes.append("parameters initialised from micro-batch 0's shapes (deferred initialisation), "
                         "deferred again afterwards")
        params = {name: p for name, p in everything.items() if materialised(p) and p.grad_req != "null"}
        idle = [name for name in deferred if not materialised(everything[name])]
        if idle:
            notes.append(f"not initialised by micro-batch 0, so not judged: {', '.join(idle)}")
        if not params:
            raise AccumcheckError("check: the block has no parameter with a gradient (all grad_req='null')")
        kinds = {name: infer_kind(name, len(p.shape)) for name, p in params.items()}
        if fault is not None:
            fault = resolve_fault(fault, list(kinds.items()), steps)
        elements = sum(int(np.prod(p.shape)) for p in params.values())
        check_resources(estimate_model(elements, oracle or full_batch), "check", force=force)
        aux = AuxState({name: p for name, p in everything.items() if materialised(p) and p.grad_req == "null"})
        model = Model(block, params, micro, ctx, steps, aux, train_mode, keep_grads=True)
        grads = passes(model, mode, fault, progress, counting=True)
        _refuse_edited(weights, micro)
        oracle_grads, gap = None, None
        if oracle or full_batch:
            twins: list[MicroStep] = []  # the micro-steps on the float64 copy: the last one names a failing batch

            def micro_on(other: Any, get: Callable[[int], Batch]) -> MicroStep:
                twins.append(MicroStep(other, get, micro.ctx, micro.loss_fn, micro.step, " on the float64 copy"))
                return twins[-1]

            try:
                oracle_grads, gap = float64_passes(block, micro_on, listed, whole, ctx, loss_reduction,
                                                   loss_fn is not None, train_mode, progress)
            except mx.base.MXNetError as exc:
                failed = (twins or [micro])[-1]
                raise backward_error(exc, failed, "the float64 pass") from exc
        settings = {"hybridize": bool(getattr(block, "_active", False)), "train_mode": train_mode, "mode": mode}
        run = _run_result(model, kinds, aliases, grads, notes, settings, mode, gap, oracle_grads if oracle else None)
        loss = "step" if step is not None else "loss_fn" if loss_fn is not None else "output.loss"
        options = {"inject": inject, "train_mode": train_mode or None, "mode": None if mode == "native" else mode,
                   "oracle": oracle or None, "full_batch": full_batch or None,
                   "loss_reduction": loss_reduction if full_batch else None}
        # Judged while deferred parameters are still initialised: the second pass runs the block again.
        try:
            return build_report(None, run, steps, fault, oracle, time.perf_counter() - started,
                                config={"model": type(block).__name__, "loss": loss,
                                        **{k: v for k, v in options.items() if v is not None}},
                                replay=partial(replay, model, progress=progress))
        except NothingJudgedError as exc:
            raise NothingJudgedError(
                f"check: nothing was judged: none of the block's {len(params)} parameters with a gradient received "
                f"a non-zero one in the {steps} micro-batch{'es' * (steps != 1)}; make the loss depend on the "
                "block's parameters (a constant loss, or one multiplied by zero, gives none)") from exc


check.shape = SHAPE  # type: ignore[attr-defined]  # what the setup file and the plugin read (checkargs.shape_of)


@contextmanager
def _as_found(block: Any, params: dict[str, Any]) -> Iterator[WeightsKept]:
    """Afterwards, also when the check raises, what the user's code may change while it runs:
    Python's and NumPy's random states, the blocks' attributes, the weights' values (yielded, to
    tell whether the user's code edited them)."""
    weights = WeightsKept({name: p for name, p in params.items() if materialised(p) and p.grad_req != "null"})
    try:
        with host_random_states(), attributes_kept(block):
            yield weights
    finally:
        weights.restore()


def _refuse_edited(weights: WeightsKept, micro: MicroStep) -> None:
    """A check needs the same weights in both passes: the user's code that edits them is refused
    (they are put back afterwards)."""
    edited = weights.changed()
    if edited:
        more = f" and {len(edited) - 1} more" if len(edited) > 1 else ""
        raise UserCodeError(f"check: the weights changed while the check ran ({edited[0]}{more}): your "
                            f"{micro.what} edits them (set_data, data()[:] = ..., an optimizer step); a check needs "
                            "the same weights in every micro-batch: leave the update out (they are put back)")


def _run_result(model: Model, kinds: dict[str, str], aliases: dict[str, tuple[str, ...]], grads: Gradients,
                notes: list[str], settings: dict[str, Any], mode: str = "native", gap: FullBatchGap | None = None,
                oracle: dict[str, np.ndarray] | None = None) -> RunResult:
    # A GradAccumulator sums in float32 from grad_req='write' gradients: the manual pass's rounding.
    param_dtype = np.dtype(next(iter(model.params.values())).dtype).name if mode == "native" else "float32"
    return RunResult(params=accumulations(model, grads, kinds, oracle, param_dtype, aliases), framework="mxnet",
                     versions={"mxnet": mx.__version__}, device=str(model.ctx), param_dtype=param_dtype,
                     accum_dtype="float32", native_kernel_allowance=KERNEL_ALLOWANCE if mode == "native" else 0.0,
                     losses=grads.losses, settings=settings, notes=notes, full_batch=gap)


def _check_initialised(params: dict[str, Any]) -> None:
    if not params:
        raise AccumcheckError("check: the block has no parameters")
    missing = never_initialised(params)
    if missing:
        raise AccumcheckError(f"check: the block is not initialised (parameter {missing[0]!r} has no value); "
                              "call net.initialize() (e.g. net.initialize(mx.init.Xavier())) before check")


def _context(params: dict[str, Any], device: Any) -> Any:
    """The context to run on: ``device`` (an mx.Context, or a device name as PyTorch's check takes
    it), which must be one of the parameters' contexts; by default their first."""
    where = next(iter(params.values())).list_ctx()
    if device is None:
        return where[0]
    if isinstance(device, mx.Context):
        found = [ctx for ctx in where if ctx == device]
    else:
        kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
        if kind not in ("cpu", "gpu", "cuda") or (index and not index.isdigit()):
            raise AccumcheckError(f"check: device {device!r} is not a device MXNet has; pass an mx.Context "
                                  "(mx.cpu(), mx.gpu(1)) or one of cpu, gpu, gpu:N, cuda:N")
        found = [ctx for ctx in where if ctx.device_type == ("cpu" if kind == "cpu" else "gpu")
                 and (not index or ctx.device_id == int(index))]
    if not found:
        raise AccumcheckError(f"check: the block's parameters are on {where[0]}, not {device}; "
                              f"pass device=mx.{where[0]} or initialise the block on {device}")
    return found[0]


def _mode_note(train_mode: bool) -> str:
    if train_mode:
        return "train_mode: BatchNorm on batch statistics, Dropout off"
    return "BatchNorm on running statistics, Dropout off"
