"""A small NDArray's values on the host, handed over by MXNet's engine once they are computed.

MXNet's Python API can only wait for an array (``asnumpy``, ``wait_to_read``); it cannot ask
whether one is ready. So the copy goes through a custom operator: the engine runs its
``forward`` once the array's value exists, on its own custom-operator thread, where reading the
value waits for nothing, and it leaves the values in ``ARRIVED``. The caller's thread only looks
in that dict: the analogue of a non-blocking copy and a CUDA event's ``query()``.
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
        ARRIVED[self.key] = in_data[0].asnumpy()

    def backward(self, req: Any, out_grad: Any, in_data: Any, out_data: Any, in_grad: Any, aux: Any) -> None:
        pass


@mx.operator.register(OP_TYPE)
class _DeliverProp(mx.operator.CustomOpProp):
    def __init__(self, key: str) -> None:  # a custom operator's arguments arrive as strings
        super().__init__(need_top_grad=False)
        self.key = int(key)

    def list_arguments(self) -> list[str]:
        return ["data"]

    def list_outputs(self) -> list[str]:
        return ["done"]

    def infer_shape(self, in_shape: list) -> tuple[list, list, list]:
        return in_shape, [(1,)], []

    def create_operator(self, ctx: Any, shapes: Any, dtypes: Any) -> _Deliver:
        return _Deliver(self.key)


class HostCopy:
    """``array`` (small, one dimension) copied to the host when the engine has computed it, with
    ``payload`` kept for whoever reads it. Nothing here waits for the engine but ``wait``."""

    def __init__(self, array: Any, payload: Any) -> None:
        self.payload, self.key = payload, next(_keys)
        on_cpu = array.as_in_context(mx.cpu())  # an engine copy from a GPU; the array itself on the CPU
        with mx.autograd.pause():
            self._done = mx.nd.Custom(on_cpu, key=str(self.key), op_type=OP_TYPE)

    def ready(self) -> bool:
        return self.key in ARRIVED

    def wait(self) -> None:
        """Until the values have arrived (flush, the end of training)."""
        self._done.wait_to_read()

    def values(self) -> np.ndarray:
        return ARRIVED.pop(self.key)
