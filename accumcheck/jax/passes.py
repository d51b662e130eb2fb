"""One gradient per micro-step, fed to native, manual, E and S alike.

JAX is functional: a micro-step's gradient is a value, so one backward pass feeds native
(``optax.MultiSteps``' accumulator), manual (a buffer added with ``jax.tree_util.tree_map``) and
the float64 sums E and S (on the host) with the very same micro-gradients. The gradient, the
MultiSteps update and the manual add are separate compiled functions (jit, unless turned off), so
that XLA cannot fuse one mode's arithmetic into another's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..run.backend import Progress
from .library import DTYPES, enable_x64
from .multisteps import MultiStepsNative

# micro_step(k) -> (loss, grads): micro-step k's loss and its gradient, a dict of name -> array
MicroStep = Callable[[int], tuple[Any, dict[str, Any]]]


def host_float(value: Any) -> np.ndarray:
    """A host copy in float32 or float64 (bfloat16 and float16 become float32, exactly)."""
    array = np.asarray(value)
    return array if array.dtype in (np.float32, np.float64) else array.astype(np.float32)


def accumulate(params: dict[str, Any], micro_step: MicroStep, accum_steps: int, accum_dtype: str, jit: bool,
               grad_mean: bool, fault: Any = None, progress: Progress | None = None,
               phase: str = "native (MultiSteps) + manual") -> dict[str, Any]:
    """``accum_steps`` micro-steps: {"native": MultiSteps' sums, "manual": the buffer's, "exact",
    "absum": E and S, every one a host array per name; "loss": the mean loss}. A float64 buffer
    switches JAX's 64-bit mode on around the manual adds only."""
    native = MultiStepsNative(params, accum_steps, grad_mean, jit, fault)
    wide = enable_x64 if accum_dtype == "float64" else contextlib.nullcontext
    with wide():
        manual = {name: jnp.zeros(p.shape, DTYPES[accum_dtype]) for name, p in params.items()}

    def add(acc: dict[str, Any], grads: dict[str, Any]) -> dict[str, Any]:
        return jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, grads)

    add_manual = jax.jit(add) if jit else add
    exact = {name: np.zeros(p.shape) for name, p in params.items()}
    absum = {name: np.zeros(p.shape) for name, p in params.items()}
    loss_sum = 0.0
    for step in range(accum_steps):
        loss, grads = micro_step(step)
        native.add(step, grads)
        with wide():
            manual = add_manual(manual, grads)
        for name, g in grads.items():
            g = host_float(g)
            np.add(exact[name], g, out=exact[name])
            np.add(absum[name], np.abs(g), out=absum[name])
        loss_sum += float(loss)
        if progress is not None:
            progress(phase, step + 1, accum_steps)
    return {"native": native.totals(), "manual": {name: host_float(b) for name, b in manual.items()},
            "exact": exact, "absum": absum, "loss": loss_sum / accum_steps}
