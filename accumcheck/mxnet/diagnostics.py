"""Gradient diagnostics for MXNet Gluon: norms from the fused multi-array sum of squares.

    monitor = GradMonitor(net, writer="runs/x", log_every=100)   # or any writer with add_scalar
    for data, label in batches:
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        monitor.clip_global_norm(1.0)     # instead of gluon.utils.clip_global_norm(grads, 1.0)
        trainer.step(batch_size)
    monitor.close()                       # the last steps' statistics to the writer, which it closes
    monitor.reports                       # dominance reports of the steps where clipping fired hard

The functions below are the parts on their own: ``clip_global_norm(params, max_norm)``,
``layer_stats`` and ``dominance_report``, which read their results on the host when called.

``mx.nd.multi_sum_sq`` gives every gradient's sum of squares in one call, and clipping scales the
gradients on the engine, so a step never waits for it. GradMonitor's step hands the total norm,
the clipping scale and the per-parameter norms (and, at a logged step, the watched gradients'
minima and maxima) to the host through ``HostCopy``, which the engine fills once they are
computed; they are read when they have arrived, usually at the next step.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

from ..diagnostics.layers import DEFAULT_LAYERS, layer_groups, select_layers
from ..diagnostics.monitor import LOG, GradMonitorBase, checked
from ..diagnostics.report import DominanceEntry, DominanceReport, largest, rank
from ..errors import AccumcheckError
from ..options.values import positive_float
from .hostcopy import HostCopy
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


# ----------------------------------------------------------------------------- the monitor


def named_parameters(source: Any) -> list[tuple[str, Any]]:
    """(name, Parameter) pairs of the parameters with a gradient (grad_req not 'null'), from a
    Block, a ParameterDict (``net.collect_params()``), a dict, (name, Parameter) pairs or
    Parameters (named by their own names)."""
    if hasattr(source, "collect_params"):
        source = source.collect_params()
    items = list(source.items()) if hasattr(source, "items") else list(source)
    pairs = []
    for item in items:
        if isinstance(item, mx.gluon.Parameter):
            pairs.append((item.name, item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], mx.gluon.Parameter):
            pairs.append((str(item[0]), item[1]))
        else:
            raise AccumcheckError(f"GradMonitor: a {type(item).__name__} is not a Gluon Parameter; pass a Block, "
                                  "net.collect_params(), (name, Parameter) pairs or Parameters")
    return [(name, p) for name, p in pairs if p.grad_req != "null"]


class GradMonitor(GradMonitorBase):
    """Per-layer gradient statistics, a drop-in ``gluon.utils.clip_global_norm``, and the
    dominance report: accumcheck.torch.diagnostics.GradMonitor for Gluon, with the same lifecycle
    (``accumcheck.diagnostics.monitor``: arguments, logged steps, reports, writing, the writer).

    ``source``: a Block, a ParameterDict, (name, Parameter) pairs or Parameters; parameters with
    grad_req='null' are left out. ``layers``: which layers to log ("all", indices over the
    repeated blocks, or name globs; default 0,1,n//2,-2,-1). ``writer``: anything with
    ``add_scalar(tag, value, step)``, or a log directory (the monitor then makes a TensorBoard
    writer there and closes it in ``close()``). Statistics of the gradients before clipping are
    logged every ``log_every`` steps, or every step while a window opened by ``enable`` lasts;
    they reach the writer in batches: once ``WRITE_EVERY`` steps wait or the oldest is
    ``WRITE_EVERY`` steps old, at once after a dominance report, and at ``flush()``/``close()``.
    A step whose clipping scale falls below ``clip_threshold``, or whose gradient norm is not
    finite, gets a dominance report of ``top_k`` parameters, logged as a warning and kept in
    ``reports``. ``ctx``: the context whose gradients to clip, for parameters on several contexts.
    """

    NO_PARAMETERS = "no parameter has a gradient (all have grad_req='null'); pass the parameters you train"

    def __init__(self, source: Any, layers: Any = DEFAULT_LAYERS, writer: Any = None, log_every: int = 100,
                 clip_threshold: float = 0.1, top_k: int = 5, logger: logging.Logger = LOG, ctx: Any = None) -> None:
        super().__init__(named_parameters(source), layers, writer, log_every, clip_threshold, top_k, logger)
        self.ctx = ctx
        self._rows = _LayerRows(self.layers, len(self.params))
        self._layouts: dict[tuple, Any] = {}  # how the sums of squares come back in parameter order

    # -------------------------------------------------------------- the step

    def clip_global_norm(self, max_norm: float, check_isfinite: bool = False) -> Any:
        """``gluon.utils.clip_global_norm`` over the monitored gradients: scales them by
        min(1, max_norm / (total + 1e-8)) in place and returns the total norm, an NDArray of
        shape (1,), without waiting for the engine. ``check_isfinite=True`` does what Gluon's
        default does: waits for the norm, warns when it is not finite and returns a float."""
        max_norm = checked("max_norm", max_norm, positive_float)
        step, logged = self._begin_step()
        grads, live = self._gradients()
        with mx.autograd.pause():
            squares = self._squares(grads, live)
            total, norms = mx.nd.sqrt(mx.nd.sum(squares)), mx.nd.sqrt(squares)
            coef = mx.nd.minimum(max_norm / (total + 1e-8), 1.0)
            parts, on_host = [total, coef, norms], []
            if logged:
                on_host = self._on_host(grads, live)
                parts += [] if on_host else self._extremes(grads, live, total.context)
            self._pending.append(HostCopy(mx.nd.concat(*parts, dim=0), (step, None, self._rows if logged else None),
                                          on_host))
            # The engine orders the in-place scaling after every read of the gradients pushed above.
            scales: dict[tuple, Any] = {}
            for grad in grads:
                key = (grad.context, grad.dtype)
                if key not in scales:
                    scales[key] = coef.as_in_context(grad.context).astype(grad.dtype, copy=False)
                grad *= scales[key]
        self.last_norms, self.last_total, self.last_coef = norms, total, coef
        if check_isfinite:
            value = float(total.asscalar())
            if not np.isfinite(value):
                warnings.warn(UserWarning("nan or inf is detected. Clipping results will be undefined."), stacklevel=2)
            return value
        return total

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """The PyTorch monitor's name for ``clip_global_norm`` (the L2 norm only)."""
        if norm_type != 2:
            raise AccumcheckError(f"GradMonitor.clip_grad_norm_: norm_type={norm_type!r}; Gluon's monitor clips "
                                  "by the L2 norm only (norm_type=2)")
        return self.clip_global_norm(max_norm)

    # -------------------------------------------------------------- on the engine

    def _gradients(self) -> tuple[list[Any], list[int]]:
        """The gradient arrays to clip and the indices of their parameters (a parameter frozen
        since, grad_req='null', has none and counts as zero)."""
        grads, live = [], []
        for i, (name, param) in enumerate(zip(self.names, self.params)):
            if param.grad_req == "null":
                continue
            try:
                arrays = param.list_grad() if self.ctx is None else [param.grad(self.ctx)]
            except mx.gluon.parameter.DeferredInitializationError:
                raise AccumcheckError(f"GradMonitor: {name} is not initialized yet; clip after forward and "
                                      "backward") from None
            except RuntimeError as exc:  # not on self.ctx
                raise AccumcheckError(f"GradMonitor: {name}: {str(exc).splitlines()[0]}; pass a ctx= it is "
                                      "on") from None
            if len(arrays) > 1:
                raise AccumcheckError(f"GradMonitor: {name} has gradients on {len(arrays)} contexts; pass "
                                      "ctx= the one to clip (e.g. after trainer.allreduce_grads())")
            if arrays[0].stype != "default":
                raise AccumcheckError(f"GradMonitor: {name} has a {arrays[0].stype} gradient; make it dense "
                                      "(sparse_grad=False) or clip with gluon.utils.clip_global_norm")
            grads.append(arrays[0])
            live.append(i)
        return grads, live

    def _squares(self, grads: list[Any], live: list[int]) -> Any:
        """Every monitored parameter's gradient sum of squares (float32, in parameter order, zero
        where there is no gradient): one multi_sum_sq per context and dtype (it takes one of each)."""
        key = (tuple(live), tuple((g.context, g.dtype) for g in grads))
        if key not in self._layouts:
            self._layouts[key] = self._layout(grads, live)
        groups, index = self._layouts[key]
        if index is None:
            return mx.nd.multi_sum_sq(*grads, num_arrays=len(grads))
        ctx = grads[0].context
        parts = [mx.nd.multi_sum_sq(*[grads[k] for k in group], num_arrays=len(group)).astype(
            "float32", copy=False).as_in_context(ctx) for group in groups]
        return mx.nd.take(mx.nd.concat(*parts, mx.nd.zeros((1,), ctx=ctx), dim=0), index)

    def _layout(self, grads: list[Any], live: list[int]) -> tuple[list[list[int]], Any]:
        groups: dict[tuple, list[int]] = {}
        for k, grad in enumerate(grads):
            groups.setdefault((grad.context, grad.dtype), []).append(k)
        order = [k for group in groups.values() for k in group]
        if len(groups) == 1 and len(live) == len(self.params):
            return list(groups.values()), None
        where = dict(zip((live[k] for k in order), range(len(order))))
        index = [where.get(i, len(order)) for i in range(len(self.params))]
        return list(groups.values()), mx.nd.array(index, ctx=grads[0].context, dtype="int64")

    def _on_host(self, grads: list[Any], live: list[int]) -> list[Any]:
        """The watched gradients when every one is on the CPU, where HostCopy finds their minima
        and maxima faster than the engine's reductions; else none."""
        position = {i: k for k, i in enumerate(live)}
        watched = [grads[position[i]] for i in self._rows.watched if i in position]
        on_cpu = len(watched) == len(self._rows.watched) and all(g.context.device_type == "cpu" for g in watched)
        return watched if on_cpu else []

    def _extremes(self, grads: list[Any], live: list[int], ctx: Any) -> list[Any]:
        """The watched gradients' minima, then their maxima (0 for a parameter without one)."""
        position = {i: k for k, i in enumerate(live)}
        lows, highs = [], []
        for i in self._rows.watched:
            if i not in position:
                lows.append(mx.nd.zeros((1,), ctx=ctx))
                highs.append(lows[-1])
                continue
            grad = grads[position[i]]
            lows.append(mx.nd.min(grad).astype("float32", copy=False).as_in_context(ctx))
            highs.append(mx.nd.max(grad).astype("float32", copy=False).as_in_context(ctx))
        return lows + highs

    # -------------------------------------------------------------- on the host

    def _report(self, norms: Any, values: np.ndarray, step: int, reason: str, total: float,
                coef: float) -> DominanceReport:
        """The top_k parameters by share of the sum of squares of the step's norms (in its
        values); RMS and where the gradient is largest read from the current values (this step's
        clipped gradients, or the next step's when the report comes a step late)."""
        norms = values[2:2 + len(self.params)]
        entries = []
        for index, share in rank(self.names, norms, self.top_k):
            param = self.params[index]
            data = param.data(self.ctx) if self.ctx is not None else param.list_data()[0]
            grad = (param.grad(self.ctx) if self.ctx is not None else param.list_grad()[0]).asnumpy() if (
                param.grad_req != "null") else np.zeros(data.shape)
            where, value, bad = largest(grad)
            rms = float(np.sqrt(np.mean(data.asnumpy().astype(np.float64) ** 2)))
            entries.append(DominanceEntry(self.names[index], share, float(norms[index]), rms, where, value, bad))
        return DominanceReport(step=step, reason=reason, total_norm=total, clip_coef=coef, entries=entries)


class _LayerRows:
    """The watched layers' statistics from the steps' values (total norm, clipping scale, the
    per-parameter norms, the watched gradients' minima, then maxima). Index matrices, a row per
    layer, padded with an entry that changes nothing (a zero norm, +inf minimum, -inf maximum),
    pick each layer's parameters; a layer's norm is the norm of its parameters' norms."""

    def __init__(self, layers: dict[str, list[int]], count: int) -> None:
        self.watched = sorted({i for indices in layers.values() for i in indices})
        position = {i: k for k, i in enumerate(self.watched)}
        width = max((len(indices) for indices in layers.values()), default=0)
        rows = [(indices, width - len(indices)) for indices in layers.values()]
        self.norm_index = np.array([indices + [count] * n for indices, n in rows], dtype=np.intp)
        self.minmax_index = np.array([[position[i] for i in indices] + [len(self.watched)] * n for indices, n in rows],
                                     dtype=np.intp)
        # (layers, width) also with no layer (np.array of [] is one-dimensional); reshape, not a shape
        # assignment, which NumPy 2.5 deprecates
        self.norm_index = self.norm_index.reshape(len(rows), width)
        self.minmax_index = self.minmax_index.reshape(len(rows), width)
        self.count = count

    def layer_stats(self, values: np.ndarray) -> np.ndarray:
        """[norm, min, max, absmax, share] per step and watched layer (steps x layers x 5)."""
        values, count, w = values.astype(np.float64), self.count, len(self.watched)
        steps = len(values)
        norms = np.concatenate([values[:, 2:2 + count], np.zeros((steps, 1))], axis=1)[:, self.norm_index]
        lows = np.concatenate([values[:, 2 + count:2 + count + w], np.full((steps, 1), np.inf)], axis=1)
        highs = np.concatenate([values[:, 2 + count + w:], np.full((steps, 1), -np.inf)], axis=1)
        with np.errstate(all="ignore"):  # a non-finite or zero norm gives what the engine would
            layer_norm = np.sqrt(np.square(norms).sum(axis=2))
            low = lows[:, self.minmax_index].min(axis=2)
            high = highs[:, self.minmax_index].max(axis=2)
            share = np.square(layer_norm / values[:, :1])
            return np.stack([layer_norm, low, high, np.maximum(high, -low), share], axis=2)
