"""Two saved reports, tensor by tensor: what changed verdict (``accumcheck diff A.json B.json``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import AccumcheckError
from .single import Report


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


@dataclass
class ReportDiff:
    """Two reports (``names``: where they came from), their tensors in both (with the
    verdicts), and the tensor names found in one only."""

    a: Report
    b: Report
    names: tuple[str, str]
    common: list[TensorChange]
    only_a: list[str]
    only_b: list[str]

    @property
    def changed(self) -> list[TensorChange]:
        return [c for c in self.common if c.changed]

    @property
    def exit_code(self) -> int:
        """1 when a verdict changed or a tensor is in one report only."""
        return 1 if self.changed or self.only_a or self.only_b else 0


def diff_reports(a: Report, b: Report, names: tuple[str, str] = ("A", "B")) -> ReportDiff:
    """Tensor-by-tensor verdicts of two reports. Raises AccumcheckError when either is not a
    single-framework report, or when they are of different cases (by name and definition)."""
    for name, report in (("A", a), ("B", b)):
        if not isinstance(report, Report):
            raise AccumcheckError(f"diff: report {name} is a {getattr(report, 'kind', 'other')} report; "
                                  "give two single-framework reports (accumcheck compare --format json)")
    if (a.case, a.case_fingerprint) != (b.case, b.case_fingerprint):
        raise AccumcheckError(f"diff: {names[0]} is case {a.case!r} ({a.case_fingerprint}) and {names[1]} is case "
                              f"{b.case!r} ({b.case_fingerprint}); diff compares two runs of one case (other "
                              "frameworks, steps, seeds or versions)")
    in_b = {t.name: t for t in b.tensors}
    common = [TensorChange(t.name, t.kind, t.verdict, in_b[t.name].verdict, t.ratio, in_b[t.name].ratio)
              for t in a.tensors if t.name in in_b]
    names_a = {t.name for t in a.tensors}
    return ReportDiff(a, b, names, common, [t.name for t in a.tensors if t.name not in in_b],
                      [n for n in in_b if n not in names_a])
