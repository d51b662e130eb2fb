"""Gradient diagnostics for MXNet Gluon: norms from the fused multi-array sum of squares.

    params = net.collect_params()
    total, norms = clip_global_norm(params, max_norm=1.0)   # instead of gluon.utils.clip_global_norm
    trainer.step(batch_size)
    stats = layer_stats(params, norms, total)                 # per-layer norm, min, max, share
    report = dominance_report(params, norms)                  # who dominates the gradient norm

``mx.nd.multi_sum_sq`` gives every gradient's sum of squares in one call; nothing here calls
``asnumpy`` except ``layer_stats`` and ``dominance_report``, which read their results on the host.
Unlike ``gluon.utils.clip_global_norm(check_isfinite=True)``, clipping never waits for the engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...diagnostics.layers import DEFAULT_LAYERS, layer_groups, select_layers
from ...diagnostics.report import DominanceEntry, DominanceReport, largest, rank
from .library import mx


def _named(params: Any) -> list[tuple[str, Any]]:
    """(name, Parameter) pairs with a gradient, from a ParameterDict, a dict or pairs."""
    items = params.items() if hasattr(params, "items") else params
    return [(name, p) for name, p in items if p.grad_req != "null"]


def _grads(params: Any) -> list[Any]:
    """Gradient NDArrays: of Parameters (a ParameterDict, dict or pairs), or a list of arrays."""
    if isinstance(params, (list, tuple)) and params and isinstance(params[0], mx.nd.NDArray):
        return list(params)
    return [p.grad() for _, p in _named(params)]


def grad_norms(grads: list[Any]) -> tuple[Any, Any]:
    """Per-array L2 norms and their total, as NDArrays, from one fused sum-of-squares call."""
    squares = mx.nd.multi_sum_sq(*grads, num_arrays=len(grads))
    return mx.nd.sqrt(squares), mx.nd.sqrt(mx.nd.sum(squares))


def clip_global_norm(params: Any, max_norm: float) -> tuple[Any, Any]:
    """Scale every gradient by min(1, max_norm / (total + 1e-6)), in place, without waiting for
    the engine. ``params``: a ParameterDict (``net.collect_params()``, what a Trainer holds), a
    dict or pairs of Parameters, or a list of gradient arrays. Returns (total norm,
    per-parameter norms) as NDArrays."""
    grads = _grads(params)
    norms, total = grad_norms(grads)
    scale = mx.nd.minimum(max_norm / (total + 1e-6), mx.nd.ones_like(total))
    for grad in grads:
        grad *= scale.as_in_context(grad.context)
    return total, norms


def layer_stats(params: Any, norms: Any = None, total: Any = None,
                layers: Any = DEFAULT_LAYERS) -> dict[str, dict[str, float]]:
    """{layer: {norm, min, max, absmax, share}} for the watched layers (read on the host)."""
    named = _named(params)
    names = [n for n, _ in named]
    if norms is None:
        norms, total = grad_norms([p.grad() for _, p in named])
    host_norms, host_total = norms.asnumpy().astype(np.float64), float(total.asscalar())
    groups, _ = layer_groups(names)
    out = {}
    for layer in select_layers(names, layers):
        idx = groups[layer]
        grads = [named[i][1].grad() for i in idx]
        low = min(float(mx.nd.min(g).asscalar()) for g in grads)
        high = max(float(mx.nd.max(g).asscalar()) for g in grads)
        norm = float(np.sqrt((host_norms[idx] ** 2).sum()))
        out[layer] = {"norm": norm, "min": low, "max": high, "absmax": max(abs(low), abs(high)),
                      "share": norm**2 / host_total**2 if host_total else 0.0}
    return out


def dominance_report(params: Any, norms: Any = None, top_k: int = 5, step: int = -1,
                     reason: str = "requested") -> DominanceReport:
    """The top_k parameters by share of the gradient's total sum of squares (non-finite first),
    with norm, parameter RMS and where the gradient is largest."""
    named = _named(params)
    if norms is None:
        norms, _ = grad_norms([p.grad() for _, p in named])
    host = norms.asnumpy().astype(np.float64)
    entries = []
    for index, share in rank([n for n, _ in named], host, top_k):
        name, param = named[index]
        where, value, bad = largest(param.grad().asnumpy())
        rms = float(np.sqrt(np.mean(param.data().asnumpy().astype(np.float64) ** 2)))
        entries.append(DominanceEntry(name, share, float(host[index]), rms, where, value, bad))
    total = float(np.sqrt((host[np.isfinite(host)] ** 2).sum())) if np.isfinite(host).all() else float("nan")
    return DominanceReport(step=step, reason=reason, total_norm=total, clip_coef=1.0, entries=entries)


def log_stats(writer: Any, stats: dict[str, dict[str, float]], step: int) -> None:
    """Write ``layer_stats`` to TensorBoard as grad_norm/<layer>, grad_min/<layer>, ...
    (``writer``: anything with add_scalar, e.g. accumcheck.diagnostics.tensorboard.ScalarWriter)."""
    for layer, values in stats.items():
        for stat, value in values.items():
            writer.add_scalar(f"grad_{stat}/{layer}", value, step)
