"""Native accumulation in JAX: ``optax.MultiSteps``' own gradient buffer.

MultiSteps(optax.sgd(1.0), every_k_schedule=N) keeps its accumulator in the dtype of the tree
``init`` was given (the parameters') in optax 0.2.1, in float32 (its ``accumulator_dtype``
default) in later releases such as 0.2.8; ``accumulator_dtype`` asks the installed optax. It emits ``-1 * acc`` at the N-th
call: the negation is exact, so the emitted update is the accumulator as MultiSteps computed it.

With ``use_grad_mean`` (optax's default) the accumulator is a running mean,
``acc + (g - acc) / (k + 1)``: three roundings a micro-step where a running sum takes one. It is
judged as N x the mean (exact for N a power of two and for bfloat16 parameters read into
float32; one more rounding otherwise). Its extra error is at most (2 + 2 H_{N-1}) u S to first
order (H the harmonic number): an error made at step k reaches N x the mean multiplied by k + 1,
and |g - acc| <= |g| + S_k / k. ``mean_allowance`` gives the judge that, with room for the
higher-order terms, as the native bound's allowance in units of u.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..run.faults import Fault, FaultInjector
from .library import enable_x64, optax


def mean_allowance(accum_steps: int) -> float:
    """The running mean's extra error over a running sum, in units of u times S."""
    harmonic = sum(1.0 / k for k in range(1, accum_steps))
    power_of_two = accum_steps & (accum_steps - 1) == 0
    return 3.0 + 3.0 * harmonic + (0.0 if power_of_two else 1.0)


def accumulator_dtype(param_dtype: str) -> str:
    """The dtype the installed optax's MultiSteps accumulates gradients of ``param_dtype`` in."""
    with enable_x64() if param_dtype == "float64" else contextlib.nullcontext():
        state = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=1).init({"p": jnp.zeros((1,), param_dtype)})
        return np.dtype(state.acc_grads["p"].dtype).name


def accumulator_note(param_dtype: str) -> str:
    """The report's note on where MultiSteps accumulates, for parameters not float32."""
    found = accumulator_dtype(param_dtype)
    if found == param_dtype:
        return f"MultiSteps' accumulator takes the parameters' dtype ({param_dtype})"
    return (f"MultiSteps' accumulator is {found} (optax's accumulator_dtype default), not the parameters' "
            f"{param_dtype}: native rounds every micro-step to {found}")


def to_bfloat16(value: Any) -> Any:
    """``value`` rounded to bfloat16 (to nearest, ties to even), in its own dtype."""
    return value.astype(jnp.bfloat16).astype(value.dtype)


class MultiStepsNative:
    """N calls of MultiSteps' update with the micro-gradients, as a user's loop makes them. A
    fault perturbs what its target parameter's accumulator receives (``accumcheck.run.faults``)."""

    def __init__(self, params: dict[str, Any], accum_steps: int, grad_mean: bool, jit: bool,
                 fault: Fault | None = None) -> None:
        self.params, self.accum_steps, self.grad_mean = params, accum_steps, grad_mean
        self.optimizer = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=accum_steps, use_grad_mean=grad_mean)
        self.state = self.optimizer.init(params)
        self.update = jax.jit(self.optimizer.update) if jit else self.optimizer.update
        self.fault = fault
        self.injector = FaultInjector(fault, accum_steps, to_bfloat16) if fault is not None else None
        self.updates: Any = None

    def add(self, step: int, grads: dict[str, Any]) -> None:
        """Micro-step ``step``'s gradients into the accumulator."""
        if self.injector is not None:
            target = self.fault.param
            total = self._running_total(target) if step else None
            grads = {**grads, target: self.injector.contribution(step, grads[target], total)}
        self.updates, self.state = self.update(grads, self.state, self.params)
        if self.injector is not None and self.fault.kind == "bf16":
            self._round_total(step)

    def _running_total(self, name: str) -> Any:
        """The sum so far of what the accumulator of ``name`` received (the mean times the count)."""
        acc = self.state.acc_grads[name]
        return acc * self.state.mini_step.astype(acc.dtype) if self.grad_mean else acc

    def _round_total(self, step: int) -> None:
        target = self.fault.param
        if step < self.accum_steps - 1:
            acc = dict(self.state.acc_grads)
            acc[target] = self.injector.after_add(step, acc[target])
            self.state = self.state._replace(acc_grads=acc)
        else:  # the accumulator is emitted (and zeroed) at the last step
            self.updates = {**self.updates, target: self.injector.after_add(step, self.updates[target])}

    def totals(self) -> dict[str, np.ndarray]:
        """Each parameter's accumulated sum on the host (float32 for bfloat16 parameters, exactly)."""
        if self.updates is None or int(self.state.mini_step) != 0:
            raise RuntimeError("MultiSteps has not emitted its update yet")
        scale = float(self.accum_steps) if self.grad_mean else 1.0
        totals = {}
        for name, update in self.updates.items():
            value = -np.asarray(update)
            if value.dtype not in (np.float32, np.float64):
                value = value.astype(np.float32)
            totals[name] = value * value.dtype.type(scale) if scale != 1.0 else value
        return totals


def harmonic_note(accum_steps: int) -> str:
    return (f"MultiSteps keeps a running mean (acc + (g - acc)/(k+1)); native is judged as {accum_steps} x that "
            f"mean, its bound allowing {mean_allowance(accum_steps):.1f} u S for the mean's extra roundings")


def settings(accum_steps: int, jit: bool, grad_mean: bool, accum_dtype: str,
             initialised_on: str = "") -> dict[str, Any]:
    """The report's settings of a JAX run: how native and manual were computed."""
    return {"jit": jit, "use_grad_mean": grad_mean, "native_allowance": "for MultiSteps' running mean (see notes)",
            "native": f"optax.MultiSteps(optax.sgd(1.0), every_k_schedule={accum_steps}, use_grad_mean={grad_mean})"
                      f"{initialised_on}: its accumulator, read from the emitted update",
            "manual": f"jax.tree_util.tree_map(acc + g) into a {accum_dtype} buffer"}
