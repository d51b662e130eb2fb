"""The compiled host-side sums (accumcheck.judge.hostsums): ``add_squares``, which adds a gradient
into a float64 sum and returns the float64 sum of its squares in one pass, adds exactly what numpy's
float64 addition adds, element by element, and its sum of squares is that of exact arithmetic to
float64 round-off, at every length (the four running sums and the tail after them)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from accumcheck.judge.hostsums import add_squares

# finite, and small enough that no square overflows float64
FLOATS = {np.float32: st.floats(-2.0 ** 100, 2.0 ** 100, width=32), np.float64: st.floats(-2.0 ** 400, 2.0 ** 400)}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([np.float32, np.float64]).flatmap(
    lambda dtype: st.tuples(hnp.arrays(dtype, st.integers(0, 37), elements=FLOATS[dtype]),
                            hnp.arrays(np.float64, 1, elements=st.floats(-2.0 ** 100, 2.0 ** 100)))))
def test_add_squares_adds_as_numpy_does_and_sums_the_squares_to_round_off(case):
    grad, start = case
    total = np.full(grad.size, start[0])
    expected_total = total + grad.astype(np.float64)
    squares = add_squares(grad, total)
    np.testing.assert_array_equal(total, expected_total)
    wide = grad.astype(np.float64)
    exact = math.fsum(float(x) * float(x) for x in wide)
    # n additions in float64: at most n units of round-off of the sum (all terms are non-negative)
    assert abs(squares - exact) <= (grad.size + 1) * 2.0 ** -53 * exact


def test_add_squares_reads_every_element_of_a_long_gradient():
    grad = np.arange(1, 1003, dtype=np.float32)  # not a multiple of four: the tail counts
    total = np.zeros(grad.size)
    assert add_squares(grad, total) == float(np.sum(grad.astype(np.float64) ** 2))
    np.testing.assert_array_equal(total, grad.astype(np.float64))
