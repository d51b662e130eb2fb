"""The dominance report: which named parameters dominate the gradient norm (no framework imports)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DominanceEntry:
    name: str
    share: float  # of the total sum of squares (nan where the gradient is not finite)
    norm: float
    param_rms: float  # of the parameter's values, recomputed when the report is built
    largest_index: list[int]  # where |grad| is largest (where it is not finite, if any)
    largest_value: float
    nonfinite: int  # non-finite elements in the gradient


@dataclass
class DominanceReport:
    step: int
    reason: str
    total_norm: float
    clip_coef: float
    entries: list[DominanceEntry] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"step {self.step}: {self.reason}; total gradient norm {self.total_norm:.4g}, "
               f"clip scale {self.clip_coef:.4g}; dominated by:"]
        for e in self.entries:
            share = "non-finite" if math.isnan(e.share) else f"{100 * e.share:.1f}% of the sum of squares"
            # a sharded gradient's rms and largest element are each rank's, not told here
            whole = "" if math.isnan(e.param_rms) and not e.largest_index else (
                f", param rms {e.param_rms:.4g}, largest |grad| {e.largest_value:.4g} at {tuple(e.largest_index)}")
            out.append(f"  {e.name}: {share}, norm {e.norm:.4g}{whole}"
                       + (f", {e.nonfinite} non-finite" if e.nonfinite else ""))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def rank(names: list[str], norms: np.ndarray, top_k: int) -> list[tuple[int, float]]:
    """(index, share) of the top_k parameters: non-finite ones first, then by share of the sum
    of squares of the finite norms."""
    norms = np.asarray(norms, np.float64)
    finite = np.isfinite(norms)
    squares = np.where(finite, norms, 0.0) ** 2
    total = squares.sum()
    shares = np.where(finite, squares / total if total > 0 else 0.0, np.nan)
    order = sorted(range(len(names)), key=lambda i: (finite[i], -shares[i] if finite[i] else 0.0))
    return [(i, float(shares[i])) for i in order[:top_k]]


def largest(grad: np.ndarray) -> tuple[list[int], float, int]:
    """Where |grad| is largest (a non-finite element first), that value, and the non-finite count
    (nowhere, 0.0 and 0 for a gradient without elements)."""
    flat = grad.reshape(-1)
    if not flat.size:
        return [], 0.0, 0
    bad = ~np.isfinite(flat)
    index = int(np.argmax(bad)) if bad.any() else int(np.argmax(np.abs(flat)))
    where = [int(i) for i in np.unravel_index(index, grad.shape)] if grad.shape else []
    return where, float(flat[index]), int(bad.sum())
