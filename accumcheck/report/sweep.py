"""The sweep report: the same comparison at several N, and how the errors grow with N."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..bounds import UNIT_ROUNDOFF
from .single import Report
from .values import SCHEMA_VERSION, Serialised, encode


@dataclass
class SweepReport(Serialised):
    """One Report per number of accumulation steps, in the order run."""

    reports: list[Report]
    kind: str = "sweep"
    schema_version: int = SCHEMA_VERSION

    @property
    def exit_code(self) -> int:
        return max((r.exit_code for r in self.reports), default=0)

    @property
    def flagged(self) -> list[tuple[int, str]]:
        return [(r.accum_steps, t.name) for r in self.reports for t in r.flagged]

    def rows(self) -> list[dict[str, Any]]:
        return growth_rows(self.reports)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "growth": encode(self.rows())}  # for readers of the JSON; derived, not read back

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<report>") -> "SweepReport":
        return super().from_dict({k: v for k, v in data.items() if k != "growth"}, source)


def growth_rows(reports: list[Report]) -> list[dict[str, Any]]:
    """Per N: the bound and √N in units of u·S, and per tensor kind the worst error of each mode
    and the worst native/manual difference in the same units."""
    rows = []
    for r in reports:
        u = UNIT_ROUNDOFF.get(r.param_dtype, 2.0**-24)
        scale = {mode: r.bound[mode]["relative"] / u for mode in ("native", "manual")}
        kinds: dict[str, dict[str, float]] = {}
        for t in r.tensors:
            entry = kinds.setdefault(t.kind, {"native": 0.0, "manual": 0.0, "difference": 0.0})
            entry["native"] = max(entry["native"], t.ratio_native * scale["native"])
            entry["manual"] = max(entry["manual"], t.ratio_manual * scale["manual"])
            entry["difference"] = max(entry["difference"], t.diff_ratio * (scale["native"] + scale["manual"]))
        worst = sorted(r.tensors, key=lambda t: -t.ratio if math.isfinite(t.ratio) else -1e308)[:3]
        rows.append({"N": r.accum_steps, "bound": r.bound["native"]["relative"] / u, "sqrt_N": math.sqrt(r.accum_steps),
                     "kinds": kinds, "worst": [(t.name, t.ratio) for t in worst], "flagged": [t.name for t in r.flagged]})
    return rows
