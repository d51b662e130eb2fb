"""A tensor read a piece at a time: the judge's float64 temporaries (A in float64, A - F, A - cF)
are of one piece, never of the whole tensor, so what judging a large tensor holds beside its
arrays is bounded (a memory budget counts it per piece). A tensor of one piece is read whole, as
the reductions would read it anyway, so its figures are those of whole-tensor arithmetic bit for
bit; a larger one's sums add the pieces' sums in order."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from .compiled import njit

# Elements per piece: 32 MiB per float64 temporary.
PIECE = 1 << 22


def pieces(*arrays: np.ndarray, wide: bool = True) -> Iterator[tuple[np.ndarray, ...]]:
    """Aligned flat pieces of ``arrays`` (of one number of elements), PIECE elements at a time, in
    float64 (``wide``) or as they are (views)."""
    flats = [np.asarray(a).reshape(-1) for a in arrays]
    size = flats[0].size
    for lo in range(0, size, PIECE):
        if wide:
            yield tuple(np.asarray(f[lo:lo + PIECE], np.float64) for f in flats)
        else:
            yield tuple(f[lo:lo + PIECE] for f in flats)


def max_abs(x: np.ndarray, y: np.ndarray | None = None) -> float:
    """max |x| (max |x - y| with ``y``, the difference in float64), 0 for no elements; nan where any
    element is nan. A maximum is exact, the same in any order: max |x| is read from numpy's
    maximum and minimum of x, without temporaries; max |x - y| of float32 and float64 arrays in one
    compiled pass, of other dtypes a piece at a time."""
    if y is None:
        flat = np.asarray(x).reshape(-1)
        if flat.size == 0:
            return 0.0
        top, bottom = float(np.max(flat)), float(np.min(flat))
        return math.nan if math.isnan(top) else max(0.0, top, -bottom)
    flats = [np.asarray(a).reshape(-1) for a in (x, y)]
    if all(f.dtype in _COMPILED for f in flats):
        return float(_max_abs_difference(flats[0], flats[1]))
    found = [np.max(np.abs(a - b)) for a, b in pieces(x, y)]
    return float(np.max(found)) if found else 0.0


_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))


@njit()
def _max_abs_difference(x, y):
    """max |x - y| over flat arrays, each difference in float64; nan at the first nan."""
    top = 0.0
    for i in range(x.size):
        v = abs(np.float64(x[i]) - np.float64(y[i]))
        if v > top:
            top = v
        elif v != v:
            return np.nan
    return top


def dot(x: np.ndarray, y: np.ndarray) -> float:
    """The sum of x * y in float64."""
    return float(sum(a @ b for a, b in pieces(x, y)))


def squared_norm(x: np.ndarray) -> float:
    """The sum of x * x in float64, each piece's as a dot product (``np.linalg.norm``'s way)."""
    return float(sum(p @ p for (p,) in pieces(x)))


def squared_distance(x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> float:
    """||x - scale * y||^2 in float64, each piece's as a dot product (``np.linalg.norm``'s way)."""
    total = 0.0
    for a, b in pieces(x, y):
        d = a - scale * b
        total += float(d @ d)
        del a, b, d  # before the next piece is made: one piece's temporaries at a time
    return total


def sum_of_squares(x: np.ndarray, y: np.ndarray | None = None) -> float:
    """The sum of x^2 (of (x - y)^2 with ``y``) in float64, each piece's by ``np.sum`` (pairwise)."""
    total = 0.0
    for p in (pieces(x) if y is None else pieces(x, y)):
        total += float(np.sum(np.square(p[0] if y is None else p[0] - p[1])))
    return total


def all_finite(x: np.ndarray) -> bool:
    """Whether every element of ``x`` is finite."""
    return all(bool(np.isfinite(p).all()) for (p,) in pieces(x, wide=False))
