"""What only a data-parallel run is judged on: each rank's own accumulation, whether the ranks hold
the same gradient after the all-reduce, and whether the run matches one process over the same
global micro-batches. Framework-free: it judges the numpy arrays a backend returns.

Bounds (``ModeBound.for_stages``), for W ranks of N micro-steps each, E and S being the float64
sums across ranks divided by W:

  native     N-1 roundings on the rank, then the all-reduce: W-1 in the reduce dtype, one to cast
             into it when narrower, one to divide by W unless W is a power of two
  manual     the all-reduce of each micro-step (W-1, float32, and the division), then N-1 in the
             buffer's dtype
  reference  one process: W*N-1 roundings, and the division
  rank       a rank's own total against its own E and S: N-1 roundings

A tensor is flagged when a rank's own total is beyond its bound (the rank is named), when a rank's
gradient after the all-reduce is, or when native and the single-process reference differ by more
than their two bounds together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..bounds import UNIT_ROUNDOFF, ModeBound
from ..report import DataParallelResult, DataParallelSetup, RankVerdict, SingleProcessAgreement, TensorResult
from ..run.results import ParamAccumulation, RankAccumulation
from .ratio import worst_ratio


@dataclass(frozen=True)
class DataParallelBounds:
    native: ModeBound
    manual: ModeBound
    single_process: ModeBound
    rank: ModeBound
    reference: ModeBound | None  # float32 all-reduce's native bound, when the reduce dtype is narrower


def bounds_for(param_dtype: str, accum_dtype: str, accum_steps: int, world_size: int,
               reduce_dtype: str) -> DataParallelBounds:
    divide = 0 if world_size & (world_size - 1) == 0 else 1  # dividing by a power of two is exact
    cast = 1 if UNIT_ROUNDOFF[reduce_dtype] > UNIT_ROUNDOFF[param_dtype] else 0
    local = accum_steps - 1
    native = ModeBound.for_stages([(param_dtype, local), (reduce_dtype, world_size - 1 + cast + divide)])
    reference = None
    if cast:
        reference = ModeBound.for_stages([(param_dtype, local), ("float32", world_size - 1 + divide)])
    return DataParallelBounds(
        native=native,
        manual=ModeBound.for_stages([("float32", world_size - 1 + divide), (accum_dtype, local)]),
        single_process=ModeBound.for_stages([(param_dtype, world_size * accum_steps - 1 + divide)]),
        rank=ModeBound.for_sum(param_dtype, accum_steps),
        reference=reference,
    )


@dataclass
class Candidate:
    """A data-parallel check's worst ratio on a tensor: where, and against which bound."""

    ratio: float
    mode: str
    flat_index: int
    absum: np.ndarray
    bound: ModeBound


@dataclass
class RankChecks:
    """One tensor's data-parallel figures (TensorResult fields) and the checks behind them."""

    figures: dict[str, Any]
    candidates: list[Candidate] = field(default_factory=list)
    ranks_identical: bool = True  # every rank holds the same gradient after the all-reduce

    @property
    def flagged_ranks(self) -> list[int]:
        return self.figures["flagged_ranks"]


def check_tensor(p: ParamAccumulation, ranks: list[RankAccumulation], bounds: DataParallelBounds) -> RankChecks:
    """The data-parallel checks of parameter ``p``: the single-process reference, each rank's own
    total against its own E and S, and each rank's gradient after the all-reduce."""
    figures: dict[str, Any] = {}
    candidates = []
    if p.reference is not None:
        figures["single_ratio"], at_single = worst_ratio(p.reference, p.exact, p.absum, bounds.single_process)
        both = bounds.native.plus(bounds.single_process)
        figures["single_agreement"], at_agree = worst_ratio(p.native, p.reference, p.absum, both)
        candidates.append(Candidate(figures["single_ratio"], "single-process", at_single, p.absum,
                                    bounds.single_process))
        candidates.append(Candidate(figures["single_agreement"], "native vs single-process", at_agree, p.absum, both))
    local = [worst_ratio(r.local_native[p.name], r.exact[p.name], r.absum[p.name], bounds.rank) for r in ranks]
    final = [worst_ratio(r.native[p.name], p.exact, p.absum, bounds.native) for r in ranks]
    figures["rank_local_ratios"] = [ratio for ratio, _ in local]
    figures["rank_final_ratios"] = [ratio for ratio, _ in final]
    # A rank is named when its own total is beyond round-off, or when its gradient after the
    # all-reduce is while another rank's is not (a wrong average is every rank's, and no one's).
    final_bad = [not ratio <= 1 for ratio, _ in final]
    split = any(final_bad) and not all(final_bad)
    figures["flagged_ranks"] = [r.rank for r, (ratio, _), bad in zip(ranks, local, final_bad)
                                if not ratio <= 1 or (split and bad)]
    candidates += [Candidate(ratio, f"rank {r.rank}", where, r.absum[p.name], bounds.rank)
                   for r, (ratio, where) in zip(ranks, local) if where >= 0]
    identical = all(np.array_equal(r.native[p.name], ranks[0].native[p.name], equal_nan=True) for r in ranks[1:])
    return RankChecks(figures, candidates, identical)


def summarise(setup: DataParallelSetup, ranks: list[RankAccumulation], tensors: list[TensorResult],
              checks: list[RankChecks]) -> DataParallelResult:
    """The run's data-parallel verdicts: per rank, whether the ranks agree, the single-process
    agreement."""
    verdicts = [RankVerdict(rank=r.rank, host=r.host,
                            flagged=[t.name for t in tensors if r.rank in (t.flagged_ranks or [])]) for r in ranks]
    final_identical = all(c.ranks_identical for c in checks)
    agreements = [(t.single_agreement, t.name) for t in tensors if t.single_agreement is not None]
    worst = max(agreements, default=(0.0, ""))
    return DataParallelResult(
        setup=setup, ranks=verdicts,
        ranks_agree=final_identical and len({tuple(v.flagged) for v in verdicts}) <= 1,
        final_identical=final_identical,
        single_process=SingleProcessAgreement(worst_agreement=worst[0], worst_tensor=worst[1], agree=worst[0] <= 1.0))
