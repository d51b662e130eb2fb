"""The one ratio every verdict rests on: an element's distance from the float64 sum E over its
round-off bound, |x - E| / (rel * S + floor). Above 1 cannot be round-off.

The compiled comparator (``statistics``) computes the same ratio inline, element by element;
everything else (ratio maps, the precision check, data-parallel ranks, the single-process
reference) computes it here.
"""

from __future__ import annotations

import numpy as np

from ..bounds import ModeBound
from .compiled import njit
from .kernel import cell_maxima

MAP_CELLS = 32  # a ratio map has at most this many cells a side


def ratios_to(excess: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """``excess / bound`` element by element: 0 where both are 0 (exact where nothing rounds, as
    at N = 1), infinite where the excess is not finite (a non-finite value is infinitely far)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = excess / bound
    return np.where(np.isnan(excess), np.inf, np.nan_to_num(ratio, nan=0.0, posinf=np.inf))


def bound_ratios(values: np.ndarray, exact: np.ndarray, absum: np.ndarray, bound: ModeBound,
                 absum_rms: float = 0.0) -> np.ndarray:
    """|values - E| / bound(S), element by element (flat, float64). ``absum_rms`` (the
    root-mean-square of S over the tensor) scales a kernel allowance."""
    v = np.asarray(values, np.float64).reshape(-1)
    e = np.asarray(exact, np.float64).reshape(-1)
    s = np.asarray(absum, np.float64).reshape(-1)
    return ratios_to(np.abs(v - e), bound.relative * s + bound.floor(absum_rms))


def worst_ratio(values: np.ndarray, exact: np.ndarray, absum: np.ndarray, bound: ModeBound,
                absum_rms: float = 0.0) -> tuple[float, int]:
    """The largest ratio over the tensor and its flat index (0.0 and -1 for an empty tensor): for
    contiguous float32 and float64 arrays one compiled pass without temporaries, the same ratios
    as ``bound_ratios`` (the first index where the largest is, as ``np.argmax``)."""
    arrays = [np.asarray(a) for a in (values, exact, absum)]
    if all(a.dtype in _COMPILED and a.flags.c_contiguous for a in arrays):
        ratio, where = _worst_ratio(*(a.reshape(-1) for a in arrays), float(bound.relative),
                                    float(bound.floor(absum_rms)))
        return float(ratio), int(where)
    ratio = bound_ratios(values, exact, absum, bound, absum_rms)
    if not ratio.size:
        return 0.0, -1
    where = int(np.argmax(ratio))
    return float(ratio[where]), where


_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))


@njit(error_model="numpy")
def _worst_ratio(v, e, s, relative, floor):
    """max over i of |v[i] - e[i]| / (relative * s[i] + floor), each ratio as ``ratios_to`` has it
    (infinite where the excess is nan or the bound is 0 under a non-zero excess, 0 where both are
    0 or both infinite), and its first index; (0.0, -1) for none."""
    best, at = -1.0, -1
    for i in range(v.size):
        excess = abs(np.float64(v[i]) - np.float64(e[i]))
        if excess != excess:
            ratio = np.inf
        else:
            ratio = excess / (relative * np.float64(s[i]) + floor)
            if ratio != ratio:
                ratio = 0.0
        if ratio > best:
            best, at = ratio, i
    return (0.0, -1) if at < 0 else (best, at)


def absum_rms(absum: np.ndarray) -> float:
    """The root-mean-square of S over a tensor: the scale of a kernel allowance."""
    s = np.asarray(absum, np.float64)
    return float(np.sqrt(np.mean(s * s))) if s.size else 0.0


def ratio_map(native: np.ndarray, manual: np.ndarray, exact: np.ndarray, absum: np.ndarray,
              native_bound: ModeBound, manual_bound: ModeBound) -> tuple[list[list[float]], list[int]]:
    """Where in a tensor the modes sit furthest from E, relative to the bound: the tensor as rows
    (its first axis) by columns (the rest), each cell the largest ratio of the elements it covers,
    at most MAP_CELLS a side. Returns (cells, [rows per cell, columns per cell]). One compiled pass
    (``kernel.cell_maxima``), no temporary of the tensor's size."""
    rms = absum_rms(absum)
    shape = np.shape(exact)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = int(np.prod(shape[1:] if len(shape) >= 2 else shape, dtype=np.int64))
    step_r, step_c = -(-rows // MAP_CELLS), -(-cols // MAP_CELLS)
    flat = [np.ascontiguousarray(x).reshape(-1) for x in (native, manual)]
    if flat[0].dtype != flat[1].dtype or flat[0].dtype not in (np.float32, np.float64):
        flat = [x.astype(np.float64) for x in flat]
    e, s = (np.ascontiguousarray(x, np.float64).reshape(-1) for x in (exact, absum))
    cells = cell_maxima(*flat, e, s, max(cols, 1), step_r, step_c, native_bound.relative, native_bound.floor(rms),
                        manual_bound.relative, manual_bound.floor(rms), (-(-rows // step_r), -(-cols // step_c)))
    return cells.tolist(), [step_r, step_c]


def unravel(flat: int, shape: tuple[int, ...] | list[int]) -> list[int]:
    """A flat index as a list of indices into ``shape`` ([] for none, or a scalar)."""
    if flat < 0:
        return []
    return [int(i) for i in np.unravel_index(flat, tuple(shape))] if len(shape) else []
