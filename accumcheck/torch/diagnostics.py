"""Gradient diagnostics for PyTorch: a clip_grad_norm_ that keeps its per-parameter norms.

    monitor = GradMonitor(model, writer=SummaryWriter("runs/x"), log_every=100)
    for batch in data:
        loss(model(batch)).backward()
        monitor.clip_grad_norm_(1.0)      # instead of torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step(); optimizer.zero_grad()
    monitor.flush()                         # the last steps' statistics to the writer
    monitor.reports                         # dominance reports of the steps where clipping fired hard

The per-parameter norms come from the same fused ``torch._foreach_norm`` call that
``clip_grad_norm_`` makes, grouped the same way, so the total norm and the clipped gradients are
bit-for-bit those of PyTorch. A normal step adds a few scalar operations on the device and one
non-blocking copy of the total norm and the clipping scale; it never waits for the device. They
are read once the copy has arrived, usually at the next step; when the scale is below
``clip_threshold`` or the norm is not finite, ``dominance_report`` names the parameters that
dominate the gradient norm. A step that logs per-layer statistics adds one min/max pass over
the watched layers' gradients into a buffer that rides on the same copy with the per-parameter
norms; the layers' statistics are computed from them on the host (a layer's norm is the norm of
its parameters' norms) for a batch of steps at a time, and a TensorBoard SummaryWriter gets each
step's scalars as one event.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

from ..diagnostics.layers import DEFAULT_LAYERS
from ..diagnostics.monitor import LOG, GradMonitorBase
from ..diagnostics.report import DominanceEntry, DominanceReport, largest, rank
from ..diagnostics.tensorboard import ScalarWriter
from ..errors import AccumcheckError
from . import shards as sharding


def named_parameters(source: Any) -> list[tuple[str, Any]]:
    """(name, parameter) pairs from a Module, named pairs, plain parameters (named by position)
    or optimizer param groups (named by their "param_names", else "<group name or index>.<i>")."""
    if isinstance(source, torch.nn.Module):
        return [(n, p) for n, p in source.named_parameters() if p.requires_grad]
    items = list(source)
    if items and all(isinstance(g, dict) and "params" in g for g in items):
        pairs = []
        for gi, group in enumerate(items):
            names = group.get("param_names") or [f"{group.get('name', f'group{gi}')}.{j}"
                                                 for j in range(len(group["params"]))]
            pairs += list(zip(names, group["params"]))
        return pairs
    if items and all(isinstance(x, tuple) and len(x) == 2 for x in items):
        return [(str(n), p) for n, p in items]
    return [(str(i), p) for i, p in enumerate(items)]


def grad_norms(grads: Sequence[Any], norm_type: float = 2.0, foreach: bool | None = None,
               groups: list | None = None) -> tuple[Any, Any]:
    """Per-tensor norms (in the order of ``grads``) and their total, on the device, computed exactly
    as torch.nn.utils.get_total_norm computes the total. ``groups``, a list, receives the gradients
    grouped by device and dtype as (device, gradients, whether the foreach kernels serve them)."""

    first_device = grads[0].device
    norms, order = [], []
    grouped = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    for (device, _), ([device_grads], indices) in grouped.items():
        fused = (foreach is None and _has_foreach_support(device_grads, device)) or bool(
            foreach and _device_has_foreach_support(device))
        if fused:
            norms.extend(torch._foreach_norm(device_grads, norm_type))
        else:
            norms.extend([torch.linalg.vector_norm(g, norm_type) for g in device_grads])
        order.extend(indices)
        if groups is not None:
            groups.append((device, device_grads, fused))
    stacked = torch.stack([n.to(first_device) for n in norms])
    total = torch.linalg.vector_norm(stacked, norm_type)
    if order != list(range(len(order))):  # back to the caller's order, on the device
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        stacked = stacked[inverse.to(first_device)]
    return stacked, total


def _clip(groups: list, max_norm: float, total: Any, foreach: bool | None) -> Any:
    """torch.nn.utils.clip_grads_with_norm_ over the groups grad_norms made (the same operations,
    without grouping the gradients again); returns the clipping scale."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for device, device_grads, fused in groups:
        if fused:
            torch._foreach_mul_(device_grads, coef.to(device))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            on_device = coef.to(device)
            for grad in device_grads:
                grad.mul_(on_device)
    return coef


class _HostCopy:
    """A small device tensor copied to the host without blocking; read when it has arrived."""

    def __init__(self, tensor: Any, payload: Any) -> None:
        self.payload = payload
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor.detach()  # a fresh tensor of this step's values: nothing to copy
            self.event = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def values(self) -> np.ndarray:
        return self.host.numpy()


class GradMonitor(GradMonitorBase):
    """Per-layer gradient statistics, a drop-in clip_grad_norm_, and the dominance report; its
    lifecycle (arguments, logged steps, reports, writing, the writer) is
    ``accumcheck.diagnostics.monitor``'s, shared with Gluon's monitor.

    ``source``: a Module, (name, parameter) pairs, plain parameters or param groups. ``layers``:
    which layers to log ("all", indices over the repeated blocks, or name globs; default
    0,1,n//2,-2,-1). ``writer``: anything with ``add_scalar(tag, value, step)`` (a TensorBoard
    SummaryWriter, which gets each step's scalars as one event), or a log directory (the monitor
    then makes a TensorBoard writer there and closes it in ``close()``). Statistics of the
    gradients before clipping are logged every ``log_every`` steps, or every step while a window
    opened by ``enable`` lasts. They reach the writer in batches: once ``WRITE_EVERY`` steps wait
    or the oldest is ``WRITE_EVERY`` steps old, at once after a dominance report, and at
    ``flush()``/``close()`` (call one before closing a writer of your own; ``with
    GradMonitor(...) as monitor:`` closes). A step whose clipping scale falls below
    ``clip_threshold``, or whose gradient norm is not finite, gets a dominance report of ``top_k``
    parameters, logged as a warning and kept in ``reports``.

    Sharded gradients (``accumcheck.torch.shards``): given an FSDP2 model (or its parameters, DTensors)
    or a DeepSpeed ZeRO-1/2 engine, every rank computes its shards' figures and one collective per
    step joins them; every rank clips by the global norm and names the dominating parameter, rank 0
    alone writes (the other ranks' writers are dropped; rank 0 must have one where any rank has).
    Every rank calls the monitor alike. A DeepSpeed engine: call ``clip_grad_norm_`` (the engine's
    ``gradient_clipping`` 0) or ``observe`` (the engine clips) after each ``engine.backward(loss)``;
    only the accumulation boundary counts as a step.
    """

    NO_PARAMETERS = "no parameter requires grad; pass the parameters you train"

    def __init__(self, source: Any, layers: Any = DEFAULT_LAYERS, writer: Any = None, log_every: int = 100,
                 clip_threshold: float = 0.1, top_k: int = 5, logger: logging.Logger = LOG) -> None:
        pairs = None if sharding.is_engine(source) else named_parameters(source)
        self.shards = sharding.sharded_source(source, pairs)  # None: whole gradients on this rank
        if self.shards is not None:
            pairs, writer = self.shards.pairs, self.shards.writer_for(writer)
        super().__init__(pairs, layers, writer, log_every, clip_threshold, top_k, logger)
        self._plan: _StatsPlan | None = None  # what the per-layer statistics gather

    # -------------------------------------------------------------- the step

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> Any:
        """torch.nn.utils.clip_grad_norm_ over the monitored parameters: same arguments, same
        result, same clipped gradients; keeps the per-parameter norms and never waits for the
        device (unless ``error_if_nonfinite``, which must look at the norm). Sharded gradients: the
        same total to round-off, from one collective (a plain tensor; ``foreach`` is not used)."""
        if self.shards is not None:
            if isinstance(self.shards, sharding.ZeroShards) and self.shards.clipping() > 0:
                raise AccumcheckError("GradMonitor: the DeepSpeed engine clips itself (gradient_clipping "
                                      f"{self.shards.clipping():g}); call monitor.observe() instead")
            return self._sharded_step(max_norm, norm_type, error_if_nonfinite)
        step, logged = self._begin_step()
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return torch.tensor(0.0)
        with torch.no_grad():
            groups: list = []
            norms, total = grad_norms([self.params[i].grad for i in live], norm_type, foreach, groups)
            if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
                raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                                   "non-finite, so it cannot be clipped. To disable this error and scale the "
                                   "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
            if len(live) < len(self.params):  # parameters without a gradient count as zero
                full = torch.zeros(len(self.params), dtype=norms.dtype, device=norms.device)
                full[torch.tensor(live, device=norms.device)] = norms
                norms = full
            plan = self._extremes(norms, norm_type, groups) if logged else None  # before clipping
            coef = _clip(groups, max_norm, total, foreach)
            self.last_norms, self.last_total, self.last_coef = norms, total, coef
            head = torch.stack([total, coef])
            payload = head if plan is None else torch.cat([head, norms, plan.extremes.view(-1)])
            if payload.dtype not in (torch.float32, torch.float64):  # numpy has no bfloat16
                payload = payload.float()
        self._pending.append(_HostCopy(payload, (step, norms, plan)))
        self._drain()  # on the CPU the copies have arrived already: report this step's own gradients
        return total

    def observe(self) -> Any:
        """Sharded gradients: the step's statistics and dominance report without clipping. For a
        DeepSpeed engine that clips itself (``gradient_clipping`` in its config), after
        ``engine.backward(loss)`` and before ``engine.step()``: the clipping scale reported is the
        engine's. Returns the total norm (None off a DeepSpeed engine's accumulation boundary)."""
        if self.shards is None:
            raise AccumcheckError("GradMonitor.observe reads sharded gradients (FSDP2, DeepSpeed ZeRO); "
                                  "call clip_grad_norm_")
        return self._sharded_step(None, 2.0, False)

    def _sharded_step(self, max_norm: float | None, norm_type: float, error_if_nonfinite: bool) -> Any:
        """clip_grad_norm_ (``max_norm`` None: observe) on this rank's shards: the figures joined by
        one collective (``Shards.combine``), the shards clipped by the global norm."""
        if not self.shards.at_boundary():
            return None
        step, logged = self._begin_step()
        with torch.no_grad():
            pieces = self.shards.pieces(self.params)
            live = [g for g in pieces if g is not None]
            device = (live or self.params)[0].device
            dtype = torch.float64 if any(g.dtype == torch.float64 for g in live) else torch.float32
            plan = None
            if logged:
                if self._plan is None or self._plan.key != (device, dtype, norm_type):
                    self._plan = _StatsPlan(self.layers, self.params, device, dtype, norm_type)
                plan = self._plan
                watched = sorted({i for indices in self.layers.values() for i in indices})
                sharding.local_extremes(pieces, watched, plan.outs)
            extremes = None if plan is None else plan.extremes
            norms, total = self.shards.combine(pieces, norm_type, dtype, device, extremes)
            if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
                raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot "
                                   "be clipped. To scale the gradients by it anyway, set `error_if_nonfinite=False`")
            clip = max_norm if max_norm is not None else getattr(self.shards, "clipping", lambda: 0.0)()
            coef = torch.clamp(clip / (total + 1e-6), max=1.0) if clip else torch.ones_like(total)
            if max_norm is not None and live:
                torch._foreach_mul_([g for g in live if g.numel()], coef.to(device))
            self.last_norms, self.last_total, self.last_coef = norms, total, coef
            head = torch.stack([total, coef])
            payload = head if plan is None else torch.cat([head, norms, plan.extremes.view(-1)])
        self._pending.append(_HostCopy(payload, (step, norms, plan)))
        self._drain()
        return total

    # -------------------------------------------------------------- statistics

    def _extremes(self, norms: Any, norm_type: float, groups: list) -> _StatsPlan:
        """Each watched gradient's min and max, straight into the plan's buffer on the device
        (one aminmax each: the only pass over the gradients the statistics make), and the plan
        that turns them and the per-parameter norms into the layers' statistics on the host.
        ``groups``: the gradients as grad_norms grouped them."""
        device, dtype = norms.device, norms.dtype
        if self._plan is None or self._plan.key != (device, dtype, norm_type):
            self._plan = _StatsPlan(self.layers, self.params, device, dtype, norm_type)
        plan = self._plan
        uniform = len(groups) == 1 and groups[0][0] == device and groups[0][1][0].dtype == dtype
        for param, sized, out in zip(plan.params, plan.sized, plan.outs):
            grad = param.grad
            if grad is None or not sized:  # a missing gradient counts as zero (aminmax refuses an empty one)
                out[0].zero_()
                out[1].zero_()
            elif uniform or (grad.dtype == dtype and grad.device == device):
                torch.aminmax(grad, out=out)
            else:
                found = torch.aminmax(grad)
                out[0].copy_(found[0])
                out[1].copy_(found[1])
        return plan

    def _report(self, norms: Any, values: np.ndarray, step: int, reason: str, total: float,
                coef: float) -> DominanceReport:
        """From the step's per-parameter norms, kept on the device (the copy holds them at a
        logged step only)."""
        if self.shards is not None:
            return self.shards.report(self.names, norms, self.top_k, step, reason, total, coef)
        return dominance_report(self.names, self.params, norms, top_k=self.top_k, step=step, reason=reason,
                                total_norm=total, clip_coef=coef)

    def _write_step(self, step: int, row: list[float]) -> None:
        write_scalars(self.writer, step, self.tags, row)


class _StatsPlan:
    """GradMonitor's per-layer statistics for one device, dtype and norm type. On the device: a
    buffer of the watched gradients' minima (row 0) and maxima (row 1), each row padded with an
    entry that changes no minimum (+inf) or maximum (-inf); 0-dim views of its entries are the
    out= of each gradient's aminmax. On the host, from the step's copy (the total norm, the
    clipping scale, the per-parameter norms, that buffer): index matrices, a row per watched
    layer, padded likewise, into the norms (padded with 0, or inf for a negative norm order) and
    into the buffer's rows. A layer's norm is the norm of its parameters' norms."""

    def __init__(self, layers: dict[str, list[int]], params: list, device: Any, dtype: Any, norm_type: float) -> None:
        self.key, self.norm_type, count = (device, dtype, norm_type), norm_type, len(params)
        watched = sorted({i for indices in layers.values() for i in indices})
        self.params = [params[i] for i in watched]
        self.sized = [p.numel() > 0 for p in self.params]
        position = {i: k for k, i in enumerate(watched)}
        width = max((len(indices) for indices in layers.values()), default=0)
        rows = [(indices, width - len(indices)) for indices in layers.values()]
        self.norm_index = np.array([indices + [count] * n for indices, n in rows], dtype=np.intp)
        self.minmax_index = np.array([[position[i] for i in indices] + [len(watched)] * n for indices, n in rows],
                                     dtype=np.intp)
        # (layers, width) also with no layer (np.array of [] is one-dimensional); reshape, not a shape
        # assignment, which NumPy 2.5 deprecates
        self.norm_index = self.norm_index.reshape(len(rows), width)
        self.minmax_index = self.minmax_index.reshape(len(rows), width)
        self.norm_pad = 0.0 if norm_type >= 0 else np.inf
        self.count = count
        self.extremes = torch.tensor([float("inf"), float("-inf")], dtype=dtype, device=device)[:, None].repeat(
            1, len(watched) + 1)
        self.outs = list(zip(self.extremes[0, :-1].unbind(), self.extremes[1, :-1].unbind()))

    def layer_stats(self, values: np.ndarray) -> np.ndarray:
        """[norm, min, max, absmax, share] per step and watched layer (steps x layers x 5), from
        the steps' copies (a row each)."""
        values, count = values.astype(np.float64), self.count
        pad = np.full((len(values), 1), self.norm_pad)
        norms = np.concatenate([values[:, 2:2 + count], pad], axis=1)[:, self.norm_index]
        extremes = values[:, 2 + count:].reshape(len(values), 2, -1)
        with np.errstate(all="ignore"):  # a non-finite or zero norm gives what the device would
            if self.norm_type == 2.0:
                layer_norm = np.sqrt(np.square(norms).sum(axis=2))
            else:
                layer_norm = np.linalg.norm(norms, ord=self.norm_type, axis=2)
            low = extremes[:, 0][:, self.minmax_index].min(axis=2)
            high = extremes[:, 1][:, self.minmax_index].max(axis=2)
            share = np.square(layer_norm / values[:, :1])
            return np.stack([layer_norm, low, high, np.maximum(high, -low), share], axis=2)


def write_scalars(writer: Any, step: int, tags: Sequence[str], values: Sequence[float]) -> None:
    """``writer.add_scalar(tag, value, step)`` for each tag, in effect. PyTorch's own SummaryWriter
    (not a subclass that may do more in add_scalar) gets them as one event with one value per tag,
    the summary add_scalar would make for each: add_scalar costs tens of microseconds in Python."""
    if isinstance(writer, ScalarWriter):
        writer.add_step(step, tags, values)
        return
    file_writer = _plain_summary_writer(writer)
    if file_writer is None:
        for tag, value in zip(tags, values):
            writer.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    value = Summary.Value
    file_writer.add_summary(Summary(value=[value(tag=t, simple_value=v) for t, v in zip(tags, values)]), step)


def _plain_summary_writer(writer: Any) -> Any:
    """The file writer of a torch.utils.tensorboard.SummaryWriter whose add_scalar is PyTorch's, else None."""
    if not type(writer).__module__.startswith("torch.utils.tensorboard"):
        return None
    from torch.utils.tensorboard import SummaryWriter

    if not isinstance(writer, SummaryWriter) or type(writer).add_scalar is not SummaryWriter.add_scalar:
        return None
    return writer._get_file_writer()


def dominance_report(names: Sequence[str], params: Sequence[Any], norms: Any = None, top_k: int = 5,
                     step: int = -1, reason: str = "requested", total_norm: float | None = None,
                     clip_coef: float = 1.0) -> DominanceReport:
    """The top_k parameters by share of the total sum of squares (non-finite ones first), with
    their norm, the parameter's RMS and where its gradient is largest. ``norms`` are per-parameter
    gradient norms (those GradMonitor kept for the anomalous step, before clipping); without them
    they are computed from the current gradients. RMS and locations are read from the current
    values: the clipped gradients of that step, or of the next one where the report comes a step
    late (on a GPU whose copy had not yet arrived)."""
    if norms is None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        norms, _ = grad_norms(grads)
    host = norms.detach().to("cpu", torch.float64).numpy()
    if total_norm is None:
        total_norm = float(np.sqrt((host**2).sum()))
    entries = []
    for index, share in rank(list(names), host, top_k):
        param = params[index]
        grad = param.grad.detach().to("cpu").numpy() if param.grad is not None else np.zeros(tuple(param.shape))
        where, value, bad = largest(grad)
        rms = float(param.detach().double().pow(2).mean().sqrt())
        entries.append(DominanceEntry(names[index], share, float(host[index]), rms, where, value, bad))
    return DominanceReport(step=step, reason=reason, total_norm=total_norm, clip_coef=clip_coef, entries=entries)
