"""The per-tensor reduction written from its definitions in plain numpy (slow, obviously right): what
``accumcheck.judge.kernel`` and every device implementation must compute."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from accumcheck.judge.kernel import Reduction

BITS = {np.dtype(np.float16): np.int16, np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64}
SUMS = ("sum_s", "sum_abs_e", "sum_sq_e", "sum_sq_err_a", "sum_sq_err_b", "sum_sq_s")


def _first_max(values: np.ndarray, where: np.ndarray) -> tuple[float, int]:
    """The largest of ``values`` (0 when none is positive) and the first flat index of ``where`` holding it."""
    if not values.size or not values.max() > 0:
        return 0.0, -1
    top = values.max()
    return float(top), int(where[np.flatnonzero(values == top)[0]])


def _ordered(bits: np.ndarray) -> np.ndarray:
    """Bit patterns on a monotonic integer line (negative floats mirrored), as Python ints."""
    low = int(np.iinfo(bits.dtype).min)
    return np.array([low - int(v) if v < 0 else int(v) for v in bits.tolist()], dtype=object)


def reference(a, b, e, s, rel_a, abs_a, rel_b, abs_b, rtol, atol) -> Reduction:
    x, y = a.astype(np.float64), b.astype(np.float64)
    finite = np.isfinite(x) & np.isfinite(y) & np.isfinite(e)
    both_nan = np.isnan(x) & np.isnan(y)
    mismatched = int(np.sum(finite & (x != y)) + np.sum(~finite & ~((x == y) | both_nan)))
    index = np.flatnonzero(finite)
    x, y, ef, sf = x[finite], y[finite], e[finite], s[finite]
    da, db = np.abs(x - ef), np.abs(y - ef)
    bound_a, bound_b = rel_a * sf + abs_a, rel_b * sf + abs_b
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio_a, index_a = _first_max(np.where(da > 0, da / bound_a, 0.0), index)
        ratio_b, index_b = _first_max(np.where(db > 0, db / bound_b, 0.0), index)
        differ = x != y
        d, ay = np.abs(x - y)[differ], np.abs(y)[differ]
        rel = np.where(ay > 0, d / ay, np.inf)
        diff_ratio = d / (bound_a[differ] + bound_b[differ])
    max_diff, index_diff = _first_max(d, index[differ])
    ab = a.reshape(-1).view(BITS[a.dtype])[finite][differ]
    bb = b.reshape(-1).view(BITS[b.dtype])[finite][differ]
    gaps = [float(abs(p - q)) if (p >= 0) == (q >= 0) else abs(float(p) - float(q))
            for p, q in zip(_ordered(ab), _ordered(bb))]
    return Reduction(
        nonfinite_a=int(np.sum(~np.isfinite(a.astype(np.float64)))), nonfinite_b=int(np.sum(~np.isfinite(b.astype(
            np.float64)))), nonfinite_e=int(np.sum(~np.isfinite(e))), mismatched=mismatched,
        classic_mismatched=int(np.sum(d > atol + rtol * ay)), over_a=int(np.sum(da > bound_a)),
        over_b=int(np.sum(db > bound_b)), max_e=float(np.max(np.abs(ef), initial=0.0)),
        max_err_a=float(np.max(da, initial=0.0)), max_err_b=float(np.max(db, initial=0.0)), ratio_a=ratio_a,
        index_a=index_a, ratio_b=ratio_b, index_b=index_b, max_diff=max_diff, index_diff=index_diff,
        max_rel=float(np.max(rel, initial=0.0)), max_ulps=max(gaps, default=0.0),
        diff_ratio=float(np.max(diff_ratio, initial=0.0)), sum_s=math.fsum(sf), sum_abs_e=math.fsum(np.abs(ef)),
        sum_sq_e=math.fsum(ef * ef), sum_sq_err_a=math.fsum(da * da), sum_sq_err_b=math.fsum(db * db),
        sum_sq_s=math.fsum(sf * sf))


def assert_same(got: Reduction, want: Reduction, sum_rtol: float = 1e-12) -> None:
    """Every figure equal, bit for bit, but the sums (their order differs): within ``sum_rtol``."""
    for field in Reduction._fields:
        g, w = getattr(got, field), getattr(want, field)
        if field in SUMS:
            assert math.isclose(g, w, rel_tol=sum_rtol, abs_tol=1e-300) or (math.isinf(g) and g == w), (field, g, w)
        else:
            assert g == w or (isinstance(g, float) and math.isnan(g) and math.isnan(w)), (field, g, w)


# Arrays built to hit what the fast loops skip: equal and differing blocks, block edges, ties,
# zeros, subnormals, signs, non-finite values, bounds of zero.
SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.0e38, -3.0e38, 1.0, -1.0, np.inf, -np.inf, np.nan]


@st.composite
def tensors(draw, dtypes=(np.float32, np.float64)):
    dtype = draw(st.sampled_from(dtypes))
    n = draw(st.sampled_from([0, 1, 7, 255, 256, 257, 600, 1300]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = 10.0 ** rng.uniform(-8, 2, n)
    exact = rng.standard_normal(n) * scale
    absum = np.abs(exact) * rng.uniform(1, 50, n)
    a = exact.astype(dtype)
    b = a.copy()
    # Where the modes differ: none, a few, a block's worth, or about half.
    for _ in range(draw(st.integers(0, 3))):
        lo = draw(st.integers(0, max(n - 1, 0)))
        hi = min(n, lo + draw(st.sampled_from([1, 3, 256, 700])))
        noise = rng.standard_normal(hi - lo) * scale[lo:hi] * 10.0 ** draw(st.integers(-9, 0))
        b[lo:hi] = (b[lo:hi].astype(np.float64) + noise).astype(dtype)
    if draw(st.booleans()):  # ties: the same worst values again, later
        b[n // 2:] = b[:n - n // 2]
        a[n // 2:] = a[:n - n // 2]
        exact[n // 2:] = exact[:n - n // 2]
        absum[n // 2:] = absum[:n - n // 2]
    for _ in range(draw(st.integers(0, 4))):  # special values anywhere
        if n:
            which = draw(st.sampled_from(["a", "b", "e", "s0"]))
            i = draw(st.integers(0, n - 1))
            value = draw(st.sampled_from(SPECIAL))
            if which == "a":
                a[i] = value
            elif which == "b":
                b[i] = value
            elif which == "e":
                exact[i] = value
            else:
                absum[i] = 0.0
    return a, b, exact, absum


BOUNDS = st.tuples(st.sampled_from([0.0, 1e-7, 3e-6, 0.25]), st.sampled_from([0.0, 1e-30, 1e-9]),
                   st.sampled_from([0.0, 1e-7, 1e-3]), st.sampled_from([0.0, 1e-12]))
