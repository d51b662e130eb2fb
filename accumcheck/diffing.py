"""``accumcheck diff A.json B.json``: two saved reports, tensor by tensor, and what changed verdict."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import AccumcheckError
from .report import Report


@dataclass
class TensorChange:
    name: str
    kind: str
    verdict_a: str
    verdict_b: str
    ratio_a: float
    ratio_b: float

    @property
    def changed(self) -> bool:
        return self.verdict_a != self.verdict_b


def diff_reports(a: Report, b: Report) -> tuple[list[TensorChange], list[str], list[str]]:
    """Tensor-by-tensor verdicts of two reports. Returns (tensors in both, names only in A,
    names only in B). Raises AccumcheckError when either is not a single-framework report."""
    for name, report in (("A", a), ("B", b)):
        if not isinstance(report, Report):
            raise AccumcheckError(f"diff: report {name} is a {getattr(report, 'kind', 'other')} report; "
                                  "give two single-framework reports (accumcheck compare --format json)")
    in_b = {t.name: t for t in b.tensors}
    common = [TensorChange(t.name, t.kind, t.verdict, in_b[t.name].verdict, t.ratio, in_b[t.name].ratio)
              for t in a.tensors if t.name in in_b]
    names_a = {t.name for t in a.tensors}
    return common, [t.name for t in a.tensors if t.name not in in_b], [n for n in in_b if n not in names_a]


def describe(a: Report) -> str:
    versions = " ".join(f"{k} {v}" for k, v in a.versions.items() if k != "accumcheck")
    return f"{a.case}, {a.framework} ({versions}) on {a.device}, N = {a.accum_steps}" + (
        f", injected {a.inject}" if a.inject else "")
