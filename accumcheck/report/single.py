"""The Report of one comparison: per-tensor verdicts, the run's facts, and what the full-batch and
data-parallel checks found, as typed fields. Plain data with a schema version: a saved report is
re-rendered by ``accumcheck show`` on a machine with no framework installed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..options import command_line
from .tensor import KIND_ORDER, TensorResult
from .values import SCHEMA_VERSION, Serialised


@dataclass
class FullBatchResult:
    """The accumulated gradient against the whole batch's in one backward pass (float64)."""

    normalisation: str  # the loss reduction used
    accumulated_scaled_by: str  # "1/N" for a mean loss, else "1"
    max_relative_difference: float  # of the full-batch gradient's largest element
    worst_tensor: str
    equivalent: bool
    tolerance: float


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
        return self.full_batch is not None and not self.full_batch.equivalent

    @property
    def exit_code(self) -> int:
        """0 when every tensor is faithful (and the full-batch check, if run, agrees), else 1."""
        return 1 if self.flagged or self.semantic_mismatch else 0

    def reproduce_command(self) -> str:
        """The CLI line that reruns this comparison (for a user's own model: the call)."""
        if "model" in self.config:
            return (f"accumcheck.{self.framework}.check(<your {self.config['model']}>, loss_fn, batches, "
                    f"accum_steps={self.accum_steps})")
        return command_line(self.config)


def _finite_or_max(x: float) -> float:
    return x if math.isfinite(x) else 1e308
