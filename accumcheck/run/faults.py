"""Fault injection: perturb the native accumulation of one parameter, to prove the check fires.

Every fault but ``roundoff`` must be flagged; ``roundoff`` is the positive control that must not
be. The injector works on any array type with ``+`` and ``*`` (torch tensors, MXNet NDArrays), so
each backend applies the same semantics:

  drop-step    micro-step k's gradient never reaches the total
  repeat-step  micro-step k's gradient is added twice
  double-step  at micro-step k the running total is added a second time (apache/mxnet#16708)
  scale        micro-step k's gradient is scaled by 1 + 1e-3
  bf16         the running total is rounded to bfloat16 after every micro-step
  roundoff     the total is summed in blocks of four micro-steps: another valid summation order,
               inside the round-off bound by the same theorem that bounds the plain running sum
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import AccumcheckError
from ..options.choices import FAULT_KINDS

SCALE_FACTOR = 1.0 + 1e-3
ROUNDOFF_BLOCK = 4


@dataclass(frozen=True)
class Fault:
    """A fault on one parameter. ``step`` is the micro-step it hits (drop/repeat/double/scale),
    counted from 0."""

    kind: str
    param: str | None = None
    step: int | None = None

    @property
    def target(self) -> str:
        """KIND[:PARAM]: what ``--inject`` takes to aim the same fault again."""
        return self.kind + (f":{self.param}" if self.param else "")

    def __str__(self) -> str:
        return self.target + (f"@{self.step}" if self.step is not None and self.kind in _ONE_STEP else "")


_ONE_STEP = ("drop-step", "repeat-step", "double-step", "scale")


def parse_fault(text: str) -> Fault:
    """Parse ``KIND[:PARAM]``. Raises AccumcheckError for an unknown kind."""
    kind, _, param = text.partition(":")
    if kind not in FAULT_KINDS:
        raise AccumcheckError(f"--inject: unknown fault {kind!r}; choose one of {', '.join(FAULT_KINDS)} "
                              "(optionally KIND:PARAM to pick the tensor)")
    return Fault(kind, param or None)


def resolve_fault(fault: Fault, params: list[tuple[str, str]], accum_steps: int) -> Fault:
    """Fill in the target tensor and step. ``params`` lists (name, kind) pairs in model order.

    Without a PARAM the fault hits the first embedding, else the first weight. The one-step faults
    hit micro-step N//2, so that a running total exists to double."""
    names = [name for name, _ in params]
    if fault.param is not None and fault.param not in names:
        raise AccumcheckError(f"--inject {fault.kind}:{fault.param}: no parameter named {fault.param!r}; "
                              f"this case has {', '.join(names)}")
    target = fault.param
    if target is None:
        for wanted in ("embedding", "weight"):
            target = next((name for name, kind in params if kind == wanted), None)
            if target:
                break
        target = target or names[0]
    if fault.kind == "double-step" and accum_steps < 2:
        raise AccumcheckError("--inject double-step needs --accum-steps 2 or more: "
                              "with one micro-step there is no running total to count twice")
    step = accum_steps // 2 if fault.kind in _ONE_STEP else None
    return Fault(fault.kind, target, step)


class FaultInjector:
    """Applies a resolved Fault to the stream of gradients of its target parameter.

    ``contribution`` runs before the framework adds micro-step ``step``'s gradient into the
    native total and returns what should be added instead; ``after_add`` runs after, and may
    replace the total (it returns None to leave it alone)."""

    def __init__(self, fault: Fault, accum_steps: int, to_bfloat16: Callable[[Any], Any]):
        self.fault, self.accum_steps, self.to_bfloat16 = fault, accum_steps, to_bfloat16
        self._block: Any = None

    def contribution(self, step: int, grad: Any, running_total: Any) -> Any:
        kind = self.fault.kind
        if kind == "roundoff":
            self._block = grad if self._block is None else self._block + grad
            if (step + 1) % ROUNDOFF_BLOCK and step != self.accum_steps - 1:
                return grad * 0
            block, self._block = self._block, None
            return block
        if step != self.fault.step:
            return grad
        if kind == "drop-step":
            return grad * 0
        if kind == "repeat-step":
            return grad + grad
        if kind == "double-step":
            return grad if running_total is None else grad + running_total
        if kind == "scale":
            return grad * SCALE_FACTOR
        return grad

    def after_add(self, step: int, total: Any) -> Any:
        return self.to_bfloat16(total) if self.fault.kind == "bf16" else None


def round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(values), out, values).astype(np.float32)
