"""One micro-step: a batch through the block and the loss, as ``(loss, output)``, for the passes to
record and differentiate. A user's micro-step turns what their code raises into a one-line
UserCodeError naming the micro-batch; a built-in case's raises what MXNet raises (a missing float64
kernel, for one, which the oracle and the full batch fall back from)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import USER_EXCEPTIONS, AccumcheckError, UserCodeError, first_line
from ..run.usermodel import Batch, apply_loss, call_model, map_leaves, model_error, own_loss, split_batch
from .library import mx

CPP_TRACEBACK = ("Traceback (most recent call last)", "  File ")
CPP_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # "[10:37:19] ../src/operator/nn/convolution.cc:151: "
# Block.__call__ takes no keyword arguments in MXNet 1.x: a dict meets forward's parameter names.
GLUON_CALLS = "a tuple is passed as block(*inputs), a dict by the names of forward's parameters"
StepFunction = Callable[[Any, Batch], Any]
OWN_BACKWARD = "return the loss; accumcheck calls backward itself"
# What MXNet says when backward() meets a loss whose graph is gone or was never recorded.
NOT_RECORDED = "not in a computational graph"


class MicroStep:
    """Micro-step ``index`` on ``ctx``: (loss, output), from batch ``get_batch(index)`` through
    ``block`` and ``loss_fn``, or through ``step(block, batch)``. Where the code is the user's
    (``user``), an exception it raises becomes a one-line UserCodeError naming the micro-batch, and
    with ``probe`` set (the parameters, their gradients zeroed) the next call also makes sure that
    it did not call backward() itself."""

    def __init__(self, block: Any, get_batch: Callable[[int], Batch], ctx: Any, loss_fn: Callable[..., Any] | None,
                 step: StepFunction | None, where: str = "", user: bool = True):
        self.block, self.get_batch, self.ctx, self.loss_fn, self.step = block, get_batch, ctx, loss_fn, step
        self.index, self.where = 0, where  # where: said after the failing part's name (" on the float64 copy")
        self.user = user
        self.probe: dict[str, Any] | None = None
        self.what = "step" if step is not None else "block or loss_fn" if loss_fn is not None else "block"

    def __call__(self, index: int) -> tuple[Any, Any]:
        self.index = index
        call = guarded if self.user else _unguarded
        batch = on_context(call(index, "batches", self.get_batch, index), self.ctx)
        where = self.where
        if self.step is not None:
            loss = call(index, f"step{where}", self.step, self.block, batch)
            result = _loss_array(loss, "step"), loss
        else:
            inputs, target = split_batch(batch, self.loss_fn is not None)
            out = call(index, f"the block{where}", call_block, self.block, inputs)
            if self.loss_fn is None:
                result = call(index, f"the block's output{where}", own_loss, out, _is_scalar), out
            else:
                loss = call(index, f"loss_fn{where}", apply_loss, self.loss_fn, out, target)
                result = _loss_array(loss, "loss_fn"), out
        if self.probe is not None:
            params, self.probe = self.probe, None
            if any(np.any(g.asnumpy()) for p in params.values() for g in p.list_grad()):
                raise UserCodeError(f"check: your {self.what} called backward() itself on micro-batch {index} (the "
                                    f"gradients, zeroed before it, were not zero when it returned); {OWN_BACKWARD}")
        return result

    @contextmanager
    def probing(self, params: dict[str, Any]) -> Iterator[None]:
        """The user's code is probed on the next call for a backward() of its own (``params``'
        gradients must be zeroed before it); not afterwards."""
        self.probe = params if self.user else None
        try:
            yield
        finally:
            self.probe = None

    @contextmanager
    def errors(self, phase: str) -> Iterator[None]:
        """An MXNetError raised meanwhile by backward() (or by an operator at the next wait) on the
        user's micro-batch as the one line that names it (``backward_error``)."""
        try:
            yield
        except mx.base.MXNetError as exc:
            if not self.user:
                raise
            raise backward_error(exc, self, phase) from exc


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


def _unguarded(index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def backward_error(exc: BaseException, micro: MicroStep, phase: str) -> UserCodeError:
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
