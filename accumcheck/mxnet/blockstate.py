"""What a check changes on the user's Gluon block, and how it is put back as it was found: the
gradients and their ``grad_req``, auxiliary state (BatchNorm's running statistics and every other
parameter with ``grad_req='null'``), parameters still waiting for deferred initialisation, and
the layers that behave differently in training (Dropout, BatchNorm). What the user's own code
may change while the check runs is put back too: the weights' values (a ``step`` that edits
them) and the blocks' attributes (a forward that rebinds ``self.seen``), by identity and value."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from .library import mx

# BatchNorm, BatchNormReLU, SyncBatchNorm: the batch-norm layers, with their options in ``_kwargs``.
BATCH_NORM = getattr(mx.gluon.nn.basic_layers, "_BatchNorm", mx.gluon.nn.BatchNorm)
# A parameter's own fields that deferred initialisation fills in (Parameter._finish_deferred_init).
DEFERRED_FIELDS = ("_shape", "_var", "_deferred_init", "_data", "_grad", "_ctx_list", "_ctx_map")


def unique_params(block: Any) -> tuple[dict[str, Any], dict[str, tuple[str, ...]]]:
    """Each Parameter once, under its first Gluon name, and the other names it is reachable under
    (another key, or another attribute path such as ``decoder.weight`` for a tied weight)."""
    params: dict[str, Any] = {}
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, param in block.collect_params().items():
        if id(param) in first:
            aliases[first[id(param)]].append(name)
            continue
        first[id(param)], params[name], aliases[name] = name, param, []
    paths: dict[int, list[str]] = {}
    for path, param in block._collect_params_with_prefix().items():
        paths.setdefault(id(param), []).append(path)
    for name, param in params.items():
        aliases[name] += paths.get(id(param), [])[1:]
    return params, {name: tuple(names) for name, names in aliases.items() if names}


def materialised(param: Any) -> bool:
    return param._data is not None


def never_initialised(params: dict[str, Any]) -> list[str]:
    """Names of parameters neither initialised nor waiting for deferred initialisation."""
    return [name for name, p in params.items() if not materialised(p) and not p._deferred_init]


def clear_cached_ops(block: Any) -> None:
    """Drop every cached graph in the block: the next call rebuilds it for the current grad_req,
    shapes and rates."""
    block.apply(lambda b: b._clear_cached_op() if hasattr(b, "_clear_cached_op") else None)


@contextmanager
def deferred_kept(params: dict[str, Any], block: Any) -> Iterator[list[str]]:
    """Yields the names of the parameters waiting for deferred initialisation; afterwards puts
    them back in that state (shape unknown, no data), so that the block's next call initialises
    them as it would have."""
    saved = {name: {f: getattr(p, f) for f in DEFERRED_FIELDS} for name, p in params.items() if not materialised(p)}
    try:
        yield list(saved)
    finally:
        if saved:
            for name, fields in saved.items():
                for field, value in fields.items():
                    setattr(params[name], field, value)
            clear_cached_ops(block)


@contextmanager
def grads_kept(params: dict[str, Any], block: Any) -> Iterator[None]:
    """Afterwards: each parameter's grad_req and gradients as they were, the very arrays (a new
    grad_req makes Gluon allocate new ones) with their values."""
    saved = {name: (p.grad_req, p.list_grad(), [g.copy() for g in p.list_grad()]) for name, p in params.items()}
    try:
        yield
    finally:
        for name, (req, arrays, values) in saved.items():
            param = params[name]
            param.grad_req = req
            if any(now is not was for now, was in zip(param.list_grad(), arrays)):
                param._grad = list(arrays)  # as Parameter._init_grad binds them
                mx.autograd.mark_variables(param.list_data(), param._grad, req)
            for target, value in zip(arrays, values):
                target[:] = value
        clear_cached_ops(block)


class WeightsKept:
    """The values of the parameters with a gradient, on the host: ``changed()`` names those the
    user's code edited in place since (``set_data``, ``data()[:] = ...``), ``restore()`` puts
    them back."""

    def __init__(self, params: dict[str, Any]):
        self.saved = {name: (p, [d.asnumpy() for d in p.list_data()]) for name, p in params.items()}

    def changed(self) -> list[str]:
        return [name for name, (param, values) in self.saved.items()
                if any(not _same_bits(now.asnumpy(), was) for now, was in zip(param.list_data(), values))]

    def restore(self) -> None:
        for name in self.changed():
            param, values = self.saved[name]
            for target, value in zip(param.list_data(), values):
                target[:] = value


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.reshape(-1).view(np.uint8),
                                                                         b.reshape(-1).view(np.uint8))


# A Block's own fields that follow its cached graph: dropped by _clear_cached_op, rebuilt by the next call.
CACHED_FIELDS = ("_cached_graph", "_cached_op", "_cached_op_args", "_in_format", "_out_format")


@contextmanager
def attributes_kept(block: Any) -> Iterator[None]:
    """Afterwards: every block's attributes as they were (a forward that rebinds ``self.seen``,
    adds an attribute or appends to a list), the same objects; the values of NDArrays and numpy
    arrays among them, and what their dicts and lists held (the registries of children and
    parameters among them)."""
    blocks: list[Any] = []
    block.apply(blocks.append)
    saved = [(b, dict(vars(b))) for b in blocks]
    values = [value for _, fields in saved for key, value in fields.items() if key not in CACHED_FIELDS]
    containers = [(value, _items(value)) for value in values if isinstance(value, (dict, list))]
    arrays = [(value, value.copy()) for value in values if _dense(value)]
    try:
        yield
    finally:
        for b, fields in saved:
            now = vars(b)
            for key in [key for key in now if key not in fields and key not in CACHED_FIELDS]:
                del now[key]
            for key, value in fields.items():
                if key not in CACHED_FIELDS and now.get(key, _MISSING) is not value:
                    now[key] = value
        for container, items in containers:
            if [(k, id(v)) for k, v in _items(container)] != [(k, id(v)) for k, v in items]:
                container.clear()
                if isinstance(container, dict):
                    container.update(items)
                else:
                    container.extend(v for _, v in items)
        for array, value in arrays:
            if isinstance(array, np.ndarray):
                if array.flags.writeable:
                    array[...] = value
            else:
                array[:] = value


_MISSING = object()


def _items(container: dict | list) -> list[tuple[Any, Any]]:
    return list(container.items() if isinstance(container, dict) else enumerate(container))


def _dense(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return True
    return isinstance(value, mx.nd.NDArray) and value.stype == "default"


class AuxState:
    """The values of the parameters without a gradient (BatchNorm's running mean and variance),
    put back by ``restore()`` before each pass and after the last."""

    def __init__(self, params: dict[str, Any]):
        self.saved = [(p, [d.copy() for d in p.list_data()]) for p in params.values()]

    def restore(self) -> None:
        for param, values in self.saved:
            for target, value in zip(param.list_data(), values):
                target[:] = value

    @contextmanager
    def kept(self) -> Iterator[AuxState]:
        try:
            yield self
        finally:
            self.restore()


@contextmanager
def layers_for_check(block: Any, train_mode: bool) -> Iterator[None]:
    """Every Dropout rate 0 and, unless ``train_mode``, every BatchNorm on its running statistics
    (``use_global_stats``); put back afterwards."""
    changed: list[tuple[dict[str, Any], str, Any]] = []

    def visit(child: Any) -> None:
        for where, key, value in _switches(child, train_mode):
            if where[key] != value:
                changed.append((where, key, where[key]))
                where[key] = value

    block.apply(visit)
    clear_cached_ops(block)
    try:
        yield
    finally:
        for where, key, value in changed:
            where[key] = value
        clear_cached_ops(block)


def _switches(layer: Any, train_mode: bool) -> list[tuple[dict[str, Any], str, Any]]:
    """(dict, key, value during the check) for a layer that behaves differently in training: the
    rate of nn.Dropout and rnn.DropoutCell, the dropout between a fused rnn.RNN/LSTM/GRU's layers,
    BatchNorm's use_global_stats."""
    if isinstance(layer, (mx.gluon.nn.Dropout, mx.gluon.rnn.DropoutCell)):
        return [(vars(layer), "_rate", 0.0)]
    if isinstance(layer, mx.gluon.rnn.rnn_layer._RNNLayer):
        return [(vars(layer), "_dropout", 0.0)]
    if isinstance(layer, BATCH_NORM) and not train_mode:
        return [(layer._kwargs, "use_global_stats", True)]
    return []
