"""A simulated accelerator that records every read of a device value on the host.

A CPU-only build has no device whose host reads the dispatcher can see: on the CPU, ``.cpu()``,
``.to("cpu")``, ``.tolist()`` and ``.numpy()`` never reach it. Here tensors on the ``meta``
device stand for a device's tensors, each with a CPU twin holding its values; every operator
runs on the twins, and each one that reads a device value on the host is recorded:
``_local_scalar_dense`` (``.item()``, ``float()``, ``int()``, ``bool()``, ``if t:``) and blocking
copies to the CPU (``.cpu()``, ``.to("cpu")``, ``.tolist()``). ``.numpy()`` and ``np.asarray``
raise on a meta tensor, which fails a test just as well. Non-blocking copies are what an
asynchronous host copy does, and are not recorded.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
META = torch.device("meta")
CPU = torch.device("cpu")


def _is_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


def _targets(kwargs, kind) -> bool:
    target = kwargs.get("device")
    return target is not None and torch.device(target).type == kind


class _Factories(TorchFunctionMode):
    # torch.tensor(data, device=...) builds its tensor without an operator the dispatcher sees
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and _targets(kwargs, "meta"):
            return func(*args, **{**kwargs, "device": CPU}).to(META)
        return func(*args, **kwargs)


class SimulatedDevice(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.twins = WeakIdKeyDictionary()
        self.reads: list[str] = []

    @contextlib.contextmanager
    def active(self):
        with _Factories(), self:
            yield self

    def put(self, cpu: torch.Tensor) -> torch.Tensor:
        """A device tensor holding ``cpu``'s values (shared, not copied)."""
        device = torch.empty_strided(cpu.size(), cpu.stride(), dtype=cpu.dtype, device=META)
        self.twins[device] = cpu
        return device

    def values(self, device: torch.Tensor) -> torch.Tensor:
        return self.twins[device]

    def _twin(self, x):
        if _is_device(x):
            return self.twins[x]
        if isinstance(x, torch.device) and x.type == "meta":
            return CPU
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if _is_device(t)]
        if func is aten._local_scalar_dense.default and inputs:
            self.reads.append("_local_scalar_dense (item, float, int, bool)")
        if func is aten._to_copy.default and inputs and _targets(kwargs, "cpu"):
            if not kwargs.get("non_blocking", False):
                self.reads.append("_to_copy to cpu")
            return func(*tree_map(self._twin, args), **kwargs)
        if func is aten.copy_.default and not _is_device(args[0]) and _is_device(args[1]):
            if not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking", False):
                self.reads.append("copy_ to cpu")
            return func(*tree_map(self._twin, args), **kwargs)
        out = func(*tree_map(self._twin, args), **tree_map(self._twin, kwargs))
        if not inputs and not _targets(kwargs, "meta"):
            return out
        aliases = {id(self.twins[t]): t for t in inputs}  # in-place ops return their argument

        def to_device(x):
            if not isinstance(x, torch.Tensor):
                return x
            alias = aliases.get(id(x))
            return self.put(x) if alias is None else alias

        return tree_map(to_device, out)
