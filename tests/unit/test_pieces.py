"""The judge's sums over a tensor (accumcheck.judge.pieces): float32 and float64 arrays by compiled
passes, other dtypes a piece at a time so that their float64 temporaries are of one piece. Either
way each sum is within its recursive-sum bound (n units of float64's round-off of the sum of the
terms' magnitudes) of the exact sum of the same float64 terms (``math.fsum``), a maximum is exact,
nan and inf are found in any piece, and the peak the judge allocates follows the piece, not the
tensor."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from accumcheck.judge import pieces
from accumcheck.judge.fullbatch import fit_factor, largest_difference
from accumcheck.torch.stacks.owndtype import JUDGE_BYTES

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # nan in the arithmetic on purpose


def arrays(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 0, n)
    return (f * 0.5 + rng.standard_normal(n) * 1e-9).astype(np.float32), f


U = 2.0 ** -53


def within_sum_bound(found: float, terms: np.ndarray) -> bool:
    """``found`` within n units of float64's round-off of the sum of |terms| from their exact sum."""
    return abs(found - math.fsum(terms)) <= (terms.size + 1) * U * math.fsum(np.abs(terms))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(np.float32, np.float64), (np.float64, np.float64), (np.float32, np.float32),
                        (np.float16, np.float64)]).flatmap(
    lambda dtypes: st.integers(0, 70).flatmap(
        lambda n: st.tuples(hnp.arrays(dtypes[0], n, elements=st.floats(-1e4, 1e4, width=16)),
                            hnp.arrays(dtypes[1], n, elements=st.floats(-1e4, 1e4, width=16))))),
       st.sampled_from([1.0, 0.3, -2.5, 0.0]))
def test_every_sum_is_within_its_round_off_bound_of_the_exact_sum(pair, scale):
    """Compiled for float32 and float64 (four running sums), a piece at a time for float16: dot,
    squared norm, squared distance and sum of squares, each within its bound of ``math.fsum`` over
    the same float64 terms (the products and differences rounded as float64 rounds them)."""
    x, y = pair
    wide = x.astype(np.float64)
    d = wide - scale * y.astype(np.float64)
    assert within_sum_bound(pieces.dot(x, y), wide * y)
    assert within_sum_bound(pieces.squared_norm(x), wide * wide)
    assert within_sum_bound(pieces.squared_distance(x, y, scale), d * d)
    assert within_sum_bound(pieces.sum_of_squares(x, y), np.square(wide - y))
    assert within_sum_bound(pieces.sum_of_squares(y), np.square(y.astype(np.float64)))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_tensor_of_many_pieces_gives_the_same_figures_to_round_off(monkeypatch, dtype):
    """float32 is read whole by the compiled passes, float16 a piece at a time (11 pieces, the
    last one short): the same figures to round-off, the same maximum exactly."""
    a, f = arrays(10_000)
    a = a.astype(dtype)
    a64 = a.astype(np.float64)
    monkeypatch.setattr(pieces, "PIECE", 999)
    assert len(list(pieces.pieces(a, f))) == 11
    assert pieces.max_abs(a, f) == float(np.max(np.abs(a64 - f)))  # a maximum is exact in any order
    assert pieces.dot(a, f) == pytest.approx(float(a64 @ f), rel=1e-12)
    assert pieces.squared_norm(a) == pytest.approx(float(a64 @ a64), rel=1e-12)
    assert pieces.squared_distance(a, f, 0.3) == pytest.approx(float(np.sum(np.square(a64 - 0.3 * f))), rel=1e-12)
    assert pieces.sum_of_squares(a, f) == pytest.approx(float(np.sum(np.square(a64 - f))), rel=1e-12)
    assert pieces.max_abs(np.zeros(0)) == 0.0 and pieces.dot(np.zeros(0), np.zeros(0)) == 0.0


def test_a_strided_array_is_read_as_its_values():
    """A view that is not contiguous goes the piece-at-a-time way, to the same figures."""
    a, f = arrays(2_000)
    a2, f2 = a.reshape(40, 50)[:, ::2], f.reshape(40, 50)[:, ::2]
    assert not a2.flags.c_contiguous
    a64, f64 = np.ascontiguousarray(a2, np.float64), np.ascontiguousarray(f2)
    assert pieces.dot(a2, f2) == pytest.approx(float(a64.reshape(-1) @ f64.reshape(-1)), rel=1e-12)
    assert pieces.squared_distance(a2, f2, 0.3) == pytest.approx(float(np.sum(np.square(a64 - 0.3 * f64))),
                                                                rel=1e-12)


@pytest.mark.parametrize("where", [5, 9_995])
def test_nan_and_inf_in_any_piece_are_found(monkeypatch, where):
    monkeypatch.setattr(pieces, "PIECE", 999)
    a, f = arrays(10_000)
    a[where] = np.nan
    assert math.isnan(pieces.max_abs(a)) and math.isnan(pieces.max_abs(a, f))
    assert not pieces.all_finite(a)
    a[where] = np.inf
    assert not pieces.all_finite(a)
    assert pieces.all_finite(f)
    gap, worst = largest_difference({"w": a}, {"w": f})
    assert gap == math.inf and worst == "w"
    assert not fit_factor({"w": a}, {"w": f}).finite


def test_judging_a_large_tensor_allocates_for_one_piece_not_the_tensor(monkeypatch):
    """fit_factor and largest_difference on 4M elements, in pieces of 64K: the peak the judge
    allocates stays within its count for one piece (``owndtype.JUDGE_BYTES`` an element), where
    whole-tensor arithmetic would allocate 24 bytes for each of the 4M."""
    monkeypatch.setattr(pieces, "PIECE", 1 << 16)
    a, f = arrays(1 << 22)
    small = {"w": a[:8]}, {"w": f[:8]}
    fit_factor(*small), largest_difference(*small)  # the compiled passes loaded (or compiled, cache cold) first
    tracemalloc.start()
    fit = fit_factor({"w": a}, {"w": f})
    gap, _ = largest_difference({"w": a}, {"w": f})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert fit.factor == pytest.approx(0.5, rel=1e-6) and gap == pytest.approx(0.5, rel=1e-6)
    assert peak <= JUDGE_BYTES * pieces.PIECE + 2**16


VALUES = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=16),  # held exactly by every dtype
                   st.sampled_from([np.nan, np.inf, -np.inf]))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([(np.float32, np.float64), (np.float64, np.float64), (np.float32, np.float32),
                        (np.float16, np.float64)]).flatmap(
    lambda dtypes: st.integers(0, 40).flatmap(
        lambda n: st.tuples(hnp.arrays(dtypes[0], n, elements=VALUES), hnp.arrays(dtypes[1], n, elements=VALUES)))))
def test_max_abs_is_numpys_maximum_for_every_dtype_nan_and_inf(pair):
    """Compiled for float32 and float64, a piece at a time for other dtypes: the same maximum as
    numpy's over the float64 values, nan where any element (or difference) is nan, 0 for none."""
    x, y = pair

    def numpys(values: np.ndarray) -> float:
        return float(np.max(np.abs(values), initial=0.0)) if not np.isnan(values).any() else math.nan

    wide = x.astype(np.float64)
    for found, expected in ((pieces.max_abs(x), numpys(wide)), (pieces.max_abs(x, y), numpys(wide - y))):
        assert found == expected or (math.isnan(found) and math.isnan(expected))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([(np.float32, np.float64), (np.float64, np.float64), (np.float32, np.float32),
                        (np.float16, np.float64), (np.float64, np.float32)]).flatmap(
    lambda dtypes: st.integers(0, 40).flatmap(
        lambda n: st.tuples(hnp.arrays(dtypes[0], n, elements=VALUES), hnp.arrays(dtypes[1], n, elements=VALUES)))))
def test_pair_sums_are_the_figures_each_function_gives(pair):
    """One pass over x and y (compiled for float32 and float64, figure by figure for others): the
    maxima and finiteness exactly as ``max_abs`` and ``all_finite`` give them, nan and inf
    included, and where all is finite each sum within its bound of ``math.fsum``."""
    x, y = pair
    found = pieces.pair_sums(x, y)

    def same(a: float, b: float) -> bool:
        return a == b or (math.isnan(a) and math.isnan(b))

    assert found.finite == (pieces.all_finite(x) and pieces.all_finite(y))
    assert same(found.x_max, pieces.max_abs(x)) and same(found.y_max, pieces.max_abs(y))
    assert same(found.difference_max, pieces.max_abs(x, y))
    if found.finite:
        wide, other = x.astype(np.float64), y.astype(np.float64)
        assert within_sum_bound(found.xy, wide * other) and within_sum_bound(found.yy, other * other)
        assert within_sum_bound(found.xx, wide * wide) and within_sum_bound(found.dd, np.square(wide - other))


@pytest.mark.parametrize("where", [0, 4_097, 9_999])
def test_pair_sums_find_a_nan_or_an_infinity_anywhere(where):
    """A nan or an infinity in x or y, at the start, in the four-wide body or in the tail: not
    finite, and each maximum as the element makes it."""
    a, f = arrays(10_000)
    for bad in (np.nan, np.inf):
        x, y = a.copy(), f.copy()
        x[where] = bad
        found = pieces.pair_sums(x, y)
        assert not found.finite
        assert math.isnan(found.x_max) if math.isnan(bad) else found.x_max == math.inf
        assert found.y_max == pieces.max_abs(f)
        y2 = f.copy()
        y2[where] = -bad
        assert not pieces.pair_sums(a, y2).finite
