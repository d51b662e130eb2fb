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

import inspect
import re
import time
from collections.abc import Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..case.definition import infer_kind
from ..errors import USER_EXCEPTIONS, AccumcheckError, NothingJudgedError, UserCodeError, first_line
from ..judge import build_report
from ..report import Report
from ..run.backend import Progress
from ..run.checkargs import CheckShape
from ..run.faults import Fault, resolve_fault
from ..run.resources import check_resources, estimate_model
from ..run.results import FullBatchGap, ParamAccumulation, RunResult
from ..run.usermodel import (
    Batch,
    apply_loss,
    batch_source,
    call_model,
    host_random_states,
    map_leaves,
    model_error,
    own_loss,
    split_batch,
)
from .accumulator import accumulator_pass
from .blockstate import (
    AuxState,
    WeightsKept,
    attributes_kept,
    clear_cached_ops,
    deferred_kept,
    grads_kept,
    layers_for_check,
    materialised,
    never_initialised,
    unique_params,
)
from .library import mx
from .model_fullbatch import float64_passes, join
from .passes import manual_pass, micro_steps, native_pass, set_grad_req
from .run import KERNEL_ALLOWANCE

CPP_TRACEBACK = ("Traceback (most recent call last)", "  File ")
CPP_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # "[10:37:19] ../src/operator/nn/convolution.cc:151: "
Batches = Sequence[Batch] | Iterable[Batch] | Callable[[int], Batch]
# Block.__call__ takes no keyword arguments in MXNet 1.x: a dict meets forward's parameter names.
GLUON_CALLS = "a tuple is passed as block(*inputs), a dict by the names of forward's parameters"
StepFunction = Callable[[Any, Batch], Any]
OWN_BACKWARD = "return the loss; accumcheck calls backward itself"
# What MXNet says when backward() meets a loss whose graph is gone or was never recorded.
NOT_RECORDED = "not in a computational graph"
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
        grads = _passes(block, params, aux, micro, steps, ctx, fault, progress, train_mode, mode)
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
                raise _backward_error(exc, failed, "the float64 pass") from exc
        settings = {"hybridize": bool(getattr(block, "_active", False)), "train_mode": train_mode, "mode": mode}
        run = _run_result(params, kinds, aliases, grads, steps, ctx, notes, settings, mode, gap,
                          oracle_grads if oracle else None)
        loss = "step" if step is not None else "loss_fn" if loss_fn is not None else "output.loss"
        options = {"inject": inject, "train_mode": train_mode or None, "mode": None if mode == "native" else mode,
                   "oracle": oracle or None, "full_batch": full_batch or None,
                   "loss_reduction": loss_reduction if full_batch else None}
        # Judged while deferred parameters are still initialised: the second pass runs the block again.
        try:
            return build_report(None, run, steps, fault, oracle, time.perf_counter() - started,
                                config={"model": type(block).__name__, "loss": loss,
                                        **{k: v for k, v in options.items() if v is not None}},
                                replay=partial(_replay, block, params, aux, micro, steps, progress, train_mode))
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


def _replay(block: Any, params: dict[str, Any], aux: AuxState, micro: MicroStep, steps: int,
            progress: Progress | None, train_mode: bool, names: list[str]) -> Iterator[dict[str, np.ndarray]]:
    """The manual pass's micro-gradients of ``names`` again (the judge's second pass): grad_req
    'write', every gradient zeroed around each micro-step, from the auxiliary state as found; the
    block as found afterwards."""
    refresh = partial(clear_cached_ops, block)
    with grads_kept(params, block), aux.kept(), layers_for_check(block, train_mode):
        aux.restore()
        set_grad_req(params, {}, "write", refresh)
        for param in params.values():
            param.zero_grad()
        try:
            for index, _ in micro_steps(micro, steps, []):
                yield {name: params[name].grad().asnumpy() for name in names}
                for param in params.values():
                    param.zero_grad()
                if progress is not None:
                    progress("second pass: the flagged tensors' micro-gradients", index + 1, steps)
        except mx.base.MXNetError as exc:
            raise _backward_error(exc, micro, "the backward pass") from exc


class MicroStep:
    """The user's micro-step ``index`` on ``ctx``: (loss, output). An exception raised by the
    user's code becomes a one-line UserCodeError naming the micro-batch. With ``probe`` set (the
    parameters, their gradients zeroed), the next call also makes sure that the user's code did
    not call backward() itself."""

    def __init__(self, block: Any, get_batch: Callable[[int], Batch], ctx: Any, loss_fn: Callable[..., Any] | None,
                 step: StepFunction | None, where: str = ""):
        self.block, self.get_batch, self.ctx, self.loss_fn, self.step = block, get_batch, ctx, loss_fn, step
        self.index, self.where = 0, where  # where: said after the failing part's name (" on the float64 copy")
        self.probe: dict[str, Any] | None = None
        self.what = "step" if step is not None else "block or loss_fn" if loss_fn is not None else "block"

    def __call__(self, index: int) -> tuple[Any, Any]:
        self.index = index
        batch = on_context(guarded(index, "batches", self.get_batch, index), self.ctx)
        where = self.where
        if self.step is not None:
            loss = guarded(index, f"step{where}", self.step, self.block, batch)
            result = _loss_array(loss, "step"), loss
        else:
            inputs, target = split_batch(batch, self.loss_fn is not None)
            out = guarded(index, f"the block{where}", call_block, self.block, inputs)
            if self.loss_fn is None:
                result = guarded(index, f"the block's output{where}", own_loss, out, _is_scalar), out
            else:
                loss = guarded(index, f"loss_fn{where}", apply_loss, self.loss_fn, out, target)
                result = _loss_array(loss, "loss_fn"), out
        if self.probe is not None:
            params, self.probe = self.probe, None
            if any(np.any(g.asnumpy()) for p in params.values() for g in p.list_grad()):
                raise UserCodeError(f"check: your {self.what} called backward() itself on micro-batch {index} (the "
                                    f"gradients, zeroed before it, were not zero when it returned); {OWN_BACKWARD}")
        return result


def call_block(block: Any, inputs: Any) -> Any:
    """call_model, but a mapping is bound to the names of the block's forward parameters: Gluon's
    Block.__call__ takes no keyword arguments."""
    if not isinstance(inputs, Mapping):
        return call_model(block, inputs)
    hybrid = isinstance(block, mx.gluon.HybridBlock)
    signature = inspect.signature(block.hybrid_forward if hybrid else block.forward)
    params = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params[1:]] if hybrid else [p.name for p in params]  # hybrid_forward(self, F, ...)
    unknown = [key for key in inputs if key not in names]
    if unknown:
        raise AccumcheckError(f"check: the batch has {', '.join(map(repr, unknown))}, which "
                              f"{type(block).__name__}.forward does not take (it takes {', '.join(names)}); "
                              "give a dict of its parameter names, a tuple, or pass step=lambda block, batch: loss")
    count = max(names.index(key) for key in inputs) + 1
    defaults = {p.name: None if p.default is p.empty else p.default for p in params}
    return block(*(inputs[name] if name in inputs else defaults[name] for name in names[:count]))


def guarded(index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its exception (not an AccumcheckError; SystemExit too) turned into
    model_error's one line; a backward() of its own where no graph is recorded, into the fix."""
    try:
        return fn(*args)
    except AccumcheckError:
        raise
    except USER_EXCEPTIONS as exc:
        if isinstance(exc, mx.base.MXNetError) and NOT_RECORDED in str(exc):
            raise UserCodeError(f"check: {what} called backward() on micro-batch {index} and MXNet refused it "
                                f"({first_line(_readable(exc))}); {OWN_BACKWARD}") from exc
        raise model_error(_readable(exc), index, what, GLUON_CALLS) from exc


def _backward_error(exc: BaseException, micro: MicroStep, phase: str) -> UserCodeError:
    """The one line for an MXNetError raised by accumcheck's backward() (or an operator at the
    next wait) on ``micro``'s current micro-batch; raise it ``from exc``."""
    if NOT_RECORDED not in str(exc):
        return model_error(_readable(exc), micro.index, phase, GLUON_CALLS)
    return UserCodeError(f"check: the loss of micro-batch {micro.index} is {NOT_RECORDED} when accumcheck "
                         f"calls backward() on it: your {micro.what} called backward() itself, or "
                         f"computed the loss outside autograd (autograd.pause(), .detach(), a new NDArray); "
                         f"{OWN_BACKWARD}, computed from the block's output")


def on_context(value: Any, ctx: Any) -> Any:
    """NDArrays moved to ``ctx`` and numpy arrays made NDArrays there, through tuples, lists and dicts."""
    def move(leaf: Any) -> Any:
        if isinstance(leaf, mx.nd.NDArray):
            return leaf.as_in_context(ctx)
        if isinstance(leaf, np.ndarray):
            return mx.nd.array(leaf, ctx=ctx)
        return leaf

    return map_leaves(value, move)


def _passes(block: Any, params: dict[str, Any], aux: AuxState, micro: MicroStep, steps: int, ctx: Any,
            fault: Fault | None, progress: Progress | None, train_mode: bool, mode: str = "native") -> dict[str, Any]:
    """Both passes, each from the auxiliary state as found; the block as found afterwards."""
    refresh = partial(clear_cached_ops, block)
    counts: dict[str, int] = {}
    with grads_kept(params, block), aux.kept(), layers_for_check(block, train_mode):
        micro.probe = params  # both native passes zero the gradients first: micro-step 0 finds them zero
        try:
            if mode == "native":
                native, native_loss, _ = native_pass(params, micro, steps, ctx, fault, progress, refresh=refresh)
            else:
                native, native_loss, _ = accumulator_pass(params, micro, steps, ctx, fault, progress,
                                                          mode == "compensated", f"{mode}: GradAccumulator", refresh)
            aux.restore()
            manual, exact, absum, manual_loss, _ = manual_pass(params, micro, steps, ctx, progress, refresh=refresh,
                                                               counts=counts)
        except mx.base.MXNetError as exc:  # raised by backward(), or by an operator at the next wait
            raise _backward_error(exc, micro, "the backward pass") from exc
        finally:
            micro.probe = None
    return {"native": native, "manual": manual, "exact": exact, "absum": absum, "counts": counts,
            "losses": {"mean_loss": native_loss, "manual_mean_loss": manual_loss}}


def _run_result(params: dict[str, Any], kinds: dict[str, str], aliases: dict[str, tuple[str, ...]],
                grads: dict[str, Any], steps: int, ctx: Any, notes: list[str], settings: dict[str, Any],
                mode: str = "native", gap: FullBatchGap | None = None,
                oracle: dict[str, np.ndarray] | None = None) -> RunResult:
    # A GradAccumulator sums in float32 from grad_req='write' gradients: the manual pass's rounding.
    param_dtype = np.dtype(next(iter(params.values())).dtype).name if mode == "native" else "float32"
    accumulations = []
    for name, p in params.items():
        dtype, count = np.dtype(p.dtype).name, grads["counts"][name]
        accumulations.append(ParamAccumulation(
            name, kinds[name], grads["native"][name], grads["manual"][name], grads["exact"][name],
            grads["absum"][name], dtype=None if dtype == param_dtype else dtype, aliases=aliases.get(name, ()),
            steps_with_grad=count if count < steps else None, oracle=None if oracle is None else oracle[name]))
    return RunResult(params=accumulations, framework="mxnet", versions={"mxnet": mx.__version__}, device=str(ctx),
                     param_dtype=param_dtype, accum_dtype="float32",
                     native_kernel_allowance=KERNEL_ALLOWANCE if mode == "native" else 0.0,
                     losses=grads["losses"], settings=settings, notes=notes, full_batch=gap)


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


def _is_scalar(value: Any) -> bool:
    return isinstance(value, mx.nd.NDArray) and value.size == 1


def _loss_array(loss: Any, what: str) -> Any:
    if not isinstance(loss, mx.nd.NDArray):
        raise AccumcheckError(f"check: {what} returned a {type(loss).__name__}, not an NDArray; return the loss "
                              "NDArray (per example or scalar) whose backward() gives the gradients")
    return loss


def _readable(exc: BaseException) -> BaseException:
    """The exception with MXNet's C++ traceback lines and source locations taken out of its text,
    so that its first line says what failed."""
    lines = [line.removeprefix("MXNetError: ") for line in str(exc).strip().splitlines()
             if not line.startswith(CPP_TRACEBACK)]
    text = CPP_LOCATION.sub("", "\n".join(lines))
    if text == str(exc):
        return exc
    try:
        return type(exc)(text)
    except Exception:
        return exc
