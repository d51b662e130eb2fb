"""Gradient diagnostics for PyTorch: a clip_grad_norm_ that keeps its per-parameter norms.

    monitor = GradMonitor(model, writer=SummaryWriter("runs/x"), log_every=100)
    for batch in data:
        loss(model(batch)).backward()
        monitor.clip_grad_norm_(1.0)      # instead of torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step(); optimizer.zero_grad()
    monitor.reports                         # dominance reports of the steps where clipping fired hard

The per-parameter norms come from the same fused ``torch._foreach_norm`` call that
``clip_grad_norm_`` makes, grouped the same way, so the total norm and the clipped gradients are
bit-for-bit those of PyTorch. A normal step adds a few scalar operations on the device and one
non-blocking copy of a flag; it never waits for the device. The flag (clipping scale below
``clip_threshold``, or a non-finite norm) is read once its copy has arrived, usually at the next
step; then ``dominance_report`` names the parameters that dominate the gradient norm.
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

from ...diagnostics.layers import DEFAULT_LAYERS, layer_groups, select_layers
from ...diagnostics.report import DominanceEntry, DominanceReport, largest, rank
from ...errors import AccumcheckError
from ...options import positive_float, positive_int

LOG = logging.getLogger("accumcheck.diagnostics")


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


def grad_norms(grads: Sequence[Any], norm_type: float = 2.0, foreach: bool | None = None) -> tuple[Any, Any]:
    """Per-tensor norms (in the order of ``grads``) and their total, on the device, computed exactly
    as torch.nn.utils.get_total_norm computes the total."""

    first_device = grads[0].device
    norms, order = [], []
    grouped = _group_tensors_by_device_and_dtype([list(grads)], with_indices=True)
    for (device, _), ([device_grads], indices) in grouped.items():
        if (foreach is None and _has_foreach_support(device_grads, device)) or (
                foreach and _device_has_foreach_support(device)):
            norms.extend(torch._foreach_norm(device_grads, norm_type))
        else:
            norms.extend([torch.linalg.vector_norm(g, norm_type) for g in device_grads])
        order.extend(indices)
    stacked = torch.stack([n.to(first_device) for n in norms])
    total = torch.linalg.vector_norm(stacked, norm_type)
    if order != list(range(len(order))):  # back to the caller's order, on the device
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        stacked = stacked[inverse.to(first_device)]
    return stacked, total


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
            self.host = tensor.detach().clone()
            self.event = None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def values(self) -> np.ndarray:
        return self.host.numpy()


class GradMonitor:
    """Per-layer gradient statistics, a drop-in clip_grad_norm_, and the dominance report.

    ``source``: a Module, (name, parameter) pairs, plain parameters or param groups. ``layers``:
    which layers to log ("all", indices over the repeated blocks, or name globs; default
    0,1,n//2,-2,-1). ``writer``: anything with ``add_scalar(tag, value, step)`` (a TensorBoard
    SummaryWriter). Statistics are logged every ``log_every`` steps, or every step while a window
    opened by ``enable`` lasts. A step whose clipping scale falls below ``clip_threshold``, or
    whose gradient norm is not finite, gets a dominance report of ``top_k`` parameters, logged
    as a warning and kept in ``reports``.
    """

    def __init__(self, source: Any, layers: Any = DEFAULT_LAYERS, writer: Any = None, log_every: int = 100,
                 clip_threshold: float = 0.1, top_k: int = 5, logger: logging.Logger = LOG) -> None:
        log_every, top_k = _checked("log_every", log_every, positive_int), _checked("top_k", top_k, positive_int)
        clip_threshold = _checked("clip_threshold", clip_threshold, positive_float)
        pairs = named_parameters(source)
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        groups, _ = layer_groups(self.names)
        self.layers = {key: groups[key] for key in select_layers(self.names, layers)}
        self.writer, self.log_every, self.clip_threshold = writer, log_every, clip_threshold
        self.top_k, self.logger = top_k, logger
        self.step = 0
        self.window_end = -1
        self.reports: list[DominanceReport] = []
        self._pending: list[_HostCopy] = []
        self._index: Any = None  # (device, watched parameters, per-layer index tensors)
        self.last_norms: Any = None  # per-parameter norms of the last step, on the device
        self.last_total: Any = None
        self.last_coef: Any = None

    # -------------------------------------------------------------- the step

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> Any:
        """torch.nn.utils.clip_grad_norm_ over the monitored parameters: same arguments, same
        result, same clipped gradients; keeps the per-parameter norms and never waits for the
        device (unless ``error_if_nonfinite``, which must look at the norm)."""
        self._drain()
        step, self.step = self.step, self.step + 1
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return torch.tensor(0.0)
        grads = [self.params[i].grad for i in live]
        norms, total = grad_norms(grads, norm_type, foreach)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        torch.nn.utils.clip_grads_with_norm_([self.params[i] for i in live], max_norm, total, foreach)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if len(live) < len(self.params):  # parameters without a gradient count as zero
            full = torch.zeros(len(self.params), dtype=norms.dtype, device=norms.device)
            full[torch.tensor(live, device=norms.device)] = norms
            norms = full
        self.last_norms, self.last_total, self.last_coef = norms, total, coef
        flag = torch.logical_or(coef < self.clip_threshold, ~torch.isfinite(total))
        self._pending.append(_HostCopy(torch.stack([flag.to(total.dtype), total, coef]),
                                       ("flag", step, norms, norm_type)))
        if self.writer is not None and (step % self.log_every == 0 or step <= self.window_end):
            self._pending.append(_HostCopy(self._layer_stats(norms, total, norm_type), ("stats", step)))
        self._drain()  # on the CPU the copies have arrived already: report this step's own gradients
        return total

    def enable(self, steps: int) -> None:
        """Log statistics at every step for the next ``steps`` steps (after a rollback, say)."""
        self.window_end = self.step + steps - 1

    def disable(self) -> None:
        self.window_end = -1

    def flush(self) -> list[DominanceReport]:
        """Wait for every pending copy and process it (end of training, tests)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._drain()
        if self.writer is not None and hasattr(self.writer, "flush"):
            self.writer.flush()
        return self.reports

    # -------------------------------------------------------------- statistics

    TAGS = ("grad_norm", "grad_min", "grad_max", "grad_absmax", "grad_share")

    def _layer_stats(self, norms: Any, total: Any, norm_type: float) -> Any:
        """[norm, min, max, absmax, share] per watched layer, on the device, in one tensor."""
        device = norms.device
        if self._index is None or self._index[0] != device:
            watched = sorted({i for indices in self.layers.values() for i in indices})
            position = {i: k for k, i in enumerate(watched)}
            self._index = (device, watched, [(torch.tensor(idx, device=device),
                                              torch.tensor([position[i] for i in idx], device=device))
                                             for idx in self.layers.values()])
        _, watched, index = self._index
        zero = torch.zeros((), dtype=norms.dtype, device=device)
        pairs = [torch.aminmax(self.params[i].grad) if self.params[i].grad is not None else (zero, zero)
                 for i in watched]
        lows = torch.stack([low.to(norms.dtype) for low, _ in pairs])
        highs = torch.stack([high.to(norms.dtype) for _, high in pairs])
        rows = []
        for members, positions in index:
            layer_norm = torch.linalg.vector_norm(norms[members], norm_type)
            low, high = lows[positions].min(), highs[positions].max()
            rows.append(torch.stack([layer_norm, low, high, torch.maximum(low.abs(), high.abs()),
                                     layer_norm**2 / total**2]))
        return torch.stack(rows) if rows else torch.zeros((0, 5), device=device)

    def _drain(self) -> None:
        """Process the copies that have arrived; keep the others for later."""
        waiting = []
        for copy in self._pending:
            if not copy.ready():
                waiting.append(copy)
                continue
            kind = copy.payload[0]
            if kind == "flag":
                flag, total, coef = copy.values()
                if flag:
                    _, step, norms, _ = copy.payload
                    reason = ("non-finite gradient norm" if not np.isfinite(total) else
                              f"clipping scale {coef:.3g} below {self.clip_threshold:g}")
                    report = dominance_report(self.names, self.params, norms, top_k=self.top_k, step=step,
                                              reason=reason, total_norm=float(total), clip_coef=float(coef))
                    self.reports.append(report)
                    self.logger.warning("%s", report)
            else:
                _, step = copy.payload
                for (layer, values) in zip(self.layers, copy.values()):
                    for tag, value in zip(self.TAGS, values):
                        self.writer.add_scalar(f"{tag}/{layer}", float(value), step)
        self._pending = waiting


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


def _checked(name: str, value: Any, rule: Any) -> Any:
    """``value`` by ``rule`` (an accumcheck.options rule), or AccumcheckError naming ``name``."""
    try:
        return rule(value)
    except ValueError as exc:
        raise AccumcheckError(f"GradMonitor: {name}={exc}") from None
