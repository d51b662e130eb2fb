"""The model (and its optimizers) in float64 for a stack's check, dropout off, and everything put
back afterwards; float64 copies of a model for a reference computed beside a stack that runs in
its own dtypes; and the stack's optimizer inside its wrappers.
"""

from __future__ import annotations

import copy
import importlib
import os
import random
import re
import tempfile
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from ...errors import AccumcheckError, first_line
from ...run.usermodel import map_leaves

_DROPOUT_WORDS = ("dropout", "pdrop")


def stack_library(name: str, what: str) -> Any:
    """The stack's library, imported when a check first needs it; missing, one AccumcheckError
    saying what to install (``accumcheck[name]``)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise AccumcheckError(f"the {name} stack needs {what}; install it with pip install "
                              f"'accumcheck[{name}]'") from None


def float64_leaves(value: Any) -> Any:
    """``value`` with every floating tensor in it in float64 (through tuples, lists, mappings)."""
    return map_leaves(value, lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point()
                      else t)


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a stack's wrapper (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer), whose step runs only when the stack really steps."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) or type(optimizer).__name__ == "AcceleratedOptimizer":
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or seen > 8:
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise AccumcheckError(f"stack check: {type(optimizer).__name__} is not a torch optimizer and wraps none; "
                              "pass the optimizer the stack steps")
    return optimizer


class LiveRun:
    """In place of Float64Run for a check that stays on in the user's real run (sampled): nothing is
    changed, so nothing is put back."""

    float64 = False
    dropouts = 0

    def __enter__(self) -> "LiveRun":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Float64Run:
    """The model (and its optimizers) in float64 for the check (unless ``float64`` is False: a
    data-parallel or sharded stack whose communication is set up for its dtypes runs in them, and
    is judged against a float64 copy), dropout off, and everything put back on exit: parameter and buffer tensors (the very ones, so their values are bit for bit
    as before), ``.grad``, training flags, dropout rates, optimizer state and hyper-parameters,
    a ``forward`` a stack patched onto the model, and the random states the stack reseeds."""

    def __init__(self, model: torch.nn.Module, optimizers: tuple[Any, ...] = (), float64: bool = True,
                 on_disk: bool = False) -> None:
        self.model = model
        self.optimizers = [innermost_optimizer(o) for o in optimizers if o is not None]
        self.dropouts = 0
        self.float64 = float64  # False: the model keeps its dtypes (a stack judged against a float64 copy)
        self.on_disk = on_disk  # not in float64: the values to put back kept in a file, not beside the run
        self._snapshot: Snapshot | None = None

    def __enter__(self) -> "Float64Run":
        model = self.model
        self._params = [p for p in model.parameters()]
        self._data = [p.data for p in self._params]
        self._grads = [p.grad for p in self._params]
        self._buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        self._flags = [(m, m.training) for m in model.modules()]
        self._forward = model.__dict__.get("forward")
        self._rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self._optimizer_state = [(o, o.state, [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups])
                                 for o in self.optimizers]
        self._rates = self._dropout_off(model)
        if not self.float64:  # the run steps the very tensors: their values kept, to be put back
            self._hook, self._experts = None, None
            self._snapshot = Snapshot(self._params, [b for _, _, b in self._buffers], self.optimizers, self.on_disk)
            for p in self._params:
                p.grad = None
            return self
        with torch.no_grad():
            for p in self._params:
                if p.is_floating_point():
                    p.data = p.data.to(torch.float64)
                p.grad = None
            for m, name, b in self._buffers:
                if b.is_floating_point():
                    m._buffers[name] = b.to(torch.float64)
            for o in self.optimizers:  # state the optimizer already has, as copies: float64 for the run
                fresh: defaultdict[Any, dict[str, Any]] = defaultdict(dict)  # as torch's own: new params get {}
                for p, s in o.state.items():
                    fresh[p] = {k: _run_copy(v) for k, v in s.items()}
                o.state = fresh
        self._hook = model.register_forward_pre_hook(_inputs_in_float64, with_kwargs=True)
        self._experts = _eager_experts(model)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
        if self._experts is not None:
            self.model.set_experts_implementation(self._experts)
        for p, data, grad in zip(self._params, self._data, self._grads):
            p.data = data
            p.grad = grad
        for m, name, b in self._buffers:
            m._buffers[name] = b
        for m, flag in self._flags:
            m.training = flag
        for obj, attr, value in self._rates:
            setattr(obj, attr, value)
        if self._forward is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self._forward
        for o, state, groups in self._optimizer_state:
            o.state = state
            for group, saved in zip(o.param_groups, groups):
                group.update(saved)
        if self._snapshot is not None:
            self._snapshot.restore()
            self._snapshot = None
        random.setstate(self._rng[0])
        np.random.set_state(self._rng[1])
        torch.set_rng_state(self._rng[2])

    def _dropout_off(self, model: torch.nn.Module) -> list[tuple[Any, str, Any]]:
        """Every dropout rate set to 0, as (object, attribute, old value): ``nn.Dropout*`` modules'
        ``p`` and float attributes named like a dropout rate (Hugging Face attention modules
        keep ``attention_dropout`` and call the functional form)."""
        saved = []
        for m in model.modules():
            for attr, value in list(vars(m).items()):
                is_rate = (attr == "p" and isinstance(m, torch.nn.modules.dropout._DropoutNd)) or \
                    any(word in attr.lower() for word in _DROPOUT_WORDS)
                if is_rate and isinstance(value, float) and value > 0:
                    saved.append((m, attr, value))
                    setattr(m, attr, 0.0)
        self.dropouts = len(saved)
        return saved


def float64_copy(model: torch.nn.Module, shared: tuple[Any, ...] = ()) -> torch.nn.Module:
    """A copy of ``model`` in float64 sharing no storage with it, dropout off, for a reference
    computed beside a stack that runs in its own dtypes (``refresh_copy`` brings its weights up);
    the objects in ``shared`` (a Lightning module's trainer) referenced, not copied."""
    with torch.no_grad():
        copied = copy.deepcopy(model, {id(obj): obj for obj in shared}).to(torch.float64)
    for p in copied.parameters():
        p.grad = None
    return copied


def refresh_copy(copied: torch.nn.Module, model: torch.nn.Module) -> None:
    """``copied``'s parameters and buffers set to ``model``'s values now (float64)."""
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(copied.named_parameters(), model.named_parameters()):
            mine.copy_(theirs.detach())
        for (_, mine), (_, theirs) in zip(copied.named_buffers(), model.named_buffers()):
            mine.copy_(theirs.detach())


def _eager_experts(model: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face mixture-of-experts model switched to its eager experts path, whose matmuls
    run in float64 (the default ``grouped_mm`` kernel has no float64 on the CPU); its
    implementation as found, to put back, or None where nothing was switched."""
    get, set_ = getattr(model, "get_experts_implementation", None), getattr(model, "set_experts_implementation", None)
    if not (callable(get) and callable(set_)):
        return None
    found = get()
    if not isinstance(found, dict) or all(value in (None, "eager") for value in found.values()):
        return None
    set_("eager")
    return found


def float64_kernel_error(exc: BaseException) -> str | None:
    """The message of an error from an operation with no float64 kernel (``got Double``, ``not
    implemented for 'Double'``), or None for any other error."""
    text = first_line(exc)
    return text if isinstance(exc, (RuntimeError, TypeError, NotImplementedError)) and re.search(
        r"\bDouble\b|float64", text) else None


def _run_copy(value: Any) -> Any:
    """An optimizer state value for the run: a copy (a 0-dim ``step`` too, which the run's steps
    would otherwise count up in place), floating tensors of parameter shape in float64."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(torch.float64) if value.is_floating_point() and value.dim() > 0 else value.clone()


def _inputs_in_float64(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    return float64_leaves(args), float64_leaves(kwargs)


class Snapshot:
    """The values of a model's parameters and buffers and of its optimizers' state, kept to be put
    back into the very tensors after a run that stepped them in their own dtypes: cloned beside the
    run, or (``on_disk``, under a memory budget) in a temporary file read back through a memory map,
    so that keeping them holds no memory beside the run."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor], optimizers: list[Any],
                 on_disk: bool) -> None:
        self.params, self.buffers, self.optimizers = params, buffers, optimizers
        values = {"params": [p.detach() for p in params], "buffers": [b.detach() for b in buffers],
                  "state": [[dict(o.state[p]) if p in o.state else None for p in _params_of(o)] for o in optimizers]}
        self._folder = None
        if on_disk:
            self._folder = tempfile.TemporaryDirectory(prefix="accumcheck-snapshot-")
            self._path = os.path.join(self._folder.name, "values.pt")
            torch.save(values, self._path)
            self._values = None
        else:
            self._values = map_leaves(values, lambda t: t.clone() if isinstance(t, torch.Tensor) else t)

    def restore(self) -> None:
        """Every value put back into the tensors it was taken from (optimizer state a run created
        dropped, state it replaced copied back)."""
        try:
            values = self._values if self._values is not None else torch.load(self._path, mmap=True,
                                                                                 weights_only=True)
            with torch.no_grad():
                for p, v in zip(self.params, values["params"]):
                    p.data.copy_(v)
                for b, v in zip(self.buffers, values["buffers"]):
                    b.copy_(v)
                for o, entries in zip(self.optimizers, values["state"]):
                    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
                    for p, entry in zip(_params_of(o), entries):
                        if entry is not None:
                            now = o.state.get(p, {})
                            state[p] = {k: _put_back(now.get(k), v) for k, v in entry.items()}
                    o.state = state
        finally:
            if self._folder is not None:
                self._folder.cleanup()


def _params_of(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _put_back(now: Any, kept: Any) -> Any:
    """``kept`` copied into the tensor the state holds now where it can be (no new memory), else a copy."""
    if isinstance(kept, torch.Tensor):
        if isinstance(now, torch.Tensor) and now.shape == kept.shape and now.dtype == kept.dtype:
            return now.copy_(kept)
        return kept.clone()
    return kept
