"""GradAccumulator for Gluon: float32 buffers that take each micro-step's ``p.grad()``, optionally
compensated, and write the total back into the gradient before ``trainer.step()``. The fix a
training loop adopts in two lines, as ``accumcheck.torch.GradAccumulator`` is for PyTorch."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import AccumcheckError
from ..run.backend import Progress
from ..run.faults import Fault, FaultInjector, round_to_bfloat16
from .blockstate import materialised
from .library import mx
from .passes import StepFn, micro_steps, set_grad_req


class GradAccumulator:
    """Float32 buffers for gradient accumulation in Gluon, with an optional compensated
    (Neumaier) mode that keeps the sum within about one float32 ulp.

        acc = GradAccumulator(net, compensated=True)   # after the block's first forward
        for data, label in micro_batches:               # grad_req='write' (Gluon's default)
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            acc.add()                 # p.grad() into the buffers; p.grad() zeroed
        acc.apply()                   # the sums into p.grad(), in the parameters' dtype
        trainer.step(batch_size)
        acc.zero()

    ``params`` is a Block, a ParameterDict, a dict of Parameters or an iterable of them; those with
    ``grad_req='null'`` are left out. Each parameter must be initialised, on one context, with a
    dense gradient. Float16 parameters then accumulate in float32 instead of their own dtype.
    """

    def __init__(self, params: Any, dtype: Any = "float32", compensated: bool = False) -> None:
        if hasattr(params, "collect_params"):
            params = params.collect_params()
        if hasattr(params, "values"):
            params = params.values()
        unique = {id(p): p for p in params}  # a tied Parameter once
        for p in unique.values():
            if not isinstance(p, mx.gluon.Parameter):
                raise AccumcheckError(f"GradAccumulator: expected Gluon Parameters (or a Block), got "
                                      f"{type(p).__name__}")
        self.params = [p for p in unique.values() if p.grad_req != "null"]
        for p in self.params:
            _check_param(p)
        self.dtype = np.dtype(dtype).name
        self.compensated = compensated
        self.sums = [mx.nd.zeros(p.shape, ctx=p.list_ctx()[0], dtype=self.dtype) for p in self.params]
        self.carries = ([mx.nd.zeros(p.shape, ctx=p.list_ctx()[0], dtype=self.dtype) for p in self.params]
                        if compensated else None)

    def add(self) -> None:
        """Add each parameter's ``p.grad()`` (one micro-step's gradient) and zero it: with
        ``grad_req='write'`` a parameter outside the next micro-step's graph keeps its old gradient,
        which would be added again."""
        for i, p in enumerate(self.params):
            self.add_to(i, p.grad())
            p.zero_grad()

    def add_to(self, index: int, grad: Any) -> None:
        """Add ``grad`` (an NDArray) into parameter ``index``'s buffer."""
        grad = grad.astype(self.dtype, copy=False)
        total = self.sums[index]
        if self.carries is None:
            total += grad
            return
        # Neumaier: keep what each addition rounds away
        new = total + grad
        lost = mx.nd.where(mx.nd.abs(total) >= mx.nd.abs(grad), (total - new) + grad, (grad - new) + total)
        self.carries[index] += lost
        total[:] = new

    def totals(self) -> list[Any]:
        """The accumulated gradients, in the buffer dtype."""
        return [self.total(i) for i in range(len(self.sums))]

    def total(self, index: int) -> Any:
        """The accumulated gradient of parameter ``index`` so far, in the buffer dtype."""
        return self.sums[index] if self.carries is None else self.sums[index] + self.carries[index]

    def replace(self, index: int, total: Any) -> None:
        """Set parameter ``index``'s accumulated gradient to ``total`` (its carry to zero)."""
        self.sums[index][:] = total
        if self.carries is not None:
            self.carries[index][:] = 0

    def apply(self) -> None:
        """Write the accumulated gradients into ``p.grad()``, in each parameter's dtype."""
        for p, total in zip(self.params, self.totals()):
            p.grad()[:] = total.astype(p.dtype, copy=False)

    def zero(self) -> None:
        for buffers in (self.sums, self.carries or []):
            for b in buffers:
                b[:] = 0


def _check_param(p: Any) -> None:
    if not materialised(p):
        raise AccumcheckError(f"GradAccumulator: parameter {p.name} is not initialised yet (deferred initialisation "
                              "waits for the first forward); create the GradAccumulator after the block's first call")
    if len(p.list_ctx()) > 1:
        raise AccumcheckError(f"GradAccumulator: parameter {p.name} lives on {len(p.list_ctx())} contexts; it "
                              "accumulates parameters on one context (one GradAccumulator per context's copy)")
    if p.grad().stype != "default":
        raise AccumcheckError(f"GradAccumulator: parameter {p.name} has a {p.grad().stype} gradient; it accumulates "
                              "dense gradients (grad_stype='default', e.g. Embedding without sparse_grad)")


def accumulator_pass(params: dict[str, Any], step: StepFn, accum_steps: int, ctx: Any, fault: Fault | None,
                     progress: Progress | None, compensated: bool, phase: str,
                     refresh: Callable[[], None] | None = None) -> tuple[dict[str, np.ndarray], float, Any]:
    """The native slot filled by a GradAccumulator: grad_req='write', each micro-step's ``p.grad()``
    added, the totals written back into ``p.grad()`` and read from there. A fault acts on the
    accumulator's float32 buffer. Returns the gradients, the mean loss and the output of
    micro-step 0, as ``passes.native_pass`` does."""
    set_grad_req(params, {}, "write", refresh)
    for param in params.values():
        param.zero_grad()
    acc = GradAccumulator(params.values(), compensated=compensated)
    target = list(params).index(fault.param) if fault is not None else -1
    injector = None
    if fault is not None:
        injector = FaultInjector(fault, accum_steps,
                                 lambda t: mx.nd.array(round_to_bfloat16(t.asnumpy()), ctx=ctx, dtype=t.dtype))
    losses: list[Any] = []
    for index, _ in micro_steps(step, accum_steps, losses):
        if injector is not None:
            param = acc.params[target]
            grad = param.grad().astype(acc.dtype)  # a copy: the parameter's gradient is zeroed next
            param.zero_grad()
            acc.add_to(target, injector.contribution(index, grad, acc.total(target) if index else None))
            replaced = injector.after_add(index, acc.total(target))
            if replaced is not None:
                acc.replace(target, replaced)
        acc.add()
        if progress is not None:
            progress(phase, index + 1, accum_steps)
    acc.apply()
    # Read back from p.grad(), which holds the totals exactly where the parameters are float32; a
    # float16 parameter's gradient would round them, so its total is read from the buffer.
    grads = {name: (p.grad() if np.dtype(p.dtype).name == acc.dtype else total).asnumpy()
             for (name, p), total in zip(params.items(), acc.totals())}
    return grads, float(losses[1].asscalar()) / accum_steps, losses[0]
