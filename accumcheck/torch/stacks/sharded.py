"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as ``accumcheck.torch.AccumulationCheck`` meets it.

What FSDP2 keeps where: ``fully_shard(module)`` swaps the module's class for a dynamic subclass
``FSDP<Name>`` (FSDPModule first in its MRO, with a ``__deepcopy__`` that refuses), keeps its state
(an ``FSDPState`` holding the ``MixedPrecisionPolicy`` as ``_mp_policy``, and the param group) in
the module's ``__dict__`` under the composable API's state keys, and registers forward (pre-)hooks
and state-dict hooks bound to that state. Between steps every managed parameter is an
``nn.Parameter`` holding a DTensor whose local tensor is this rank's rows of dim 0 (a view into
FSDP's padded storage), and so is its ``.grad`` once reduce-scattered (under
``set_requires_gradient_sync(False)`` the micro-steps' gradients wait unsharded inside FSDP); in
forward and backward FSDP sets the gathered parameters (in ``param_dtype``) on the module in their
place, by ``setattr``, so a module must read its parameters from itself, not from references
kept aside. Buffers are plain tensors, the same on every rank. Parameter names
(``named_parameters()``) are the module's own.

Here: the policy as dtype names, a gradient gathered whole, and the reference a sharded model is
judged against: a plain float64 copy of it (the original classes, no FSDP state or hooks, the
gathered weights) that one process runs on the whole window. Gathering is a collective: every
rank calls these functions at the same points, in the same order.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# module attributes that fully_shard (and the composable APIs) add: dropped from the replica
_FSDP_ATTRIBUTES = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
_COMPOSABLE_STATE = "__composable_api_state_key"


def mixed_precision(model: torch.nn.Module) -> dict[str, str]:
    """The MixedPrecisionPolicy of the outermost ``fully_shard`` module of ``model`` (the root):
    ``{"param_dtype": ..., "reduce_dtype": ...}`` as dtype names ("bfloat16"), each only where the
    policy sets it; ``{}`` for the default policy or a model with no FSDP2 module."""
    root = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
    if root is None:
        return {}
    state = root._get_fsdp_state()
    policy = getattr(state, "_mp_policy", None)
    if policy is None:  # where a torch keeps it on the param group only
        group = getattr(state, "_fsdp_param_group", None)
        policy = getattr(group, "mp_policy", None)
    found = {}
    for key in ("param_dtype", "reduce_dtype"):
        dtype = getattr(policy, key, None)
        if dtype is not None:
            found[key] = str(dtype).removeprefix("torch.")
    return found


def full_gradient(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor gradient (this rank's shard) gathered whole with ``full_tensor()``, a collective
    that every rank calls in the same order; a plain tensor or None as it is."""
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def float64_replica(model: torch.nn.Module) -> torch.nn.Module:
    """An unsharded float64 copy of the FSDP2 ``model``: a plain module of its original classes,
    with no FSDP state or hooks (the model's other hooks kept, shared), its parameters (by the
    same names) plain ``nn.Parameter``s holding the gathered weights in float64 with no gradient,
    its floating buffers in float64, its training flags and dropout rates as in the model. The
    model is not changed. Collective: every rank calls it, and gets the same replica."""
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for p in model.parameters():  # model.parameters()'s order: the same gathers on every rank
            memo[id(p)] = torch.nn.Parameter(_float64(_whole(p)), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = _float64(b.detach().clone())
    modules = list(model.modules())
    for m in modules:  # the clones first: deepcopy finds them in memo and never calls FSDP's __deepcopy__
        cls = _original_class(type(m))
        memo[id(m)] = cls.__new__(cls)
    for m in modules:
        clone = memo[id(m)]
        for key, value in m.__dict__.items():
            if key in _FSDP_ATTRIBUTES or key.startswith(_COMPOSABLE_STATE):
                continue
            if key.endswith("hooks") and isinstance(value, dict):
                clone.__dict__[key] = OrderedDict((k, h) for k, h in value.items() if not _fsdp_hook(h))
                continue
            try:
                clone.__dict__[key] = copy.deepcopy(value, memo)
            except Exception:  # an attribute that does not copy (a process group, a mesh): shared
                clone.__dict__[key] = value
    return memo[id(model)]


def refresh(replica: torch.nn.Module, model: torch.nn.Module) -> None:
    """``replica``'s parameters and buffers set to ``model``'s now, in float64 (the sharded weights
    gathered: a collective, every rank calls it)."""
    params, buffers = dict(replica.named_parameters()), dict(replica.named_buffers())
    with torch.no_grad():
        for name, p in model.named_parameters():
            params[name].copy_(_whole(p))
        for name, b in model.named_buffers():
            buffers[name].copy_(b.detach())


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor (a shard) gathered, a plain tensor copied."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def _float64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float64) if tensor.is_floating_point() else tensor


def _original_class(cls: type) -> type:
    """The module's own class: the first in the MRO of ``FSDP<Name>`` that is not FSDP's."""
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def _fsdp_hook(hook: Any) -> bool:
    """A hook torch.distributed registered (FSDP's forward and state-dict hooks, bound to its
    state), seen through wrappers (functools.partial, bound methods, functools.wraps, _WrappedHook)."""
    for _ in range(8):
        if str(getattr(hook, "__module__", None) or "").startswith("torch.distributed."):
            return True
        inner = getattr(hook, "__wrapped__", None) or getattr(hook, "func", None) or \
            getattr(hook, "__func__", None) or getattr(hook, "hook", None)
        if inner is None or inner is hook:
            return False
        hook = inner
    return False
