"""The trajectory report of ``accumcheck train``: K optimizer steps with native and manual
accumulation from the same start, and a control (manual's buffer summed in the reverse order, a
second valid order) beside them; a step is judged by native's gap from manual against the
control's gap from manual (``accumcheck.run.trajectory``).

A report written before the control (no ``margin``) is judged as it was then: by the one-ulp band.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .values import SCHEMA_VERSION, Serialised

VALID_ORDERS = ("manual", "control")  # the modes whose sums are valid orders by construction


@dataclass
class TrajectoryReport(Serialised):
    case: str
    optimizer: str
    lr: float
    accum_steps: int
    steps: int
    inject: str | None
    versions: dict[str, str]
    losses: dict[str, list[float]]  # mode -> loss per step
    max_diff: dict[str, list[float]]  # tensor kind -> max |native - manual| over its tensors, per step
    band_ratio: dict[str, list[float]]  # tensor kind -> that difference over the round-off band, per step
    first_out_of_band: dict[str, int]  # tensor -> first step whose difference left the band
    oracle_diff: dict[str, list[float]] = field(default_factory=dict)  # kind -> max |native - float64|
    non_finite: dict[str, int] = field(default_factory=dict)  # "loss (mode)" or tensor -> first non-finite step
    settings: dict[str, str] = field(default_factory=dict)  # how the backend ran it (its optimizer step, dtype)
    control_diff: dict[str, list[float]] = field(default_factory=dict)  # kind -> max |control - manual|, per step
    # kind -> max over its tensors of |native - manual| / max(|control - manual|, one ulp), per step
    control_ratio: dict[str, list[float]] = field(default_factory=dict)
    margin: float | None = None  # control_ratio past it is flagged; None: a report from before the control
    first_out_of_control: dict[str, int] = field(default_factory=dict)  # tensor -> first step past the margin
    non_finite_modes: dict[str, int] = field(default_factory=dict)  # mode -> its first non-finite step
    kind: str = "trajectory"
    schema_version: int = SCHEMA_VERSION

    @property
    def exit_code(self) -> int:
        """1 when some tensor left the control's band by more than the margin (the one-ulp band in a
        report from before the control), or a loss or parameter became inf or nan; else 0."""
        flagged = self.first_out_of_band if self.margin is None else self.first_out_of_control
        return 1 if flagged or self.non_finite else 0

    def summary(self) -> str:
        if self.margin is None:
            return self._band_summary()
        flagged = min(self.first_out_of_control.values(), default=None)
        broken = min(self.non_finite.values(), default=None)
        if broken is not None and (flagged is None or broken <= flagged):
            return self._non_finite_summary(broken)
        if flagged is not None:
            worst = max((values[flagged] for values in self.control_ratio.values() if not math.isnan(values[flagged])),
                        default=math.inf)
            text = (f"FLAGGED at step {flagged} ({_names(self.first_out_of_control, flagged)}): native is {worst:.3g}x "
                    f"further from manual than the control (manual's micro-batches summed last to first), past the "
                    f"margin of {self.margin:g}x: more than a valid reordering of the sum explains; "
                    f"{len(self.first_out_of_control)} tensor(s) by step {self.steps - 1}")
            return text + (f"; inf or nan from step {broken}" if broken is not None else "")
        steps = f"all {self.steps} {self.optimizer} steps"
        if all(v == 0 for values in self.max_diff.values() for v in values):
            return f"OK: native and manual identical for {steps}"
        if not self.first_out_of_band:
            return f"OK: native and manual stay within one float32 ulp of each other for {steps}"
        worst = max((v for values in self.control_ratio.values() for v in values if not math.isnan(v)), default=0.0)
        return (f"OK: amplified round-off, as two valid orders differ: native left the one-ulp band at step "
                f"{min(self.first_out_of_band.values())} but stays within {worst:.3g}x the control's gap from manual "
                f"for {steps} (flagged past {self.margin:g}x)")

    def _non_finite_summary(self, first: int) -> str:
        head = f"NON-FINITE at step {first} ({_names(self.non_finite, first)}): "
        valid = [mode for mode in VALID_ORDERS if self.non_finite_modes.get(mode, self.steps) <= first]
        if valid:
            return head + (f"{' and '.join(valid)}, valid summation orders, went inf or nan at that step too: the "
                           "training diverged whatever the order (the learning rate or the case), not through "
                           "accumulation; nothing is compared past it; lower --lr or check the case")
        if self.non_finite_modes:
            return head + ("native went inf or nan while manual and the control, two valid summation orders, "
                           "stayed finite: native accumulation broke the training")
        return head + ("training diverged to inf or nan, so native and manual are not compared past it; "
                       "lower --lr or check the case")

    def _band_summary(self) -> str:
        if self.non_finite:
            first = min(self.non_finite.values())
            return (f"NON-FINITE at step {first} ({_names(self.non_finite, first)}): training diverged to inf or "
                    "nan, so native and manual are not compared past it; lower --lr or check the case")
        if not self.first_out_of_band:
            return (f"native and manual stay within one float32 ulp of each other for all {self.steps} "
                    f"{self.optimizer} steps")
        first = min(self.first_out_of_band.values())
        return (f"LEFT THE ROUND-OFF BAND at step {first} ({_names(self.first_out_of_band, first)}); "
                f"{len(self.first_out_of_band)} tensor(s) by step {self.steps - 1}")

    def check_relations(self, fail: Callable[..., None]) -> None:
        """Call ``fail(*path, problem=...)`` where fields disagree (``accumcheck.report.schema``):
        traces of one value per step over the kinds of max_diff, steps inside the run, a tensor past
        a band named by that step, nan only where something went non-finite."""
        traces = {"losses": self.losses, "max_diff": self.max_diff, "band_ratio": self.band_ratio,
                  "oracle_diff": self.oracle_diff, "control_diff": self.control_diff,
                  "control_ratio": self.control_ratio}
        for name, trace in traces.items():
            for key, values in trace.items():
                if len(values) != self.steps:
                    fail(name, (key,), problem=f"{len(values)} values for {self.steps} steps")
        kinds = set(self.max_diff)
        if set(self.band_ratio) != kinds or not set(self.oracle_diff) <= kinds:
            fail("band_ratio", problem="not the tensor kinds of max_diff")
        if self.margin is None and (self.control_diff or self.control_ratio or self.first_out_of_control):
            fail("margin", problem="none, but the report has a control")
        if self.margin is not None and (set(self.control_diff) != kinds or set(self.control_ratio) != kinds):
            fail("control_ratio", problem="not the tensor kinds of max_diff")
        for name in ("first_out_of_band", "first_out_of_control", "non_finite", "non_finite_modes"):
            for key, step in getattr(self, name).items():
                if step >= self.steps:
                    fail(name, (key,), problem=f"step {step} of a run of {self.steps}")
        for mode in self.non_finite_modes:
            if mode not in self.losses:
                fail("non_finite_modes", (mode,), problem=f"{mode!r} is not a mode of losses")
        # a tensor past its band is named at that step or before
        for name, ratios, named, limit in (("band_ratio", self.band_ratio, self.first_out_of_band, 1.0),
                                           ("control_ratio", self.control_ratio, self.first_out_of_control,
                                            self.margin)):
            first = min(named.values(), default=self.steps)
            for key, values in ratios.items():
                past = next((step for step, value in enumerate(values) if value > limit), None)
                if past is not None and first > past:
                    fail(name, (key,), problem=f"past {'the band' if name == 'band_ratio' else 'the margin'} at "
                         f"step {past}, but {named_field(name)} names no tensor by then")
        if not self.non_finite:
            for name in ("losses", "max_diff", "band_ratio", "control_diff", "control_ratio"):
                for key, values in getattr(self, name).items():
                    if any(math.isnan(v) for v in values):
                        fail(name, (key,), problem="nan, but non_finite names nothing")


def named_field(ratios: str) -> str:
    return "first_out_of_band" if ratios == "band_ratio" else "first_out_of_control"


def _names(steps: dict[str, int], first: int) -> str:
    names = [n for n, s in steps.items() if s == first]
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
