"""What ``accumcheck train`` records at each optimizer step, for every backend: each mode's loss,
and per tensor kind the largest parameter difference between native and manual against the
round-off band (one float32 ulp of the tensor's largest parameter). A backend hands it plain
float64 arrays; it never imports a framework."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..report import TrajectoryReport
from .faults import Fault


class Trajectory:
    """The traces of one training run, step by step (``record``), then its report (``report``)."""

    def __init__(self, kinds: Mapping[str, str], modes: tuple[str, ...] = ("native", "manual"),
                 oracle: bool = False) -> None:
        self.kinds = dict(kinds)  # tensor name -> kind
        self.losses: dict[str, list[float]] = {mode: [] for mode in modes}
        names = sorted(set(self.kinds.values()))
        self.max_diff: dict[str, list[float]] = {k: [] for k in names}
        self.band_ratio: dict[str, list[float]] = {k: [] for k in names}
        self.oracle_diff: dict[str, list[float]] = {k: [] for k in names} if oracle else {}
        self.first_out: dict[str, int] = {}
        self.non_finite: dict[str, int] = {}

    def loss(self, mode: str, step: int, value: float) -> None:
        """Mode ``mode``'s mean loss of optimizer step ``step``."""
        self.losses.setdefault(mode, []).append(value)
        if not math.isfinite(value):
            self.non_finite.setdefault(f"loss ({mode})", step)

    def diverged(self, what: str, step: int) -> None:
        """Something left finite numbers at ``step`` (the steps after it are not run)."""
        self.non_finite.setdefault(what, step)

    def record(self, step: int, native: Mapping[str, Any], manual: Mapping[str, Any],
               oracle: Mapping[str, Any] | None = None) -> None:
        """The parameters after optimizer step ``step``: name -> array (any float dtype), for
        native, manual and (with the oracle) the float64 model."""
        per_kind: dict[str, float] = {}
        per_ratio: dict[str, float] = {}
        per_oracle: dict[str, float] = {}
        broken: set[str] = set()  # kinds with a non-finite tensor: their figures are nan
        for name, kind in self.kinds.items():
            a = np.asarray(native[name], dtype=np.float64)
            b = np.asarray(manual[name], dtype=np.float64)
            if not (np.isfinite(a).all() and np.isfinite(b).all()):
                self.non_finite.setdefault(name, step)
                broken.add(kind)
                continue  # a difference of inf or nan is no distance from the band
            diff = float(np.abs(a - b).max(initial=0.0))
            band = float(np.spacing(np.float32(np.abs(a).max(initial=0.0))))
            per_kind[kind] = max(per_kind.get(kind, 0.0), diff)
            per_ratio[kind] = max(per_ratio.get(kind, 0.0), diff / band if band else 0.0)
            if diff > band and name not in self.first_out:
                self.first_out[name] = step
            if oracle is not None:
                gap = float(np.abs(a - np.asarray(oracle[name], dtype=np.float64)).max(initial=0.0))
                per_oracle[kind] = max(per_oracle.get(kind, 0.0), gap)
        for kind in self.max_diff:
            self.max_diff[kind].append(math.nan if kind in broken else per_kind.get(kind, 0.0))
            self.band_ratio[kind].append(math.nan if kind in broken else per_ratio.get(kind, 0.0))
            if oracle is not None and self.oracle_diff:
                self.oracle_diff[kind].append(per_oracle.get(kind, 0.0))

    def report(self, case: str, optimizer: str, lr: float, accum_steps: int, steps: int, fault: Fault | None,
               versions: dict[str, str], settings: dict[str, str] | None = None) -> TrajectoryReport:
        """The report, every trace padded with nan to ``steps`` (the steps not run after a
        divergence)."""
        for trace in [*self.losses.values(), *self.max_diff.values(), *self.band_ratio.values(),
                      *self.oracle_diff.values()]:
            trace.extend([math.nan] * (steps - len(trace)))
        return TrajectoryReport(case=case, optimizer=optimizer, lr=lr, accum_steps=accum_steps, steps=steps,
                                inject=None if fault is None else str(fault), versions=versions, losses=self.losses,
                                max_diff=self.max_diff, band_ratio=self.band_ratio, first_out_of_band=self.first_out,
                                oracle_diff=self.oracle_diff, non_finite=self.non_finite, settings=settings or {})
