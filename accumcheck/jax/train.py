"""``accumcheck train`` on JAX: K optimizer steps of manual accumulation, with native accumulation
and a control fed the very same micro-gradients, each stepping parameters of its own.

Manual trains: each micro-step's gradient at manual's parameters (the case's compiled gradient,
``casemodel.grad_function``) is added into a float32 buffer (``tree_map``), and an inner optimizer
of its own (``optax.adam(lr)`` or ``optax.sgd(lr)``) takes the sum, or the sum over N where
MultiSteps keeps a mean. Native: ``optax.MultiSteps(inner, every_k_schedule=N, use_grad_mean=...)``
is called with each of those micro-gradients, as a user's loop calls it, and its N-th call's update
is applied (``optax.apply_updates``) to native's own parameters; an injected fault perturbs what
its target tensor's accumulator receives (``bf16`` rounds the running total after every
micro-step but the last, whose total MultiSteps hands its inner optimizer within the same call).
The control adds the same micro-gradients last to first, for parameters and an optimizer of its
own. So native and the control differ from manual by their accumulation alone, and what their
optimizers make of it. With the oracle, a float64 copy (JAX's x64 mode) trains as manual does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import AccumcheckError
from ..report import TrajectoryReport
from ..run.backend import Progress
from ..run.config import RunConfig
from ..run.faults import Fault, FaultInjector
from ..run.trajectory import Trajectory
from .casemodel import CaseParams, case_batches, grad_function
from .devices import resolve_device
from .engine import float64_batch
from .library import enable_x64, optax
from .multisteps import to_bfloat16
from .passes import host_float

OPTIMIZERS = {"adam": optax.adam, "sgd": optax.sgd}


def train(config: RunConfig, steps: int, optimizer: str, lr: float, versions: dict[str, str],
          progress: Progress | None = None) -> TrajectoryReport:
    """Run ``steps`` optimizer steps of the configured case, each over ``config.accum_steps``
    micro-steps: manual's training, MultiSteps (native) and the control fed its micro-gradients
    (and the float64 model with the oracle)."""
    case, n, fault = config.case, config.accum_steps, config.fault
    if config.option("master_weights", False):
        raise AccumcheckError("train --master-weights: the JAX trajectory trains float32 parameters, their own "
                              "master weights; drop --master-weights")
    jit, grad_mean = config.option("jit", True), config.option("grad_mean", True)
    device = resolve_device(config.device)
    weights = case.weights()
    start = CaseParams(case, weights, "float32", "float32", device)
    grad_of = grad_function(case, jit)
    batches = case_batches(case, n, "float32", device)
    make = OPTIMIZERS[optimizer]
    settings = {"native": f"optax.MultiSteps(optax.{optimizer}({lr:g}), every_k_schedule={n}, "
                          f"use_grad_mean={grad_mean}), called each micro-step; optax.apply_updates",
                "manual": f"tree_map(acc + g) into a float32 buffer, optax.{optimizer}({lr:g}) given "
                          + ("acc / N" if grad_mean else "acc"),
                "control": "as manual, the micro-gradients added last to first", "jit": str(jit)}
    manual = _Manual(start.arrays(), make(lr), n, grad_mean, jit)
    control = _Manual(start.arrays(), make(lr), n, grad_mean, jit, reverse=True)
    native = _Native(start.arrays(), make(lr), n, grad_mean, jit, fault)
    twin = None
    if config.oracle:
        with enable_x64():
            twin = _Manual(start.arrays(jnp.float64), make(lr), n, grad_mean, jit, wide=True)
    trace = Trajectory(start.kinds, oracle=twin is not None)
    for k in range(steps):
        micro = _window(grad_of, batches, manual, k, n)
        kept = [micro(index) for index in range(n)]  # manual's micro-gradients, fed to all three
        trace.loss("manual", k, manual.step(kept))
        control.step(kept)
        # An injected fault hits micro-step N//2 of every optimizer step.
        native.step(kept)
        if twin is not None:
            with enable_x64():
                wide = _window(grad_of, batches, twin, k, n, float64_batch)
                trace.loss("float64", k, twin.step([wide(index) for index in range(n)]))
        trace.record(k, native.host(), manual.host(), control.host(), twin.host() if twin is not None else None)
        if progress is not None:
            progress("train", k + 1, steps)
    return trace.report(case.name, optimizer, lr, n, steps, fault, versions, settings)


MicroStep = Callable[[int], tuple[float, dict[str, Any]]]


def _window(grad_of: Any, batches: Callable[[int], Any], model: Any, window: int, accum_steps: int,
            widen: Callable[[Any], Any] = lambda batch: batch) -> MicroStep:
    """Micro-step ``i`` of optimizer step ``window`` on ``model``'s parameters: the case's micro-batch
    ``window * N + i``, its loss and gradients."""
    def micro(index: int) -> tuple[float, dict[str, Any]]:
        (loss, _), grads = grad_of(model.params, widen(batches(window * accum_steps + index)))
        return float(loss), grads
    return micro


class _Native:
    """optax.MultiSteps over the inner optimizer, fed each micro-gradient as it comes."""

    def __init__(self, params: dict[str, Any], inner: Any, accum_steps: int, grad_mean: bool, jit: bool,
                 fault: Fault | None) -> None:
        self.params, self.accum_steps, self.grad_mean, self.fault = params, accum_steps, grad_mean, fault
        self.optimizer = optax.MultiSteps(inner, every_k_schedule=accum_steps, use_grad_mean=grad_mean)
        self.state = self.optimizer.init(params)
        self.update = jax.jit(self.optimizer.update) if jit else self.optimizer.update
        self.apply = jax.jit(optax.apply_updates) if jit else optax.apply_updates
        self.injector = FaultInjector(fault, accum_steps, to_bfloat16) if fault is not None else None

    def step(self, kept: list[tuple[float, dict[str, Any]]]) -> None:
        for index, (_, grads) in enumerate(kept):
            if self.injector is not None:
                target = self.fault.param
                running = self._running_total(target) if index else None
                grads = {**grads, target: self.injector.contribution(index, grads[target], running)}
            updates, self.state = self.update(grads, self.state, self.params)
            if self.injector is not None and self.fault.kind == "bf16" and index < self.accum_steps - 1:
                acc = dict(self.state.acc_grads)
                acc[self.fault.param] = self.injector.after_add(index, acc[self.fault.param])
                self.state = self.state._replace(acc_grads=acc)
        self.params = self.apply(self.params, updates)  # the N-th call's update: the optimizer step

    def _running_total(self, name: str) -> Any:
        acc = self.state.acc_grads[name]
        return acc * self.state.mini_step.astype(acc.dtype) if self.grad_mean else acc

    def host(self) -> dict[str, np.ndarray]:
        return {name: host_float(p) for name, p in self.params.items()}


class _Manual:
    """A buffer the micro-gradients are added into (last to first with ``reverse``), handed to the
    inner optimizer as the sum, or the sum over N where MultiSteps keeps a mean (``grad_mean``)."""

    def __init__(self, params: dict[str, Any], inner: Any, accum_steps: int, grad_mean: bool, jit: bool,
                 reverse: bool = False, wide: bool = False) -> None:
        self.params, self.optimizer, self.accum_steps = params, inner, accum_steps
        self.grad_mean, self.reverse, self.wide = grad_mean, reverse, wide
        self.state = inner.init(params)

        def add(acc: dict[str, Any], grads: dict[str, Any]) -> dict[str, Any]:
            return jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, grads)

        def mean(total: dict[str, Any]) -> dict[str, Any]:
            return jax.tree_util.tree_map(lambda t: t / accum_steps, total) if grad_mean else total

        # compiled one by one, as native's MultiSteps update and its apply_updates are
        self.add, self.mean = (jax.jit(add), jax.jit(mean)) if jit else (add, mean)
        self.update = jax.jit(inner.update) if jit else inner.update
        self.apply = jax.jit(optax.apply_updates) if jit else optax.apply_updates

    def step(self, kept: list[tuple[float, dict[str, Any]]]) -> float:
        """One optimizer step over the window's (loss, micro-gradients) ``kept``; the mean loss."""
        dtype = jnp.float64 if self.wide else jnp.float32
        with enable_x64() if self.wide else contextlib.nullcontext():
            acc = {name: jnp.zeros(p.shape, dtype) for name, p in self.params.items()}
        for _, grads in (kept[::-1] if self.reverse else kept):
            acc = self.add(acc, grads)
        updates, self.state = self.update(self.mean(acc), self.state, self.params)
        self.params = self.apply(self.params, updates)
        return sum(loss for loss, _ in kept) / self.accum_steps

    def host(self) -> dict[str, np.ndarray]:
        with enable_x64() if self.wide else contextlib.nullcontext():
            return {name: np.asarray(p) for name, p in self.params.items()}

