"""The trajectory report of ``accumcheck train``: K optimizer steps with native and manual
accumulation from the same start, and when their parameters leave the round-off band."""

from __future__ import annotations

from dataclasses import dataclass, field

from .values import SCHEMA_VERSION, Serialised


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
    kind: str = "trajectory"
    schema_version: int = SCHEMA_VERSION

    @property
    def exit_code(self) -> int:
        """1 when some tensor left the round-off band or a loss or parameter became inf or nan,
        else 0."""
        return 1 if self.first_out_of_band or self.non_finite else 0

    def summary(self) -> str:
        if self.non_finite:
            first = min(self.non_finite.values())
            names = [n for n, s in self.non_finite.items() if s == first]
            return (f"NON-FINITE at step {first} ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}): "
                    "training diverged to inf or nan, so native and manual are not compared past it; "
                    "lower --lr or check the case")
        if not self.first_out_of_band:
            return (f"native and manual stay within one float32 ulp of each other for all {self.steps} "
                    f"{self.optimizer} steps")
        first = min(self.first_out_of_band.values())
        names = [n for n, s in self.first_out_of_band.items() if s == first]
        return (f"LEFT THE ROUND-OFF BAND at step {first} ({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); "
                f"{len(self.first_out_of_band)} tensor(s) by step {self.steps - 1}")
