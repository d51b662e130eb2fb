"""What ``accumcheck train`` records at each optimizer step, for every backend: each mode's loss,
and per tensor kind the largest parameter difference between native and manual, and between the
control and manual.

The control is a second valid accumulation order: the manual buffer with the window's
micro-batches summed last to first, stepped by its own optimizer from the same start. Two valid
orders differ by round-off, and an optimizer such as Adam may amplify that round-off into a
visible gap: the control's gap from manual is how far a faithful run may drift. A tensor is
judged at each step by its native gap over the control's band (the control's gap, or one float32
ulp of the tensor's largest parameter where that is wider); past ``MARGIN`` it is flagged. The
one-ulp band (``band_ratio``, ``first_out_of_band``) stays in the report as information. A backend
hands the class plain arrays; it never imports a framework."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..report import TrajectoryReport
from .faults import Fault

# How much further from manual native may be than the control before it is flagged, measured by
# benchmarks/bench_trajectory_margin.py (docs/trajectory.md quotes it): every faithful run, on the
# libraries' baseline kernels and on the CPU's own, stays within 10 times the control's band, a
# third of the margin; the injected faults go past it, all but some that moved the parameters by a
# few tens of ulps in 20 steps under SGD; MXNet 1.6.0's double counting by 10^5 times it.
MARGIN = 30.0

MODES = ("native", "manual", "control")  # the parameter sets ``record`` compares


class Trajectory:
    """The traces of one training run, step by step (``record``), then its report (``report``)."""

    def __init__(self, kinds: Mapping[str, str], modes: tuple[str, ...] = ("manual",), oracle: bool = False,
                 margin: float = MARGIN) -> None:
        self.kinds = dict(kinds)  # tensor name -> kind
        self.margin = margin
        self.losses: dict[str, list[float]] = {mode: [] for mode in modes}
        names = sorted(set(self.kinds.values()))
        self.max_diff: dict[str, list[float]] = {k: [] for k in names}
        self.band_ratio: dict[str, list[float]] = {k: [] for k in names}
        self.control_diff: dict[str, list[float]] = {k: [] for k in names}
        self.control_ratio: dict[str, list[float]] = {k: [] for k in names}
        self.oracle_diff: dict[str, list[float]] = {k: [] for k in names} if oracle else {}
        self.first_out: dict[str, int] = {}
        self.first_out_of_control: dict[str, int] = {}
        self.non_finite: dict[str, int] = {}
        self.non_finite_modes: dict[str, int] = {}

    def loss(self, mode: str, step: int, value: float) -> None:
        """Mode ``mode``'s mean loss of optimizer step ``step``."""
        self.losses.setdefault(mode, []).append(value)
        if not math.isfinite(value):
            self.diverged(f"loss ({mode})", step, mode)

    def diverged(self, what: str, step: int, mode: str = "native") -> None:
        """Something of mode ``mode`` left finite numbers at ``step`` (the steps after it are not
        run)."""
        self.non_finite.setdefault(what, step)
        self.non_finite_modes.setdefault(mode, step)

    def record(self, step: int, native: Mapping[str, Any], manual: Mapping[str, Any],
               control: Mapping[str, Any], oracle: Mapping[str, Any] | None = None) -> None:
        """The parameters after optimizer step ``step``: name -> array (any float dtype), for
        native, manual, the control and (with the oracle) the float64 model."""
        per: dict[str, dict[str, float]] = {field: {} for field in ("diff", "ratio", "control", "judged", "oracle")}
        broken: set[str] = set()  # kinds with a non-finite tensor: their figures are nan
        for name, kind in self.kinds.items():
            values = {mode: np.asarray(arrays[name], dtype=np.float64)
                      for mode, arrays in (("native", native), ("manual", manual), ("control", control))}
            bad = [mode for mode, value in values.items() if not np.isfinite(value).all()]
            if bad:
                self.non_finite.setdefault(name, step)
                for mode in bad:
                    self.non_finite_modes.setdefault(mode, step)
                broken.add(kind)
                continue  # a difference of inf or nan is no distance from a band
            a, b, c = values["native"], values["manual"], values["control"]
            diff = float(np.abs(a - b).max(initial=0.0))
            gap = float(np.abs(c - b).max(initial=0.0))
            band = float(np.spacing(np.float32(np.abs(a).max(initial=0.0))))
            judged = judge(diff, gap, band)
            _raise(per["diff"], kind, diff)
            _raise(per["ratio"], kind, diff / band if band else 0.0)
            _raise(per["control"], kind, gap)
            _raise(per["judged"], kind, judged)
            if diff > band and name not in self.first_out:
                self.first_out[name] = step
            if judged > self.margin and name not in self.first_out_of_control:
                self.first_out_of_control[name] = step
            if oracle is not None:
                _raise(per["oracle"], kind, float(np.abs(a - np.asarray(oracle[name], dtype=np.float64)).max(initial=0.0)))
        traces = (("diff", self.max_diff), ("ratio", self.band_ratio), ("control", self.control_diff),
                  ("judged", self.control_ratio))
        for kind in self.max_diff:
            for field, trace in traces:
                trace[kind].append(math.nan if kind in broken else per[field].get(kind, 0.0))
            if oracle is not None and self.oracle_diff:
                self.oracle_diff[kind].append(per["oracle"].get(kind, 0.0))

    def report(self, case: str, optimizer: str, lr: float, accum_steps: int, steps: int, fault: Fault | None,
               versions: dict[str, str], settings: dict[str, str] | None = None) -> TrajectoryReport:
        """The report, every trace padded with nan to ``steps`` (the steps not run after a
        divergence)."""
        for trace in [*self.losses.values(), *self.max_diff.values(), *self.band_ratio.values(),
                      *self.control_diff.values(), *self.control_ratio.values(), *self.oracle_diff.values()]:
            trace.extend([math.nan] * (steps - len(trace)))
        return TrajectoryReport(case=case, optimizer=optimizer, lr=lr, accum_steps=accum_steps, steps=steps,
                                inject=None if fault is None else str(fault), versions=versions, losses=self.losses,
                                max_diff=self.max_diff, band_ratio=self.band_ratio, first_out_of_band=self.first_out,
                                oracle_diff=self.oracle_diff, non_finite=self.non_finite, settings=settings or {},
                                control_diff=self.control_diff, control_ratio=self.control_ratio, margin=self.margin,
                                first_out_of_control=self.first_out_of_control,
                                non_finite_modes=self.non_finite_modes)


def judge(diff: float, gap: float, band: float) -> float:
    """Native's gap from manual (``diff``) in units of the control's band: the control's gap from
    manual, or one float32 ulp (``band``) where that is wider."""
    scale = max(gap, band)
    if scale > 0:
        return diff / scale
    return 0.0 if diff == 0 else math.inf


def _raise(found: dict[str, float], kind: str, value: float) -> None:
    found[kind] = max(found.get(kind, 0.0), value)
