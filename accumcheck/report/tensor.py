"""One parameter tensor's verdict and the figures behind it."""

from __future__ import annotations

from dataclasses import dataclass

VERDICTS = ("identical", "round-off", "suspicious", "precision-loss", "diverged", "non-finite", "no-gradient",
            "overflow")
# suspicious:     inside the worst-case bound, but one mode's error lines up with a fault's pattern far
#                 beyond what round-off does under the probabilistic model (judge.attribution); not
#                 flagged unless asked (--fail-on suspicious)
# precision-loss: within the round-off of its own (reduced) dtype, beyond that of the accumulation dtype
# no-gradient:    the parameter received no gradient in any micro-step (unused in these batches)
# overflow:       the loss-scaled micro-gradients themselves hold an inf or nan: a GradScaler skips
#                 the optimizer step and lowers its scale; not an accumulation fault
FLAGGED_VERDICTS = ("precision-loss", "diverged", "non-finite")
# Tensor kinds in the order a summary names them: embeddings and weights first.
KIND_ORDER = ("embedding", "weight", "bias", "norm")
# How far past the bound a flagged tensor is, in words: "marginal" within MARGINAL_RATIO times its
# bound with no single-step explanation, "diverged" otherwise.
SEVERITIES = ("marginal", "diverged")
MARGINAL_RATIO = 10.0
# What a mode's difference from E is fitted as (Cause.kind), and the two modes compared.
CAUSE_KINDS = ("repeat-step", "drop-step", "scale-step", "scale-sum", "running-total", "growth", "narrow-dtype",
               "narrow-mean", "unexplained")
COMPARED_MODES = ("native", "manual")
NEARER = ("native", "manual", "tie")


@dataclass
class Cause:
    """What a mode's difference from E is, as fitted by ``accumcheck.judge.attribution``.

    kind: repeat-step (micro-step ``step`` counted ``factor`` extra times), drop-step (lost),
    scale-step (scaled by 1 + ``factor``), scale-sum (the whole sum scaled by 1 + ``factor``),
    running-total (the running total before micro-step ``step`` added ``factor`` more times),
    growth (the running total multiplied by ``factor`` at every micro-step, so added again
    factor - 1 times, each micro-gradient scaled by ``grad_scale``), narrow-dtype (the running
    total kept in ``dtype``), narrow-mean (a running mean kept in ``dtype``) or unexplained (none
    of these). ``fit`` is 1 - residual/difference
    in the round-off-weighted least-squares sense; ``residual_ratio`` is the worst element of what
    the explanation leaves over, against the round-off bound (<= 1: the rest is round-off)."""

    kind: str
    mode: str  # "native" or "manual"
    words: str  # the short form for a table: "step 8 counted twice"
    detail: str  # the sentence: "native: micro-step 8 counted twice (fit 1.000)"
    fit: float
    residual_ratio: float
    step: int | None = None
    factor: float | None = None
    dtype: str | None = None
    grad_scale: float | None = None
    # Other explanations that fit as well (micro-steps with the same gradient, a running total
    # that is the whole sum times a factor), in words.
    alternatives: list[str] | None = None

    @property
    def single_step(self) -> bool:
        return self.kind in ("repeat-step", "drop-step", "scale-step", "running-total")


@dataclass
class TensorResult:
    """Everything measured about one parameter tensor. Errors are absolute unless named ``rel``;
    "E" is the float64 sum of the same micro-gradients, "S" the float64 sum of their magnitudes."""

    name: str
    kind: str
    shape: list[int]
    dtype: str
    verdict: str
    ill_conditioned: bool
    numel: int
    max_abs_grad: float  # max |E|
    mismatched: int  # elements where native != manual
    max_abs_diff: float  # max |native - manual|
    max_abs_diff_index: list[int]
    max_rel_diff: float  # max |native - manual| / |manual|
    max_ulps: float  # max distance native-manual in units in the last place of ``dtype``
    classic_mismatched: int  # elements failing torch.testing's defaults for ``dtype``
    classic_rtol: float
    classic_atol: float
    ratio: float  # worst |mode - E| / bound over both modes and all elements
    worst_mode: str
    worst_index: list[int]
    bound_at_worst: float
    ratio_native: float
    ratio_manual: float
    over_bound_native: int
    over_bound_manual: int
    err_native: float  # max |native - E|
    err_manual: float
    rel_err_native: float  # ||native - E||_2 / ||E||_2
    rel_err_manual: float
    condition: float  # sum S / sum |E|
    nearer: str  # "native", "manual" or "tie" (smaller L2 error against E)
    nonfinite_native: int
    nonfinite_manual: int
    diff_ratio: float = 0.0  # worst |native - manual| / (bound_native + bound_manual)
    precision_ratio: float | None = None  # native's worst error over the accumulation dtype's bound
    err_ulps_native: float | None = None  # worst |native - E| in float32 ulps of E (reduced precision runs)
    err_ulps_manual: float | None = None
    ratio_map: list[list[float]] | None = None  # where the worst ratios sit (judge.ratio.ratio_map)
    ratio_map_cell: list[int] | None = None  # [rows, columns] of the tensor per map cell
    grad_sum_sq: float = 0.0  # sum of E^2 over the tensor
    norm_share: float = 0.0  # this tensor's share of the whole gradient's sum of squares (of E)
    oracle_err_native: float | None = None  # max |mode - O|, O = the whole model in float64
    oracle_err_manual: float | None = None
    oracle_err_exact: float | None = None
    # Data parallel (accumcheck.judge.dataparallel): the single-process reference's worst ratio to its
    # bound, native against it (over both bounds), each rank's own total against its own E and S,
    # each rank's gradient after the all-reduce, and the ranks named by those.
    single_ratio: float | None = None
    single_agreement: float | None = None
    rank_local_ratios: list[float] | None = None
    rank_final_ratios: list[float] | None = None
    flagged_ranks: list[int] | None = None
    # A user's own model: the other names of a tied (shared) parameter, and in how many of the
    # micro-steps it received a gradient (None: in all of them, or not counted).
    aliases: list[str] | None = None
    steps_with_grad: int | None = None
    # Attribution and severity (judge.attribution): what the flagged (or suspicious) mode's difference
    # is, and for a flagged tensor how far past the bound it is in words.
    cause: Cause | None = None
    severity: str | None = None
    # The statistical tier: the root-mean-square spread of round-off the probabilistic model predicts
    # (u * sqrt(N - 1) * S per element), each mode's measured spread against E, and the largest
    # projection score of a mode's error onto a fault's pattern (None: not examined) and the score a
    # fault must pass to be called suspicious.
    spread_predicted: float | None = None
    spread_native: float | None = None
    spread_manual: float | None = None
    fault_score: float | None = None
    fault_score_threshold: float | None = None

    @property
    def flagged(self) -> bool:
        return self.verdict in FLAGGED_VERDICTS

    @property
    def title(self) -> str:
        """The name as shown: a tied parameter under all its names."""
        return " = ".join([self.name, *self.aliases]) if self.aliases else self.name

    @property
    def label(self) -> str:
        """The verdict as shown: ``round-off (ill-conditioned)``, ``diverged (marginal)`` where
        those apply."""
        words = [w for w in (self.severity if self.severity == "marginal" else None,
                             "ill-conditioned" if self.ill_conditioned else None) if w]
        return f"{self.verdict} ({', '.join(words)})" if words else self.verdict
