"""The Report of one comparison: per-tensor verdicts, the run's facts, and what the full-batch and
data-parallel checks found, as typed fields. Plain data with a schema version: a saved report is
re-rendered by ``accumcheck show`` on a machine with no framework installed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..options.spec import command_line
from .tensor import KIND_ORDER, TensorResult
from .values import SCHEMA_VERSION, Serialised


@dataclass
class TermFit:
    """One additive term of the loss in the accumulated gradient: A = a x (the rest of the window's
    gradient) + sum of b x (this term's gradient summed over the micro-batches)."""

    name: str  # "router load-balancing loss (aux_loss x 0.02)"
    factor: float  # b
    micro_batches: int  # k, the window's micro-batches: b = 1/k is their mean, what accumulation can do
    batch_level: bool  # one batch's term is not the micro-batches' mean: no accumulation equals it
    batch_gap: float  # |T(window) - sum of T(micro-batch) / k| / |T(window)|


@dataclass
class FullBatchResult:
    """The accumulated gradient against the whole batch's in one backward pass (float64)."""

    normalisation: str  # the loss reduction used
    accumulated_scaled_by: str  # "1/N" for a mean loss, else "1"
    max_relative_difference: float  # of the full-batch gradient's largest element
    worst_tensor: str
    equivalent: bool
    tolerance: float
    # What the accumulated gradient A is instead of the full batch's F (``accumcheck.judge.fullbatch``);
    # reports saved by earlier versions have none of it. Factors are least squares, <A,F>/<F,F>.
    factor: float | None = None  # c over all tensors
    tensor_factors: dict[str, float] = field(default_factory=dict)  # c_t, for the tensors whose F is not zero
    factor_min: float | None = None
    factor_max: float | None = None
    factor_worst_tensor: str = ""  # the tensor furthest from c
    spread: float | None = None  # max |c_t - c| / |c|
    residual: float | None = None  # ||A - cF|| / ||A|| over all tensors
    worst_tensor_residual: float | None = None  # the same, of factor_worst_tensor alone
    factor_tolerance: float | None = None
    constant: bool = False  # not equivalent, but A = cF within factor_tolerance
    matches: str | None = None  # what a constant c is ("1/N", "N", ...), None when nothing known
    item_counts: list[int] | None = None  # items per micro-batch, where the run knows them
    explanation: str = ""  # one sentence: what A is
    silent_tensors: list[str] = field(default_factory=list)  # round-off in A and F: no factor, left out of it
    # the modules that compute over the batch (BatchNorm in train mode): a window differs from one
    # batch by design; ``rest`` is A against F with them in eval mode, where that was run
    by_design: list[str] = field(default_factory=list)
    rest: FullBatchResult | None = None
    # the loss's additive terms, where the model has them: A = main_factor x (the window's gradient
    # of the rest of the loss) + each term's factor x (its gradient summed over the micro-batches)
    terms: list[TermFit] = field(default_factory=list)
    main_factor: float | None = None
    terms_residual: float | None = None  # |A - that combination| / |A|
    # A against the sum over the micro-batches of each one's own loss's gradient (normalised over
    # its own items), where the window's F did not explain it
    micro_sum_factor: float | None = None
    micro_sum_residual: float | None = None
    # A is the window's gradient but for terms computed over the batch by design, which
    # accumulation can only average over the micro-batches: not a fault of the accumulation
    batch_level: bool = False
    # data parallel: A = sum over the ranks of rank_factors[r] x (rank r's micro-batches as a batch
    # of their own, normalised over that rank's items); the items each rank held
    rank_factors: list[float] | None = None
    rank_residual: float | None = None
    rank_items: list[int] | None = None

    @property
    def faithful(self) -> bool:
        """A is the whole batch's gradient, or differs from it only where the model computes over
        the batch by design (terms the micro-batches can only average; BatchNorm in train mode,
        with A = F once it is in eval mode)."""
        return self.equivalent or self.batch_level or (self.rest is not None and self.rest.faithful)

    @property
    def headline(self) -> str:
        """The factor in a few words for a summary: "0.250 x it on every tensor (1/N)", "not a
        constant factor", or "" for an equivalent result or a report without the factors."""
        if self.equivalent or not self.explanation:
            return ""
        if self.faithful:
            return "the window's but for what computes over the batch by design"
        if self.rest is not None:
            return f"{self.rest.headline}, with the modules that compute over the batch in eval mode"
        if not self.constant or self.factor is None:
            return "not a constant factor"
        return f"{factor_text(self.factor)} x it on every tensor" + (f" ({self.matches})" if self.matches else "")


def factor_text(x: float) -> str:
    """A factor in 3 significant digits, trailing zeros kept ("0.250", "4.00", "1.00e-05")."""
    return f"{x:#.3g}".rstrip(".") if math.isfinite(x) else str(x)


@dataclass
class DataParallelSetup:
    """How a data-parallel run was set up: what a backend reports, in words and numbers."""

    world_size: int
    backend: str  # the collective library (gloo, nccl)
    launcher: str
    reduce_dtype: str
    find_unused_parameters: bool
    hosts: list[str]
    fault_rank: int | None
    native: str  # what native accumulation means here
    manual: str
    reference: str
    micro_batches: str


@dataclass
class RankVerdict:
    rank: int
    host: str
    flagged: list[str]  # tensors this rank is named for


@dataclass
class SingleProcessAgreement:
    worst_agreement: float  # worst |native - reference| over the two bounds
    worst_tensor: str
    agree: bool


@dataclass
class DataParallelResult:
    setup: DataParallelSetup
    ranks: list[RankVerdict]
    ranks_agree: bool
    final_identical: bool  # every rank holds the same gradient after the all-reduce
    single_process: SingleProcessAgreement


@dataclass
class Report(Serialised):
    """The result of one comparison, with everything needed to reproduce it. ``config`` holds the
    options it ran with (``RunConfig.record()``; for a user's own model: ``model``), ``settings``
    the backend's own facts (deterministic algorithms, threads, what native and manual mean),
    ``notes`` the facts a reader is told in the header."""

    case: str
    case_source: str
    case_fingerprint: str
    case_toml: str
    framework: str
    versions: dict[str, str]
    device: str
    param_dtype: str
    accum_dtype: str
    accum_steps: int
    seed: int
    oracle: bool
    inject: str | None
    bound: dict[str, Any]
    settings: dict[str, Any]
    losses: dict[str, float]
    seconds: float
    created: str
    tensors: list[TensorResult] = field(default_factory=list)
    loss_reduction: str = "mean"
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    full_batch: FullBatchResult | None = None
    data_parallel: DataParallelResult | None = None
    # In how many groups the tensors were run and judged to stay within --memory-budget (1: all at once).
    groups: int = 1
    kind: str = "report"
    schema_version: int = SCHEMA_VERSION

    @property
    def flagged(self) -> list[TensorResult]:
        """Flagged tensors, embeddings and weights first, then by how far past the bound."""
        hits = [t for t in self.tensors if t.flagged]
        return sorted(hits, key=lambda t: (KIND_ORDER.index(t.kind) if t.kind in KIND_ORDER else 9,
                                           -_finite_or_max(t.ratio)))

    @property
    def semantic_mismatch(self) -> bool:
        """The full-batch check ran and the accumulated gradient is not the whole batch's."""
        return self.full_batch is not None and not self.full_batch.faithful

    @property
    def suspicious(self) -> list[TensorResult]:
        """Tensors inside their bound whose error lines up with a fault's pattern."""
        return [t for t in self.tensors if t.verdict == "suspicious"]

    @property
    def failing(self) -> list[TensorResult]:
        """The tensors that fail the run under its ``fail_on`` policy (``config["fail_on"]``):
        every flagged tensor ("marginal", the default), only those of severity diverged
        ("diverged"), or the suspicious ones too ("suspicious")."""
        policy = self.config.get("fail_on") or "marginal"
        if policy == "diverged":
            return [t for t in self.flagged if t.severity != "marginal"]
        return self.flagged + (self.suspicious if policy == "suspicious" else [])

    @property
    def exit_code(self) -> int:
        """0 when no tensor fails under the run's ``fail_on`` policy (and the full-batch check, if
        run, agrees), else 1."""
        return 1 if self.failing or self.semantic_mismatch else 0

    def reproduce_command(self) -> str:
        """The CLI line that reruns this comparison (for a user's own model: the call)."""
        if "model" in self.config:
            return user_model_call(self.framework, self.config, self.accum_steps)
        return command_line(self.config)


def user_model_call(framework: str, config: dict[str, Any], accum_steps: int) -> str:
    """The call (or, for ``accumcheck check FILE.py``, the command) that reruns a check of a
    user's own model, with the options it ran with."""
    if "setup" in config:
        flags = [f"--accum-steps {accum_steps}"]
        for key, value in config.get("command_options", {}).items():
            if key != "accum_steps" and value is not False:
                flags.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))
        return f"accumcheck check {config['setup']} {' '.join(flags)}"
    loss = config.get("loss", "loss_fn")
    model = f"<your {config['model']}>"
    # JAX's: check(params, loss_fn, batches), config["model"] naming the loss function
    head = {"loss_fn": f"{model}, loss_fn, batches", "step": f"{model}, batches=batches, step=step",
            "loss_fn(params, batch)": f"params, {model}, batches"}.get(loss, f"{model}, batches=batches")
    options = [f"accum_steps={accum_steps}"]
    for key, value in config.items():
        if key in ("model", "loss", "setup", "command_options"):
            continue
        options.append(f"{key}={value}" if key in ("autocast", "grad_scaler") else f"{key}={value!r}")
    return f"accumcheck.{framework}.check({head}, {', '.join(options)})"


def _finite_or_max(x: float) -> float:
    return x if math.isfinite(x) else 1e308
