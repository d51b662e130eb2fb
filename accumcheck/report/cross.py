"""The cross-framework report: one Report per framework on the same case, and how their manual
accumulations agree (``accumcheck.judge.agreement`` says how that is judged)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..options.spec import command_line
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
    frameworks: list[str] | None = None  # [a, b]; None in reports saved before records were labelled

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
    frameworks: list[str] | None = None  # the pair compared; None in reports saved before it was labelled


@dataclass
class OddOneOut:
    """A tensor on which, of three or more frameworks, some pair disagrees: the one framework that
    disagrees with every other while all the others agree among themselves, or None when the
    disagreements single out no one framework."""

    name: str
    kind: str
    framework: str | None
    disagreeing: list[list[str]]  # the pairs that disagree on the tensor
    ratio: float  # the worst of their ratios to the agreement bound

    def others(self) -> list[str]:
        """The frameworks the odd one disagrees with (none when no one is singled out)."""
        return [f for pair in self.disagreeing for f in pair if f != self.framework] if self.framework else []


@dataclass
class CrossReport(Serialised):
    """Reports of several frameworks on one case, and how their manual sums agree."""

    frameworks: list[str]
    reports: list[Report]
    agreement: list[Agreement]
    forward: ForwardAgreement | None
    allowance: float  # the float64 kernel allowance, in units of float32's u
    # Three or more frameworks: the logits of every pair after the first (``forward``), and the
    # tensors some pair disagrees on, each with the framework it singles out or None.
    forward_rest: list[ForwardAgreement] = field(default_factory=list)
    odd_one_out: list[OddOneOut] = field(default_factory=list)
    kind: str = "cross"
    schema_version: int = SCHEMA_VERSION

    @property
    def exit_code(self) -> int:
        return 1 if any(r.exit_code for r in self.reports) or any(a.flagged for a in self.agreement) else 0

    @property
    def flagged(self) -> list[Agreement]:
        return [a for a in self.agreement if a.flagged]

    @property
    def odd_frameworks(self) -> dict[str, str]:
        """Tensor name -> the framework that alone disagrees with all the others on it."""
        return {o.name: o.framework for o in self.odd_one_out if o.framework is not None}

    def pairs(self) -> list[list[str]]:
        """The two frameworks each agreement record compares, in the records' order. Records saved
        unlabelled compare the first framework with each other in turn, one tensor list each."""
        names = self.frameworks + ["?"] * (2 - len(self.frameworks))
        per = max(len(self.agreement) // (len(names) - 1), 1)
        return [a.frameworks or [names[0], names[min(1 + i // per, len(names) - 1)]] for i, a in enumerate(self.agreement)]

    def forwards(self) -> list[ForwardAgreement]:
        """Every pair's logits compared, the first pair's first; each labelled with its pair."""
        first = [] if self.forward is None else [self.forward]
        return first + self.forward_rest

    def forward_pair(self, forward: ForwardAgreement) -> list[str]:
        """The pair ``forward`` compares (the first pair where it was saved unlabelled)."""
        return forward.frameworks or (self.frameworks + ["?", "?"])[:2]

    def reproduce_command(self) -> str:
        return command_line({**self.reports[0].config, "framework": ",".join(self.frameworks)})
