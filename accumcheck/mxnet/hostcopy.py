"""A small NDArray's values on the host, handed over by MXNet's engine once they are computed.

MXNet's Python API can only wait for an array (``asnumpy``, ``wait_to_read``); it cannot ask
whether one is ready. So the copy goes through a custom operator: the engine runs its
``forward`` once the array's value exists, on its own custom-operator thread, where reading the
value waits for nothing, and it leaves the values in ``ARRIVED``. The caller's thread only looks
in that dict: the analogue of a non-blocking copy and a CUDA event's ``query()``.

It can also append the minima and maxima of more arrays (gradients on the CPU), computed there
with numpy: MXNet 1.x's CPU min/max reductions take about ten times numpy's time.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .library import mx

OP_TYPE = "accumcheck_host_copy"
ARRIVED: dict[int, np.ndarray] = {}  # key -> values, filled on the engine's custom-operator thread
_keys = itertools.count()


class _Deliver(mx.operator.CustomOp):
    def __init__(self, key: int) -> None:
        super().__init__()
        self.key = key

    def forward(self, is_train: bool, req: Any, in_data: Any, out_data: Any, aux: Any) -> None:
        # The engine calls this once in_data is computed: asnumpy here returns at once.
        values = in_data[0].asnumpy()
        if len(in_data) > 1:
            arrays = [a.asnumpy() for a in in_data[1:]]
            values = np.concatenate([values, [a.min() for a in arrays], [a.max() for a in arrays]]).astype(np.float32)
        ARRIVED[self.key] = values

    def backward(self, req: Any, out_grad: Any, in_data: Any, out_data: Any, in_grad: Any, aux: Any) -> None:
        pass


@mx.operator.register(OP_TYPE)
class _DeliverProp(mx.operator.CustomOpProp):
    def __init__(self, key: str, extremes: str = "0") -> None:  # a custom operator's arguments arrive as strings
        super().__init__(need_top_grad=False)
        self.key, self.extremes = int(key), int(extremes)

    def list_arguments(self) -> list[str]:
        return ["data"] + [f"array{i}" for i in range(self.extremes)]

    def list_outputs(self) -> list[str]:
        return ["done"]

    def infer_shape(self, in_shape: list) -> tuple[list, list, list]:
        return in_shape, [(1,)], []

    def create_operator(self, ctx: Any, shapes: Any, dtypes: Any) -> _Deliver:
        return _Deliver(self.key)


class HostCopy:
    """``array`` (small, one dimension) copied to the host when the engine has computed it, then
    the minima and the maxima of ``extremes`` (arrays on the CPU), with ``payload`` kept for
    whoever reads it. Nothing here waits for the engine but ``wait``."""

    def __init__(self, array: Any, payload: Any, extremes: Any = ()) -> None:
        self.payload, self.key = payload, next(_keys)
        on_cpu = array.as_in_context(mx.cpu())  # an engine copy from a GPU; the array itself on the CPU
        with mx.autograd.pause():
            self._done = mx.nd.Custom(on_cpu, *extremes, key=str(self.key), extremes=str(len(extremes)),
                                      op_type=OP_TYPE)

    def ready(self) -> bool:
        return self.key in ARRIVED

    def wait(self) -> None:
        """Until the values have arrived (flush, the end of training)."""
        self._done.wait_to_read()

    def values(self) -> np.ndarray:
        return ARRIVED.pop(self.key)
