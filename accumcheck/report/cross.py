"""The cross-framework report: one Report per framework on the same case, and how their manual
accumulations agree (``accumcheck.judge.agreement`` says how that is judged)."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import command_line
from .single import Report
from .values import SCHEMA_VERSION, Serialised

CROSS_VERDICTS = ("identical", "agree", "disagree", "non-finite")


@dataclass
class Agreement:
    """One tensor's manual accumulation in framework ``a`` against framework ``b``."""

    name: str
    kind: str
    shape: list[int]
    verdict: str
    max_abs_diff: float
    max_abs_diff_index: list[int]
    max_ulps: float
    ratio: float  # worst |B_a - B_b| / bound
    worst_index: list[int]
    bound_at_worst: float
    float32_err_a: float  # max |B_a - O_a|
    float32_err_b: float

    @property
    def flagged(self) -> bool:
        return self.verdict in ("disagree", "non-finite")


@dataclass
class ForwardAgreement:
    """How closely the frameworks' logits for micro-batch 0 agree."""

    max_abs_diff: float
    max_abs_logit: float
    relative: float
    in_float32_units: float
    index: list[int]


@dataclass
class CrossReport(Serialised):
    """Reports of several frameworks on one case, and how their manual sums agree."""

    frameworks: list[str]
    reports: list[Report]
    agreement: list[Agreement]
    forward: ForwardAgreement | None
    allowance: float  # the float64 kernel allowance, in units of float32's u
    kind: str = "cross"
    schema_version: int = SCHEMA_VERSION

    @property
    def exit_code(self) -> int:
        return 1 if any(r.exit_code for r in self.reports) or any(a.flagged for a in self.agreement) else 0

    @property
    def flagged(self) -> list[Agreement]:
        return [a for a in self.agreement if a.flagged]

    def reproduce_command(self) -> str:
        return command_line({**self.reports[0].config, "framework": ",".join(self.frameworks)})
