"""What every framework's GradMonitor shares, written once (no framework imports).

A GradMonitor watches named parameters. At each optimizer step its framework's subclass clips
their gradients by the total norm on the device and hands the host a copy of the step's values
(the total norm, the clipping scale and, at a logged step, what the per-layer statistics need)
without waiting for it. Here is the rest, the lifecycle:

- the arguments, checked when the monitor is made, before a writer is made (``log_every``,
  ``top_k``, ``clip_threshold``, some parameter to watch) and when a window opens (``enable``'s
  ``steps``); the steps counted, and which of them log statistics;
- the copies read once they have arrived, in order; a step whose clipping scale fell below
  ``clip_threshold``, or whose norm is not finite, gets a dominance report, logged as a warning
  and kept in ``reports``;
- the statistics of the logged steps computed together on the host and written in batches: once
  ``WRITE_EVERY`` steps wait or the oldest is ``WRITE_EVERY`` steps old, at once after a
  dominance report, and at ``flush()``;
- the writer (``WriterOwner``): one given as a log directory is made here and closed by
  ``close()`` or the end of a ``with`` block, after the last statistics are written.

A subclass supplies the device pieces: which parameters a source names, the step itself (the
clipping and the copy, started with ``_begin_step`` and handed over with ``_pending.append``),
and ``_report``, the dominance report from a step's norms; it may write a step's scalars its own
faster way (``_write_step``). A copy has ``ready()``, ``wait()``, ``values()`` (the total norm,
the clipping scale, then the rest as the step's statistics plan reads it) and ``payload``: (the
step, what ``_report`` reads the norms from, the step's plan or None where the step logs nothing).
A plan has ``layer_stats(values)``: [norm, min, max, absmax, share] per step and watched layer.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import AccumcheckError
from ..options.values import positive_float, positive_int
from .layers import DEFAULT_LAYERS, layer_groups, select_layers
from .report import DominanceReport
from .tensorboard import ScalarWriter, WriterOwner

LOG = logging.getLogger("accumcheck.diagnostics")


class StepCopy(Protocol):
    """A step's values on their way to the host."""

    payload: tuple[int, Any, Any]  # (step, what _report reads the norms from, the step's plan or None)

    def ready(self) -> bool: ...

    def wait(self) -> None: ...

    def values(self) -> np.ndarray: ...


class GradMonitorBase(WriterOwner):
    """The lifecycle of a GradMonitor (see the module's docstring); a framework's subclass makes
    the steps. ``pairs``: the (name, parameter) pairs to watch."""

    TAGS = ("grad_norm", "grad_min", "grad_max", "grad_absmax", "grad_share")
    WRITE_EVERY = 10  # steps: the host's share of the statistics is done for a batch of steps at a time
    NO_PARAMETERS = "no parameter has a gradient; pass the parameters you train"  # its framework's words

    def __init__(self, pairs: Sequence[tuple[str, Any]], layers: Any = DEFAULT_LAYERS, writer: Any = None,
                 log_every: int = 100, clip_threshold: float = 0.1, top_k: int = 5,
                 logger: logging.Logger = LOG) -> None:
        log_every, top_k = checked("log_every", log_every, positive_int), checked("top_k", top_k, positive_int)
        clip_threshold = checked("clip_threshold", clip_threshold, positive_float)
        if not pairs:
            raise AccumcheckError(f"GradMonitor: {self.NO_PARAMETERS}")
        self.names = [n for n, _ in pairs]
        self.params = [p for _, p in pairs]
        groups, _ = layer_groups(self.names)
        self.layers = {key: groups[key] for key in select_layers(self.names, layers)}
        self.tags = [f"{tag}/{layer}" for layer in self.layers for tag in self.TAGS]  # as the statistics' rows
        self._take_writer(writer)
        self.log_every, self.clip_threshold, self.top_k, self.logger = log_every, clip_threshold, top_k, logger
        self.step = 0
        self.window_end = -1
        self.reports: list[DominanceReport] = []
        self._pending: list[StepCopy] = []
        self._unwritten: list[tuple[int, Any, np.ndarray]] = []  # (step, its plan, its values)
        self.last_norms: Any = None  # per-parameter norms of the last step, on the device
        self.last_total: Any = None
        self.last_coef: Any = None

    # -------------------------------------------------------------- the lifecycle

    def enable(self, steps: int) -> None:
        """Log statistics at every step for the next ``steps`` steps (after a rollback, say)."""
        self.window_end = self.step + checked("steps", steps, positive_int) - 1

    def disable(self) -> None:
        """Close the window ``enable`` opened: statistics every ``log_every`` steps again."""
        self.window_end = -1

    def flush(self) -> list[DominanceReport]:
        """Wait for every pending step's values, process them and write every step's statistics
        (end of training, before closing a writer of your own; tests). Returns ``reports``."""
        for copy in self._pending:
            copy.wait()
        self._drain()
        self._write()
        if self.writer is not None and hasattr(self.writer, "flush"):
            self.writer.flush()
        return self.reports

    def _begin_step(self) -> tuple[int, bool]:
        """A step begins: the copies that have arrived processed, the step counted. Returns its
        index and whether it logs statistics."""
        self._drain()
        step, self.step = self.step, self.step + 1
        return step, self.writer is not None and (step % self.log_every == 0 or step <= self.window_end)

    # -------------------------------------------------------------- on the host

    def _drain(self) -> None:
        """Process the steps whose values have arrived, in order; keep the others for later."""
        reported = False
        while self._pending and self._pending[0].ready():
            copy = self._pending.pop(0)
            values = copy.values()
            step, norms, plan = copy.payload
            total, coef = values[0], values[1]
            if not np.isfinite(total) or coef < values.dtype.type(self.clip_threshold):
                reason = ("non-finite gradient norm" if not np.isfinite(total) else
                          f"clipping scale {coef:.3g} below {self.clip_threshold:g}")
                report = self._report(norms, values, step, reason, float(total), float(coef))
                self.reports.append(report)
                self.logger.warning("%s", report)
                reported = True
            if plan is not None:
                self._unwritten.append((step, plan, values))
        # A batch of WRITE_EVERY steps, or the oldest WRITE_EVERY steps old (the values may arrive
        # late, when the device lags behind), or at once after a report.
        if self._unwritten and (reported or len(self._unwritten) >= self.WRITE_EVERY
                                or self.step - self._unwritten[0][0] >= self.WRITE_EVERY):
            self._write()

    def _report(self, norms: Any, values: np.ndarray, step: int, reason: str, total: float,
                coef: float) -> DominanceReport:
        """The dominance report of ``step``: ``norms`` is what the step's copy kept for it,
        ``values`` the step's values on the host."""
        raise NotImplementedError

    def _write(self) -> None:
        """The waiting steps' statistics, computed together on the host, to the writer."""
        unwritten, self._unwritten = self._unwritten, []
        if self.writer is None or not unwritten:
            return
        for plan, entries in itertools.groupby(unwritten, key=lambda entry: entry[1]):
            entries = list(entries)
            rows = plan.layer_stats(np.stack([values for _, _, values in entries]))
            for (step, _, _), row in zip(entries, rows.reshape(len(entries), -1).tolist()):
                self._write_step(step, row)

    def _write_step(self, step: int, row: list[float]) -> None:
        """One step's scalars (``row``, in the order of ``tags``) to the writer."""
        if isinstance(self.writer, ScalarWriter):
            self.writer.add_step(step, self.tags, row)  # one event per step, not one per scalar
        else:
            for tag, value in zip(self.tags, row):
                self.writer.add_scalar(tag, value, step)


def checked(name: str, value: Any, rule: Any) -> Any:
    """``value`` by ``rule`` (an accumcheck.options rule), or AccumcheckError naming ``name``."""
    try:
        return rule(value)
    except ValueError as exc:
        raise AccumcheckError(f"GradMonitor: {name}={exc}") from None
