"""The JAX engine: a parameter set, a loss function of it and the micro-batches (a built-in case's,
or your own params, loss_fn and batches) run one way.

Each micro-step's gradient (``jax.value_and_grad`` of the loss, jit-compiled unless turned off) is
computed once and fed to native, manual, E and S alike (``passes.accumulate``); the float64
oracle runs the same loss on a float64 copy of the parameters (``float64_oracle``); the judge's
second pass replays the micro-gradients with the same compiled gradient of the same arrays and
batches (``replay``), so bit for bit those the run fed both modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ..run.backend import Progress
from ..run.faults import Fault
from ..run.results import ParamAccumulation, RunResult
from .devices import devices_of
from .library import enable_x64
from .multisteps import mean_allowance
from .passes import accumulate, host_float

# grad_of(params, batch) -> (loss, grads), or ((loss, aux), grads) for a loss with aux
GradFn = Callable[[Any, Any], Any]
# guard(index, what, fn, *args) -> fn(*args): how the batches ("batches") and the gradient ("loss_fn") are called
Guard = Callable[..., Any]


class Params(Protocol):
    """A parameter set the engine runs: its arrays by name (``names``: the report's order)."""

    names: list[str]
    kinds: dict[str, str]
    dtypes: dict[str, str]  # each array's dtype in the run
    param_dtype: str  # the report's parameter dtype
    accum_dtype: str  # the manual buffer's

    def arrays(self, dtype: Any = None) -> dict[str, Any]:
        """name -> a new jax array, in the run's dtype or ``dtype``, where the run is."""

    def tree(self, flat: dict[str, Any]) -> Any:
        """The pytree the loss function takes, of the arrays of ``flat``."""

    def flat(self, grads: Any) -> dict[str, Any]:
        """A gradient pytree (the parameters' structure) as name -> array."""

    def wide(self) -> ContextManager[Any]:
        """JAX's x64 mode around the whole run where its parameters need it (switched back after)."""


def call(index: int, what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """The guard of code that is not the user's: ``fn(*args)``, its exception as it is."""
    return fn(*args)


def gradient(loss_fn: Callable[[Any, Any], Any], jit: bool, aux: bool = False) -> GradFn:
    """``jax.value_and_grad(loss_fn)``, jit-compiled unless ``jit`` is False."""
    step = jax.value_and_grad(loss_fn, has_aux=aux)
    return jax.jit(step) if jit else step


@dataclass(frozen=True)
class Model:
    """What the engine runs: ``params``, the gradient of the loss and the micro-batches."""

    params: Params
    grad_of: GradFn
    batches: Callable[[int], Any]  # micro-batch k, as grad_of takes it
    aux: bool = False  # the loss comes with aux (a case's logits): micro-batch 0's is kept
    guard: Guard = call
    check_first: Callable[[Any, Any, int], None] | None = None  # (params, batch, index): the loss, before the first


class MicroSteps:
    """Micro-step ``k``'s (loss, name -> gradient) for ``accumulate``, of the arrays ``flat``."""

    def __init__(self, model: Model, flat: dict[str, Any]) -> None:
        self.model, self.flat = model, flat
        self.params = model.params.tree(flat)
        self.checked = model.check_first is None
        self.first_aux: Any = None

    def __call__(self, index: int) -> tuple[Any, dict[str, Any]]:
        model = self.model
        batch = model.guard(index, "batches", model.batches, index)
        if not self.checked:
            model.check_first(self.params, batch, index)
            self.checked = True
        loss, grads = model.guard(index, "loss_fn", model.grad_of, self.params, batch)
        if model.aux:
            loss, aux = loss
            if index == 0:
                self.first_aux = aux
        return loss, model.params.flat(grads)


def run_model(model: Model, steps: int, *, jit: bool, grad_mean: bool, fault: Fault | None, oracle: Model | None,
        progress: Progress | None, versions: dict[str, str], settings: dict[str, Any],
        notes: list[str]) -> tuple[RunResult, MicroSteps]:
    """``steps`` micro-steps through ``accumulate`` (native perturbed by ``fault``), the float64
    oracle of ``oracle`` where given, as the RunResult the judge reads; and the micro-steps, for
    ``replay``."""
    params = model.params
    with params.wide():
        micro = MicroSteps(model, params.arrays())
        sums = accumulate(micro.flat, micro, steps, params.accum_dtype, jit, grad_mean, fault, progress)
    losses = {"mean_loss": sums["loss"]}
    oracle_sums = None
    if oracle is not None:
        oracle_sums, losses["oracle_mean_loss"] = float64_oracle(oracle, steps, progress)
    mixed = len(set(params.dtypes.values())) > 1
    result = RunResult(
        params=[ParamAccumulation(name, params.kinds[name], sums["native"][name], sums["manual"][name],
                                  sums["exact"][name], sums["absum"][name],
                                  oracle=None if oracle_sums is None else oracle_sums[name],
                                  dtype=params.dtypes[name] if mixed else None)
                for name in params.names],
        framework="jax", versions=versions, device=devices_of(micro.flat), param_dtype=params.param_dtype,
        accum_dtype=params.accum_dtype, native_kernel_allowance=mean_allowance(steps) if grad_mean else 0.0,
        losses=losses, settings=settings, notes=notes,
        first_logits=None if micro.first_aux is None else host_float(micro.first_aux))
    return result, micro


def float64_oracle(model: Model, steps: int, progress: Progress | None) -> tuple[dict[str, np.ndarray], float]:
    """The micro-gradients of a float64 copy of the parameters (the batches' float arrays in
    float64 too) summed in float64, and the mean loss; JAX's x64 mode for this pass only."""
    with enable_x64():
        flat = model.params.arrays(jnp.float64)
        params = model.params.tree(flat)
        sums = {name: np.zeros(flat[name].shape) for name in model.params.names}
        loss_sum = 0.0
        for index in range(steps):
            batch = float64_batch(model.guard(index, "batches", model.batches, index))
            loss, grads = model.guard(index, "loss_fn", _host_loss, model, params, batch)
            loss_sum += loss
            for name, g in model.params.flat(grads).items():
                sums[name] += np.asarray(g, np.float64)
            if progress is not None:
                progress("float64 oracle", index + 1, steps)
    return sums, loss_sum / steps


def _host_loss(model: Model, params: Any, batch: Any) -> tuple[float, Any]:
    loss, grads = model.grad_of(params, batch)
    return float(loss[0] if model.aux else loss), grads


def float64_batch(batch: Any) -> Any:
    """The batch with its float arrays in float64 (new arrays), everything else as it is."""
    def wide(leaf: Any) -> Any:
        dtype = getattr(leaf, "dtype", None)
        if hasattr(leaf, "shape") and dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            return jnp.asarray(leaf, jnp.float64)
        return leaf

    return jax.tree_util.tree_map(wide, batch)


def replay(micro: MicroSteps, steps: int, progress: Progress | None,
           names: list[str]) -> Iterator[dict[str, np.ndarray]]:
    """The micro-gradients of ``names`` again (the judge's second pass): the same compiled
    gradient of the same arrays and batches, so bit for bit those the run fed both modes. The x64
    mode, where used, is switched on around each micro-step only, never across a ``yield``."""
    for index in range(steps):
        with micro.model.params.wide():
            _, grads = micro(index)
            grads = {name: host_float(grads[name]).copy() for name in names}
        yield grads
        if progress is not None:
            progress("second pass: the flagged tensors' micro-gradients", index + 1, steps)
