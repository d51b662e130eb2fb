"""Verdicts only a data-parallel run has: each rank's own accumulation, whether the ranks hold the
same gradient after the all-reduce, and whether the run matches one process over the same global
micro-batches. Framework-free: it judges the numpy arrays a backend returns.

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

from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.base import RunResult
from .bounds import UNIT_ROUNDOFF, ModeBound
from .report import FLAGGED_VERDICTS, TensorResult


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


def worst_ratio(values: np.ndarray, exact: np.ndarray, absum: np.ndarray, bound: ModeBound) -> tuple[float, int]:
    """The largest |values - E| / bound(S) over the tensor, and its flat index (inf where a value
    is not finite)."""
    v = np.asarray(values, np.float64).reshape(-1)
    e = np.asarray(exact, np.float64).reshape(-1)
    s = np.asarray(absum, np.float64).reshape(-1)
    if not v.size:
        return 0.0, -1
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.abs(v - e) / (bound.relative * s + bound.floor(0.0))
    ratio = np.where(np.isfinite(v), np.nan_to_num(ratio, nan=0.0, posinf=np.inf), np.inf)
    where = int(np.argmax(ratio))
    return float(ratio[where]), where


def judge(tensors: list[TensorResult], run: RunResult, bounds: DataParallelBounds) -> dict[str, Any]:
    """Add the data-parallel figures to each TensorResult (flagging where they fail) and return
    the run's summary: per-rank verdicts, whether the ranks agree, the single-process agreement."""
    ranks = run.ranks or []
    first = ranks[0] if ranks else None
    final_identical = True
    for t, p in zip(tensors, run.params):
        candidates = []
        if p.reference is not None:
            t.single_ratio, at_single = worst_ratio(p.reference, p.exact, p.absum, bounds.single_process)
            t.single_agreement, at_agree = _agreement(p.native, p.reference, p.absum, bounds.native,
                                                      bounds.single_process)
            candidates.append((t.single_ratio, "single-process", at_single, p.absum, bounds.single_process))
            candidates.append((t.single_agreement, "native vs single-process", at_agree, p.absum,
                               ModeBound(bounds.native.dtype, 0, bounds.native.relative + bounds.single_process.relative,
                                         bounds.native.absolute + bounds.single_process.absolute)))
        local = [worst_ratio(r.local_native[p.name], r.exact[p.name], r.absum[p.name], bounds.rank) for r in ranks]
        final = [worst_ratio(r.native[p.name], p.exact, p.absum, bounds.native) for r in ranks]
        t.rank_local_ratios = [ratio for ratio, _ in local]
        t.rank_final_ratios = [ratio for ratio, _ in final]
        # A rank is named when its own total is beyond round-off, or when its gradient after the
        # all-reduce is while another rank's is not (a wrong average is every rank's, and no one's).
        final_bad = [not fr <= 1 for fr, _ in final]
        split = any(final_bad) and not all(final_bad)
        t.flagged_ranks = [r.rank for r, (lr, _), bad in zip(ranks, local, final_bad) if not lr <= 1 or (split and bad)]
        if first is not None and any(not np.array_equal(r.native[p.name], first.native[p.name], equal_nan=True)
                                     for r in ranks[1:]):
            final_identical = False
        candidates += [(ratio, f"rank {r.rank}", where, r.absum[p.name], bounds.rank)
                       for r, (ratio, where) in zip(ranks, local) if where >= 0]
        _take_worst(t, candidates)
    verdicts = [{"rank": r.rank, "host": r.host,
                 "flagged": [t.name for t in tensors if r.rank in (t.flagged_ranks or [])]} for r in ranks]
    agreements = [(t.single_agreement, t.name) for t in tensors if t.single_agreement is not None]
    worst = max(agreements, default=(0.0, ""))
    return {
        "ranks": verdicts,
        "ranks_agree": final_identical and len({tuple(v["flagged"]) for v in verdicts}) <= 1,
        "final_identical": final_identical,
        "single_process": {"worst_agreement": worst[0], "worst_tensor": worst[1], "agree": worst[0] <= 1.0},
    }


def _agreement(native: np.ndarray, reference: np.ndarray, absum: np.ndarray, a: ModeBound,
               b: ModeBound) -> tuple[float, int]:
    """The largest |native - reference| over the sum of their two bounds, and its flat index."""
    s = np.asarray(absum, np.float64).reshape(-1)
    diff = np.abs(np.asarray(native, np.float64) - np.asarray(reference, np.float64)).reshape(-1)
    if not diff.size:
        return 0.0, -1
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = diff / ((a.relative + b.relative) * s + a.floor(0.0) + b.floor(0.0))
    ratio = np.where(np.isnan(diff), np.inf, np.nan_to_num(ratio, nan=0.0, posinf=np.inf))
    where = int(np.argmax(ratio))
    return float(ratio[where]), where


def _take_worst(t: TensorResult, candidates: list[tuple[float, str, int, np.ndarray, ModeBound]]) -> None:
    """Flag ``t`` when a data-parallel check fails (a named rank, or the single-process
    reference), and point its ratio and worst element at the worst of them."""
    if t.flagged_ranks and t.verdict not in FLAGGED_VERDICTS:
        t.verdict = "diverged"
    if not candidates:
        return
    ratio, mode, where, s, bound = max(candidates, key=lambda c: c[0])
    if ratio > 1.0 and t.verdict not in FLAGGED_VERDICTS:
        t.verdict = "diverged"
    if ratio > t.ratio:
        t.ratio, t.worst_mode = ratio, mode
        flat_s = np.asarray(s, np.float64).reshape(-1)
        t.worst_index = [int(i) for i in np.unravel_index(where, tuple(t.shape))] if t.shape else []
        t.bound_at_worst = bound.at(float(flat_s[where]))
