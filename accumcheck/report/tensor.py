"""One parameter tensor's verdict and the figures behind it."""

from __future__ import annotations

from dataclasses import dataclass

VERDICTS = ("identical", "round-off", "precision-loss", "diverged", "non-finite", "no-gradient", "overflow")
# precision-loss: within the round-off of its own (reduced) dtype, beyond that of the accumulation dtype
# no-gradient:    the parameter received no gradient in any micro-step (unused in these batches)
# overflow:       the loss-scaled micro-gradients themselves hold an inf or nan: a GradScaler skips
#                 the optimizer step and lowers its scale; not an accumulation fault
FLAGGED_VERDICTS = ("precision-loss", "diverged", "non-finite")
# Tensor kinds in the order a summary names them: embeddings and weights first.
KIND_ORDER = ("embedding", "weight", "bias", "norm")


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

    @property
    def flagged(self) -> bool:
        return self.verdict in FLAGGED_VERDICTS

    @property
    def title(self) -> str:
        """The name as shown: a tied parameter under all its names."""
        return " = ".join([self.name, *self.aliases]) if self.aliases else self.name

    @property
    def label(self) -> str:
        """The verdict as shown: ``round-off (ill-conditioned)`` where that applies."""
        return f"{self.verdict} (ill-conditioned)" if self.ill_conditioned else self.verdict
