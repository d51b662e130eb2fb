"""What a backend's run hands back: plain numpy arrays per parameter (and per rank of a
data-parallel run), the accumulated and whole-batch gradients for the full-batch check, a training
stack's optimizer steps, and the facts of the run. The judge reads these; no framework is named."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..report import DataParallelSetup
from ..report.stack import JOINED


@dataclass
class ParamAccumulation:
    """One parameter after N micro-steps.

    native  A: the framework's own accumulation      manual  B: zero/write + add into a buffer
    exact   E: float64 sum of the same micro-grads    absum   S: float64 sum of their magnitudes
    oracle  O: the same accumulation with the whole model in float64 (optional)
    """

    name: str
    kind: str
    native: np.ndarray
    manual: np.ndarray
    exact: np.ndarray
    absum: np.ndarray
    oracle: np.ndarray | None = None
    # Data parallel: the same accumulation in one process over the same global micro-batches
    # (divided by the number of ranks, as DistributedDataParallel averages).
    reference: np.ndarray | None = None
    # A user's own model: the parameter's dtype where it is not the run's ``param_dtype`` (its
    # native bound is then its own), its other names when tied, and in how many micro-steps it
    # received a gradient (None: all).
    dtype: str | None = None
    aliases: tuple[str, ...] = ()
    steps_with_grad: int | None = None
    # Arrays judged where they live (a GPU): the backend's reduction of the four, ``statistics.Reducer``;
    # the array fields are then read only for the figures it does not give.
    reducer: Any = None


@dataclass
class RankAccumulation:
    """One rank of a data-parallel run, every dict keyed by parameter name.

    local_native  the rank's own native total (N micro-steps, no synchronisation) just before
                  the all-reduce
    exact, absum  the rank's E and S (float64 sums of its micro-gradients and their magnitudes)
    native        the rank's gradient after the all-reduce (every rank should hold the same)
    """

    rank: int
    host: str
    local_native: dict[str, np.ndarray]
    exact: dict[str, np.ndarray]
    absum: dict[str, np.ndarray]
    native: dict[str, np.ndarray]


def window_scale(normalisation: str, accum_steps: int) -> tuple[float, str]:
    """What training code multiplies the accumulated sum by, as a number and as the report says it:
    1/N for a "mean" loss (each micro-batch's mean loss divided by N); 1 for "sum" and "token_count"."""
    return (1.0 / accum_steps, "1/N") if normalisation == "mean" else (1.0, "1")


@dataclass
class TermGradients:
    """One additive term of the loss (a router load-balancing loss, a z-loss): its gradient summed
    over the window's micro-batches, each micro-batch's term on its own, and its gradient on the
    window as one batch."""

    summed: dict[str, np.ndarray]
    window: dict[str, np.ndarray]


@dataclass
class Hypotheses:
    """What the judge may explain an accumulated gradient A by where the window's F does not:

    ``micro_sum``, the gradient of each micro-batch's own loss (normalised over its own items)
    summed over the window; ``main``, F without ``terms``, the loss's additive terms; whether the
    model ``takes_item_count`` (accepts ``num_items_in_batch``, so a Hugging Face Trainer skips its
    1/N); ``by_design``, the modules that compute over the batch (BatchNorm in train mode), so
    that a window differs from one batch whatever the accumulation; ``rest``, A and F again
    with those modules in eval mode; and in a data-parallel run ``rank_windows``, each rank's
    micro-batches of the window as a batch of their own (normalised over that rank's items), by
    rank; ``micro_batches``, each micro-batch's own gradient (normalised over its own items), in
    the window's order, for a step that some of them never reached."""

    micro_sum: dict[str, np.ndarray] | None = None
    main: dict[str, np.ndarray] | None = None
    terms: dict[str, TermGradients] = field(default_factory=dict)
    takes_item_count: bool | None = None
    by_design: list[str] = field(default_factory=list)
    rest: FullBatchGap | None = None
    rank_windows: list[dict[str, np.ndarray]] | None = None
    rank_items: list[int] | None = None  # the items of the window on each rank, where counted
    rank_predicted: list[int] | None = None  # of those, the ones a causal LM predicts
    micro_batches: list[dict[str, np.ndarray]] | None = None


@dataclass
class FullBatchGap:
    """The accumulated gradient and the whole batch's in one backward pass, both in float64, per
    parameter name: the judge (``accumcheck.judge.fullbatch``) says how they differ."""

    normalisation: str
    accumulated_scaled_by: str  # "1/N" for a mean loss, else "1"
    accumulated: dict[str, np.ndarray]  # already scaled
    full: dict[str, np.ndarray]
    item_counts: list[int] | None = None  # items (labelled tokens) per micro-batch, where known
    predicted_counts: list[int] | None = None  # of those, the ones a causal LM predicts (after its shift)
    hypotheses: Hypotheses = field(default_factory=Hypotheses)


@dataclass
class RunResult:
    """What a backend hands back: per-parameter accumulations as numpy arrays, and the facts of
    the run. ``settings`` are the backend's own facts (kept in the report), ``notes`` the ones a
    reader is told in the header."""

    params: list[ParamAccumulation]
    framework: str
    versions: dict[str, str]
    device: str
    param_dtype: str
    accum_dtype: str
    # Allowance (in units of u, see bounds.ModeBound) where the native path's kernels add into the
    # running total themselves and so compute micro-gradients differently from the manual path.
    native_kernel_allowance: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Logits of micro-batch 0 in the manual pass, to compare forward passes across frameworks.
    first_logits: np.ndarray | None = None
    full_batch: FullBatchGap | None = None
    # Data parallel: each rank's own view (rank order), and how the run was set up.
    ranks: list[RankAccumulation] | None = None
    data_parallel: DataParallelSetup | None = None
    # With a loss scaler (GradScaler), the scale the micro-gradients were computed with (the
    # arrays above are already divided by it): a tensor whose micro-gradients overflowed is then
    # a skipped optimizer step, not a fault.
    grad_scale: float | None = None


@dataclass(frozen=True)
class StepPrecision:
    """The dtypes a stack that does not run in float64 applies its gradient in: ``accumulation``,
    that of each rank's sum over its micro-batches, and ``reduction``, that of the sum over the
    ranks; ``computed``, that of the micro-batches' own gradients (the parameters' compute dtype)."""

    accumulation: str = "float32"
    reduction: str = "float32"
    computed: str = "float32"
    reference: str = "float64"  # the dtype the window's reference gradient was computed in (its own round-off)


@dataclass
class StepUpdate:
    """What one optimizer step did with its window's gradient, as a stack's check watched it.

    The counts are events between the step before and this one: ``optimizer_steps`` of the
    optimizer (1 is one update per window; more where a window was split), ``scheduler_steps``
    (None: no scheduler watched), ``clip_calls`` of gradient clipping (None: not watched).
    ``moved`` names the parameters that changed between the window's micro-batches before its
    step. ``applied`` is each parameter after the step minus before the window, ``expected`` the
    optimizer applied once, from its state before the window, to the gradient it was handed, in
    float64 (None where not replayed, ``replay_note`` says why); ``scale`` the per-element size
    the round-off of the step is relative to (|parameter| + |update|), ``dtype`` the dtype the
    stack's optimizer ran in. ``hypotheses`` are other updates the step may have made, by what
    causes them ("weight decay applied at every micro-step": that update), tried where
    ``expected`` does not match. ``lr`` is the learning rate the step used. A check that judges
    the update as the step runs keeps ``error`` and ``tried`` instead of the arrays."""

    optimizer_steps: int = 1
    scheduler_steps: int | None = None
    clip_calls: int | None = None
    moved: list[str] = field(default_factory=list)
    applied: dict[str, np.ndarray] | None = None
    expected: dict[str, np.ndarray] | None = None
    scale: dict[str, np.ndarray] | None = None
    dtype: str = "float64"
    hypotheses: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    lr: float | None = None
    replay_note: str = ""
    # judged where the step ran, the arrays not kept (a large model): update_error of ``applied``
    # against ``expected`` (``error``) and against each hypothesis (``tried``)
    error: float | None = None
    tried: dict[str, float] = field(default_factory=dict)
    gradient_micro_batches: int = 0  # micro-batches the gradient holds since it was last zeroed (0: not counted)


@dataclass
class StackWindow:
    """One optimizer step of a training stack: the gradient its optimizer was about to apply and
    the gradient of the same window's micro-batches as one batch, both in float64, per parameter
    name (``accumcheck.judge.stack`` says how they differ)."""

    step: int  # the optimizer step, counted from 0
    micro_batches: list[int]  # the run's micro-batch indices (from 0) in this window, in order
    applied: dict[str, np.ndarray]
    window: dict[str, np.ndarray]
    item_counts: list[int] | None = None  # items (labelled tokens) per micro-batch, where known
    predicted_counts: list[int] | None = None  # of those, the ones a causal LM predicts (after its shift)
    hypotheses: Hypotheses = field(default_factory=Hypotheses)
    world_size: int = 1  # ranks whose micro-batches the window holds (micro-batch i came from rank i % W)
    contexts: int = 1  # devices each micro-batch was split across in one process (Gluon contexts under a kvstore)
    precision: StepPrecision | None = None  # where the stack does not apply its gradient in float64
    absum: dict[str, np.ndarray] | None = None  # with precision: sum of |micro-batch gradients|, the round-off scale
    update: StepUpdate | None = None  # what the optimizer step did with the gradient, where the stack watched it
    reference: str = JOINED  # how ``window`` was computed (``accumcheck.report.stack.REFERENCES``)
    reference_note: str = ""  # why that reference, or how it weighted the micro-batches
    scale_norm: float | None = None  # without absum: a bound on ||S|| (sum over micro-batches of their norms)
    judged: Any = None  # the StackStep already judged where the window was judged as it was captured (in groups)
