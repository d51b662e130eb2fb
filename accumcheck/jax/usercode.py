"""How a check calls your code: the batches and loss_fn on each micro-batch, an exception they raise
made one line that names the micro-batch, and loss_fn's output checked on the first."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import USER_EXCEPTIONS, AccumcheckError, UserCodeError, first_line
from ..run.usermodel import Batch

LossFn = Callable[[Any, Batch], Any]


def guarded(jit: bool, index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its exception (not an AccumcheckError) turned into one line naming the
    micro-batch and ``what`` raised it ("batches" or "loss_fn")."""
    try:
        return fn(*args)
    except AccumcheckError:
        raise
    except USER_EXCEPTIONS as exc:
        hint = "check that loss_fn(params, batch) takes your params and batches"
        traced = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)
        if jit and (isinstance(exc, traced) or "is not a valid JAX type" in str(exc)):
            hint += "; under jit loss_fn is traced: pass jit=False if it needs concrete values"
        raise UserCodeError(f"check: {what} raised {type(exc).__name__} on micro-batch {index}: "
                            f"{first_line(exc)}; {hint}") from exc


def oracle_guarded(jit: bool, index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``guarded`` for the float64 oracle: loss_fn's exception (any) says that it ran on a float64 copy."""
    if what != "loss_fn":
        return guarded(jit, index, what, fn, *args)
    try:
        return fn(*args)
    except USER_EXCEPTIONS as exc:
        raise UserCodeError(f"check: oracle=True runs loss_fn on a float64 copy of params (JAX's x64 mode) "
                            f"and it raised {type(exc).__name__} on micro-batch {index}: {first_line(exc)}; "
                            "let loss_fn follow its params' dtype, or run without oracle") from exc


def check_loss(loss_fn: LossFn, jit: bool, params: Any, batch: Batch, index: int) -> None:
    """loss_fn's output on micro-batch ``index`` (traced without running, or run where jit is
    off: loss_fn may need concrete values then): a float scalar."""
    out = guarded(jit, index, "loss_fn", jax.eval_shape if jit else _call, loss_fn, params, batch)
    if isinstance(out, (tuple, list)):
        raise AccumcheckError(f"check: loss_fn returned a {type(out).__name__} of {len(out)} items on micro-batch "
                              f"{index}; it must return the scalar loss alone (wrap it: lambda p, b: loss_fn(p, b)[0])")
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or dtype is None:
        raise AccumcheckError(f"check: loss_fn returned a {type(out).__name__} on micro-batch {index}, not an array; "
                              "return the scalar loss")
    if tuple(shape) != ():
        raise AccumcheckError(f"check: loss_fn returned an array of shape {tuple(shape)} on micro-batch {index}, not "
                              "a scalar; reduce it to the loss (e.g. .mean()) inside loss_fn")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise AccumcheckError(f"check: loss_fn returned a {np.dtype(dtype).name} scalar on micro-batch {index}; "
                              "the loss must be a float to be differentiated")


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)
