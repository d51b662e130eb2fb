"""A user's PyTorch model as it was found, saved before a check runs its code and put back after.

What a check, or the user's forward, loss or ``step`` run by it, may change: each module's
``_parameters`` and ``_buffers`` entries (a forward that rebinds ``self.seen = self.seen + 1``
puts a new tensor there), the values of parameters and buffers (batch-norm statistics, a weight a
``step`` edits under ``no_grad``, also through ``.data``, which no version counter sees), a
parameter's storage (``p.data = ...``), ``.grad``, ``requires_grad`` and every module's training
flag. The very tensor objects go back into their modules, with their values bit for bit.

The values are kept as one copy of every parameter and buffer, on its own device
(``snapshot_bytes``: the check counts it in its memory estimate and budget). Putting them back
reads each tensor once and writes only those whose bits differ, so a tensor nothing touched keeps
its version counter (an autograd graph the caller holds stays valid).
"""

from __future__ import annotations

import torch


def snapshot_bytes(model: torch.nn.Module) -> int:
    """Bytes of the copy ``ModelState`` keeps: every parameter and buffer of ``model``, once each."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        seen.setdefault(id(tensor), tensor)
    return sum(t.numel() * t.element_size() for t in seen.values())


class ModelState:
    """``model`` as it was when this was made; ``restore_values`` puts back the tensors and their
    values (between a check's passes), ``restore`` everything (at its end). Both may run any
    number of times."""

    def __init__(self, model: torch.nn.Module) -> None:
        modules = list(model.modules())
        self.parameter_entries = [(m, dict(m._parameters)) for m in modules]
        self.buffer_entries = [(m, dict(m._buffers)) for m in modules]
        self.training = [(m, m.training) for m in modules]
        tensors: dict[int, torch.Tensor] = {}
        for _, entries in self.parameter_entries + self.buffer_entries:
            for t in entries.values():
                if t is not None:
                    tensors.setdefault(id(t), t)
        # Per tensor: itself, its storage as found (``detach`` shares it and the version counter),
        # a copy of its values, its .grad and requires_grad.
        self.tensors = [(t, t.detach(), t.detach().clone(), t.grad, t.requires_grad) for t in tensors.values()]

    def restore_values(self) -> None:
        """Every module's parameter and buffer entries the very tensors found, on their own storage,
        with their values bit for bit."""
        for saved in (self.parameter_entries, self.buffer_entries):
            for module, entries in saved:
                current = module._parameters if saved is self.parameter_entries else module._buffers
                if len(current) != len(entries) or any(current.get(k, current) is not v for k, v in entries.items()):
                    current.clear()
                    current.update(entries)
        with torch.no_grad():
            for tensor, storage, copy, _, _ in self.tensors:
                if not _same_place(tensor, storage):
                    tensor.data = storage
                if not _same_bits(tensor, copy):
                    tensor.copy_(copy)

    def restore(self) -> None:
        """``restore_values``, and every tensor's ``.grad`` and ``requires_grad`` and every
        module's training flag as found."""
        self.restore_values()
        for tensor, _, _, grad, requires_grad in self.tensors:
            if tensor.requires_grad != requires_grad:
                tensor.requires_grad_(requires_grad)
            if tensor.grad is not grad:
                tensor.grad = grad
        for module, flag in self.training:
            module.training = flag


def _same_place(tensor: torch.Tensor, storage: torch.Tensor) -> bool:
    """Whether ``tensor`` still views the memory it was found on, in the same layout."""
    return (tensor.data_ptr() == storage.data_ptr() and tensor.dtype == storage.dtype
            and tensor.shape == storage.shape and tensor.stride() == storage.stride()
            and tensor.device == storage.device)


def _same_bits(tensor: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether ``tensor`` holds ``copy``'s values bit for bit (``torch.equal`` calls -0.0 and 0.0
    equal, and a NaN unequal to itself)."""
    try:
        return torch.equal(tensor.detach().reshape(-1).view(torch.uint8), copy.reshape(-1).view(torch.uint8))
    except (RuntimeError, TypeError):  # a layout without a byte view: copied back anyway
        return False
