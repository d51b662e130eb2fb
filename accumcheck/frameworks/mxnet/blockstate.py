"""What a check changes on the user's Gluon block, and how it is put back as it was found: the
gradients and their ``grad_req``, auxiliary state (BatchNorm's running statistics and every other
parameter with ``grad_req='null'``), parameters still waiting for deferred initialisation, and
the layers that behave differently in training (Dropout, BatchNorm)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

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
    """Afterwards: each parameter's grad_req and gradients as they were."""
    saved = {name: (p.grad_req, [g.copy() for g in p.list_grad()]) for name, p in params.items()}
    try:
        yield
    finally:
        for name, (req, grads) in saved.items():
            param = params[name]
            param.grad_req = req
            for target, value in zip(param.list_grad(), grads):
                target[:] = value
        clear_cached_ops(block)


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
