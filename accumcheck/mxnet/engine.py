"""The engine every MXNet check runs on, a built-in case's and a user's block alike: both passes on
one block (the native slot, then the manual pass, each from the state as found), the same passes
once per group of tensors (``--memory-budget``), the judge's replay of the micro-gradients, and the
accumulations the judge reads. What it runs is a ``Model``: a block, the parameters it judges and
its micro-step."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np

from ..run.backend import Progress
from ..run.faults import Fault
from ..run.results import ParamAccumulation
from .accumulator import accumulator_pass
from .blockstate import AuxState, clear_cached_ops, grads_kept, layers_for_check
from .microstep import MicroStep
from .passes import manual_pass, micro_steps, native_pass, set_grad_req

# With grad_req='add' MXNet's backward kernels write into the gradient with kAddTo: the embedding
# backward, for one, adds each token's row straight into the running total, so a micro-step's inner
# terms are rounded at their own scale, which cancellation can make far larger than the
# micro-gradient. The native bound carries this allowance (in units of u, at the tensor's scale;
# bounds.ModeBound); docs/maths.md quotes the largest need measured on the built-in cases
# (ci/figures.py regenerates it). A GradAccumulator takes grad_req='write' gradients, computed as
# the manual pass's are: it needs none.
KERNEL_ALLOWANCE = 4.0


@dataclass
class Model:
    """What the engine runs: ``params`` (the judged Parameters of ``block``, by name), ``micro`` its
    micro-step, ``steps`` micro-steps on ``ctx``. ``aux`` (the parameters without a gradient) is
    put back before each pass and after the last; with ``keep_grads`` (a user's block) the
    gradients and their grad_req too; the layers that behave differently in training are set for
    the check (``train_mode``) and put back."""

    block: Any
    params: dict[str, Any]
    micro: MicroStep
    ctx: Any
    steps: int
    aux: AuxState = field(default_factory=lambda: AuxState({}))
    train_mode: bool = False
    keep_grads: bool = False

    def only(self, names: list[str]) -> Model:
        """The same block with only the parameters ``names`` judged."""
        return replace(self, params={name: self.params[name] for name in names})

    def refresh(self) -> None:
        clear_cached_ops(self.block)  # the next call rebuilds the cached graph for the new grad_req

    @contextmanager
    def as_found(self) -> Iterator[None]:
        kept = grads_kept(self.params, self.block) if self.keep_grads else nullcontext()
        with kept, self.aux.kept(), layers_for_check(self.block, self.train_mode):
            yield


@dataclass
class Gradients:
    """Both passes' results per parameter (numpy): the native slot's gradients, the manual pass's
    buffer, E and S; in how many micro-steps each received a gradient (where counted); the mean
    losses; micro-step 0's output (the manual pass's)."""

    native: dict[str, np.ndarray]
    manual: dict[str, np.ndarray]
    exact: dict[str, np.ndarray]
    absum: dict[str, np.ndarray]
    counts: dict[str, int]
    losses: dict[str, float]
    logits: np.ndarray | None


def passes(model: Model, mode: str, fault: Fault | None, progress: Progress | None, accum_dtype: str | None = None,
           counting: bool = False, where: str = "") -> Gradients:
    """Both passes on ``model``, each from the state as found; the block as found afterwards. The
    native slot is grad_req='add' (``mode`` "native") or a GradAccumulator ("accumulator",
    "compensated"); the manual pass adds into buffers of ``accum_dtype`` (default the
    parameter's), and with ``counting`` counts the micro-steps that gave each a gradient."""
    params, counts = model.params, {} if counting else None
    with model.as_found(), model.micro.errors("the backward pass"):
        with model.micro.probing(params):  # both native slots zero the gradients first: micro-step 0 finds them zero
            native, native_loss, _ = accumulate(model, mode, fault, progress, where=where)
        model.aux.restore()
        manual, exact, absum, manual_loss, logits = manual_pass(params, model.micro, model.steps, model.ctx, progress,
                                                                refresh=model.refresh, counts=counts,
                                                                accum_dtype=accum_dtype)
    return Gradients(native, manual, exact, absum, counts or {},
                     {"mean_loss": native_loss, "manual_mean_loss": manual_loss}, logits)


def accumulate(model: Model, mode: str, fault: Fault | None, progress: Progress | None, phase: str | None = None,
               where: str = "") -> tuple[dict[str, np.ndarray], float, Any]:
    """The native slot alone: grad_req='add' or a GradAccumulator over the micro-steps. Returns
    the gradients, the mean loss and micro-step 0's output."""
    if mode == "native":
        return native_pass(model.params, model.micro, model.steps, model.ctx, fault, progress,
                           phase=phase or f"native: grad_req='add'{where}", refresh=model.refresh)
    return accumulator_pass(model.params, model.micro, model.steps, model.ctx, fault, progress, mode == "compensated",
                            phase or f"{mode}: GradAccumulator{where}", model.refresh)


def group_passes(model: Model, groups: list[list[str]], mode: str, fault: Fault | None, progress: Progress | None,
                 accum_dtype: str | None = None, counting: bool = False) -> Iterator[Gradients]:
    """``passes`` once per group of tensors (``--memory-budget``): the native gradients read and
    the manual buffers kept for that group only; a fault only where its tensor is."""
    for index, names in enumerate(groups):
        group_fault = fault if fault is not None and fault.param in names else None
        yield passes(model.only(names), mode, group_fault, progress, accum_dtype, counting,
                     where=f", group {index + 1} of {len(groups)}")


def replay(model: Model, names: list[str], progress: Progress | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The manual pass's micro-gradients of ``names`` again (the judge's second pass), float16 as
    float32: grad_req='write', every gradient zeroed around each micro-step, from the state as
    found; the block as found afterwards."""
    params = model.params
    with model.as_found(), model.micro.errors("the backward pass"):
        model.aux.restore()
        set_grad_req(params, {}, "write", model.refresh)
        for param in params.values():
            param.zero_grad()
        for index, _ in micro_steps(model.micro, model.steps, []):
            yield {name: float32(params[name].grad().asnumpy()) for name in names}
            for param in params.values():
                param.zero_grad()
            if progress is not None:
                progress("second pass: the flagged tensors' micro-gradients", index + 1, model.steps)


def accumulations(model: Model, grads: Gradients, kinds: dict[str, str],
                  oracle: dict[str, np.ndarray] | None = None, param_dtype: str | None = None,
                  aliases: dict[str, tuple[str, ...]] | None = None) -> list[ParamAccumulation]:
    """What the judge reads per parameter. Given ``param_dtype``, a parameter of another dtype
    carries its own (a block of mixed dtypes); a parameter that received a gradient in fewer
    micro-steps than all carries their count."""
    records = []
    for name, param in model.params.items():
        dtype, count = np.dtype(param.dtype).name, grads.counts.get(name, model.steps)
        records.append(ParamAccumulation(
            name, kinds[name], grads.native[name], grads.manual[name], grads.exact[name], grads.absum[name],
            oracle=None if oracle is None else oracle[name],
            dtype=None if param_dtype is None or dtype == param_dtype else dtype,
            aliases=(aliases or {}).get(name, ()), steps_with_grad=count if count < model.steps else None))
    return records


def float32(values: np.ndarray) -> np.ndarray:
    """float16 gradients as float32 (exactly), the judge's smallest float."""
    return values.astype(np.float32) if values.dtype == np.float16 else values
