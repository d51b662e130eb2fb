"""The host kernel against the reduction's definitions (tests/kernel_reference.py), on arrays built to
hit what its fast loops skip: equal and differing blocks, block and chunk edges, ties, zeros,
subnormals, signs, non-finite values, bounds of zero."""

import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_reference import BOUNDS, assert_same, reference, tensors

from accumcheck.judge import kernel
from accumcheck.judge.kernel import reduce_on_host


@settings(max_examples=300, deadline=None)
@given(tensors(), BOUNDS, st.sampled_from([(1.3e-6, 1e-5), (0.0, 0.0), (1e-3, 1e-8)]))
def test_the_kernel_computes_the_definitions(arrays, bounds, tolerances):
    a, b, e, s = arrays
    rel_a, abs_a, rel_b, abs_b = bounds
    args = (a, b, e, s, rel_a, abs_a, rel_b, abs_b, *tolerances)
    assert_same(reduce_on_host(*args), reference(*args))


def test_over_many_chunks_the_first_index_of_a_maximum_wins(monkeypatch):
    monkeypatch.setattr(kernel, "_CHUNK", 512)  # several chunks in a small tensor, one thread each
    n = 5000
    e = np.linspace(1.0, 2.0, n)
    a = e.astype(np.float32)
    b = a.copy()
    b[[1000, 3000, 4500]] = b[[1000, 3000, 4500]] * np.float32(1.5)  # the same relative change thrice
    s = np.full(n, 3.0)
    args = (a, b, e, s, 1e-7, 0.0, 1e-7, 0.0, 1.3e-6, 1e-5)
    got = reduce_on_host(*args)
    assert_same(got, reference(*args))
    assert got.mismatched == 3 and got.index_b == 3000 or got.index_b == 4500  # the largest E wins
    same = np.full(n, 2.0)
    tie = (same.astype(np.float32), (same * 1.25).astype(np.float32), same, np.full(n, 4.0))
    tied = reduce_on_host(*tie, 0.1, 0.0, 0.1, 0.0, 0.0, 0.0)
    assert (tied.index_b, tied.index_diff, tied.ratio_b, tied.max_ulps) == (0, 0, 1.25, 2.0 ** 21)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_block_of_special_values_is_judged_element_by_element(dtype):
    a = np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -0.0] * 100, dtype)
    b = np.array([1.0, np.nan, -np.inf, -np.inf, -0.0, 5.0] * 100, dtype)
    e = np.array([1.0, 1.0, 1.0, np.nan, 0.0, 0.0] * 100)
    s = np.ones(600)
    args = (a, b, e, s, 1e-7, 0.0, 1e-7, 0.0, 1.3e-6, 1e-5)
    got = reduce_on_host(*args)
    assert_same(got, reference(*args))
    assert (got.nonfinite_a, got.nonfinite_b, got.nonfinite_e, got.mismatched) == (300, 300, 100, 200)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_maximum_beaten_by_one_ulp_in_a_later_block_is_found(dtype):
    # Each quotient's running maximum is set in the first block and beaten by the least step in the
    # fourth, by an element whose numerator beats no maximum: only its own filter can let it through.
    n = 1200
    e, s = np.zeros(n), np.ones(n)
    a = np.zeros(n, dtype)
    above = np.nextafter(dtype(1.0), dtype(2.0))
    a[0] = 1.0  # |X - E| / S = 1
    a[900], s[900] = 0.5 * above, 0.5  # half as far from E, against half the bound: above 1
    got = reduce_on_host(a, a.copy(), e, s, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0)
    assert (got.ratio_a, got.index_a, got.ratio_b, got.index_b) == (float(above), 900, 2 * float(above), 900)
    assert_same(got, reference(a, a.copy(), e, s, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0))
    # |A - B| / |B|, |A - B| / (bound_A + bound_B) and ulps: 1 against 2 first; then 0.5 against the
    # float after 1 (nearer, but relatively further, and one ulp more), against a smaller bound.
    x, y, s = np.full(n, 1.0, dtype), np.full(n, 1.0, dtype), np.ones(n)
    y[10] = 2.0
    x[1000], y[1000], s[1000] = 0.5, above, 0.5
    got = reduce_on_host(x, y, np.ones(n), s, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0)
    assert got.max_rel == (float(above) - 0.5) / float(above) > 0.5 and got.diff_ratio > 0.5
    assert (got.max_ulps, got.max_diff, got.index_diff) == (2.0 ** np.finfo(dtype).nmant + 1, 1.0, 10)
    assert_same(got, reference(x, y, np.ones(n), s, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0))


FLOATS = st.floats(min_value=0.0, allow_nan=False, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=2000, deadline=None)
@given(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False, allow_subnormal=True), FLOATS, FLOATS)
@example(d=4 * 5e-324, r=1.2, b=3 * 5e-324)  # r * b rounds up to d in the subnormal range
def test_the_quotient_filter_never_misses_a_larger_quotient(d, r, b):
    # (an infinite d never reaches the filter: its block is judged by the scalar loop)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        quotient = np.float64(d) / np.float64(b) if d > 0 else 0.0
    if quotient > r:
        assert kernel._may_beat(d, r * kernel.SLACK, b)


@settings(max_examples=2000, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False), st.floats(width=32, allow_nan=False,
       allow_infinity=False), st.integers(0, 2**32))
def test_the_ulps_filter_never_misses_a_larger_distance(x, y, most):
    x, y = np.float32(x), np.float32(y)
    if x == y:
        return
    bits = np.array([x, y], np.float32).view(np.int32)
    ulps = kernel._ulps(np.int64(bits[0]), np.int64(bits[1]), np.int64(np.iinfo(np.int32).min))
    if ulps > most:
        x, y = np.float64(x), np.float64(y)
        assert abs(x - y) * 2.0 ** 24 > most * kernel.SLACK * min(abs(x), abs(y)) or (x < 0) != (y < 0)


def test_a_change_of_sign_in_a_later_block_is_counted_in_ulps():
    # Block 0 sets every maximum high; block 3 beats only the ulps, by crossing zero (1 against -1):
    # nearly as many ulps as float32 has, from a difference of 2.
    n = 1000
    x, y, e, s = np.full(n, 0.5, np.float32), np.full(n, 0.5, np.float32), np.full(n, 0.5), np.ones(n)
    x[0], y[0], e[0] = 1e6, 1e-6, 1.1e6
    x[800], y[800], e[800] = 1.0, -1.0, 1.0
    args = (x, y, e, s, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0)
    got = reduce_on_host(*args)
    assert got.max_ulps == 2 * float(np.float32(1.0).view(np.int32))
    assert_same(got, reference(*args))


@pytest.mark.slow  # compiles every kernel afresh (about 10 s)
def test_the_parallel_reduction_runs_in_parallel_after_the_serial_one_was_cached(tmp_path):
    # numba keys cache files by function name and signature, not by options: a serial compile
    # cached first would otherwise serve the parallel kernel too (and judging runs on one core).
    import subprocess
    import sys

    script = """
import numba, numpy as np
from accumcheck.judge import kernel
small = np.ones(100, np.float32)
kernel.reduce_on_host(small, small, small.astype(np.float64), small.astype(np.float64), 1e-7, 0, 1e-7, 0, 1e-5, 1e-8)
large = np.ones(2 * kernel._CHUNK + 1, np.float32)
kernel.reduce_on_host(large, large, large.astype(np.float64), large.astype(np.float64), 1e-7, 0, 1e-7, 0, 1e-5, 1e-8)
print(numba.threading_layer())  # raises where no parallel region has run
"""
    # A fresh cache: the serial kernel compiles and is cached before the parallel one looks there.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert any(tmp_path.rglob("*_reduce_serial*.nbi"))
