"""The per-tensor reduction every verdict reads, compiled for the host (numba).

Native A and manual B (float32, float16 or float64) against the float64 sums E and S, reduced to
a few dozen scalars (``Reduction``). The work runs at the speed of reading the four arrays: each
chunk of the tensor is cut into blocks small enough to stay in the L1 cache, and each block is
read by loops that vectorise (no division, no branch per element):

1. whether A and B differ anywhere in the block (in their own dtype);
2. one fused loop: all finite, over-bound counts, the sums (reassociated into SIMD lanes, so their
   last bits depend on the CPU's vector width), whether any element could beat a running maximum
   (a test that may say yes too often, never too rarely), and, only where A and B differ, the
   native-against-manual figures (ulps, relative difference, the classic tolerance counts);
3. only where (2) said so, a scalar rescan that finds the new maxima and where they are.

A block holding a non-finite value is judged by the plain scalar loop. Every maximum is the exact
maximum of its element-wise quotient (``max_i fl(d_i / b_i)``), the first index holding it, so
another implementation (``accumcheck.torch.judging``, on the device where the
gradients live) computes the same figures bit for bit but for the sums' last bits.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import numba
import numpy as np

from .compiled import njit

_CHUNK = 1 << 20  # elements per chunk: each thread takes whole chunks; few chunks, few new maxima
_MAX_CHUNKS = 4096
_BLOCK = 256  # elements per block: four arrays of them stay in L1
# A filter compares d > r * b * SLACK: below r * b by more than the product's rounding, so the
# filter never misses an element whose quotient fl(d / b) exceeds r; thresholds under TINY (where
# rounding is not relative) always pass.
SLACK = 1.0 - 2.0 ** -50
TINY = 1e-290


class Reduction(NamedTuple):
    """One tensor reduced: totals over its finite elements (those where A, B and E are all finite)
    and the maxima with the first flat index holding each (-1 when no element qualifies)."""

    nonfinite_a: int
    nonfinite_b: int
    nonfinite_e: int
    mismatched: int  # A != B (a NaN against a NaN counts as equal)
    classic_mismatched: int  # |A - B| > atol + rtol |B|
    over_a: int  # |A - E| > bound_A
    over_b: int
    max_e: float  # max |E|
    max_err_a: float  # max |A - E|
    max_err_b: float
    ratio_a: float  # max |A - E| / bound_A
    index_a: int
    ratio_b: float
    index_b: int
    max_diff: float  # max |A - B|
    index_diff: int
    max_rel: float  # max |A - B| / |B| (infinite where B = 0)
    max_ulps: float  # max distance in units in the last place of A's dtype
    diff_ratio: float  # max |A - B| / (bound_A + bound_B)
    sum_s: float
    sum_abs_e: float
    sum_sq_e: float
    sum_sq_err_a: float
    sum_sq_err_b: float
    sum_sq_s: float


_NSUMS = 6  # sum_s, sum_abs_e, sum_sq_e, sum_sq_err_a, sum_sq_err_b, sum_sq_s
_NCOUNTS = 7  # nonfinite a, b, e, mismatched, classic, over a, over b
_NMAX = 9  # max_e, max_err_a, max_err_b, ratio_a, ratio_b, max_diff, max_rel, max_ulps, diff_ratio
_ROW = 16  # the per-chunk rows' stride, in 8-byte values


@njit(error_model="numpy")
def _count_differ(a, b):
    """How many elements differ between A and B (in their own dtype)."""
    differ = 0
    for i in range(a.size):
        differ += a[i] != b[i]
    return differ


@njit(fastmath={"reassoc", "contract"}, error_model="numpy")
def _plus_square(total, v):
    # Its own function for its own flags: the multiply-add may fuse here, never in a bound.
    return total + v * v


# The two loops every block goes through, one of them. Their sums are the only reassociated
# arithmetic of the kernel (vectorised into SIMD lanes); every comparison is the exact one. A
# non-finite A, B or E makes a sum of squares of errors non-finite, and the block is judged again
# by the scalar loop (so is a finite square that overflows).

@njit(fastmath={"reassoc"}, error_model="numpy")
def _block_equal(a, e, s, rel_a, abs_a, rel_b, abs_b, peaks):
    """A == B over the block: (bad, over_a, over_b, moves, the six sums)."""
    max_e, least_err, r_a, r_b = peaks[0], min(peaks[1], peaks[2]), peaks[3] * SLACK, peaks[4] * SLACK
    over_a = over_b = moves = 0
    t0 = t1 = t2 = t3 = t5 = 0.0
    for i in range(a.size):
        x = np.float64(a[i])
        ex = e[i]
        sx = s[i]
        da = abs(x - ex)
        bound_a = rel_a * sx + abs_a
        bound_b = rel_b * sx + abs_b
        over_a += da > bound_a
        over_b += da > bound_b
        moves += (abs(ex) > max_e) | (da > least_err) | _may_beat(da, r_a, bound_a) | _may_beat(da, r_b, bound_b)
        t0 += sx
        t1 += abs(ex)
        t2 = _plus_square(t2, ex)
        t3 = _plus_square(t3, da)
        t5 = _plus_square(t5, sx)
    return not (t3 < np.inf), over_a, over_b, moves, t0, t1, t2, t3, t3, t5


@njit(fastmath={"reassoc"}, error_model="numpy")
def _block_differ(a, b, e, s, rel_a, abs_a, rel_b, abs_b, rtol, atol, precision, peaks):
    """A and B may differ in the block: (bad, over_a, over_b, moves, the six sums, classic, differ).
    More than M ulps between x and y of one sign needs |x - y| > M ulp(min(|x|, |y|)) > M min(|x|,
    |y|) / ``precision`` (2^p for a p-bit significand): the ulps' filter, without bit patterns (a
    change of sign, a zero, or a product that underflows is always rescanned)."""
    max_e, least_err, r_a, r_b = peaks[0], min(peaks[1], peaks[2]), peaks[3] * SLACK, peaks[4] * SLACK
    max_diff, max_rel, diff_ratio, max_ulps = peaks[5], peaks[6] * SLACK, peaks[8] * SLACK, peaks[7] * SLACK
    over_a = over_b = moves = classic = differ = 0
    t0 = t1 = t2 = t3 = t4 = t5 = 0.0
    for i in range(a.size):
        x = np.float64(a[i])
        y = np.float64(b[i])
        ex = e[i]
        sx = s[i]
        da = abs(x - ex)
        db = abs(y - ex)
        differ += x != y
        bound_a = rel_a * sx + abs_a
        bound_b = rel_b * sx + abs_b
        over_a += da > bound_a
        over_b += db > bound_b
        d = abs(x - y)
        ay = abs(y)
        classic += d > atol + rtol * ay
        moves += ((abs(ex) > max_e) | (max(da, db) > least_err) | _may_beat(da, r_a, bound_a)
                  | _may_beat(db, r_b, bound_b) | (d > max_diff) | _may_beat(d, max_rel, ay)
                  | _may_beat(d, diff_ratio, bound_a + bound_b) | (d * precision > max_ulps * min(abs(x), ay))
                  | (x * y <= 0.0))
        t0 += sx
        t1 += abs(ex)
        t2 = _plus_square(t2, ex)
        t3 = _plus_square(t3, da)
        t4 = _plus_square(t4, db)
        t5 = _plus_square(t5, sx)
    return not (t3 + t4 < np.inf), over_a, over_b, moves, t0, t1, t2, t3, t4, t5, classic, differ


@njit(inline="always", error_model="numpy")
def _ulps(oa, ob, sign_flip):
    """Distance of two bit patterns on the monotonic integer line of their floats."""
    if oa < 0:
        oa = sign_flip - oa
    if ob < 0:
        ob = sign_flip - ob
    if (oa >= 0) == (ob >= 0):
        return np.float64(abs(oa - ob))  # exact below 2^53 ulps
    return abs(np.float64(oa) - np.float64(ob))  # opposite signs: huge, cannot overflow


@njit(inline="always", error_model="numpy")
def _quotient(d, b):
    """d / b for d > 0 (infinite where b = 0); 0 for d = 0, so that 0 / 0 never counts."""
    return d / b if d > 0.0 else 0.0


@njit(inline="always", error_model="numpy")
def _may_beat(d, r_slack, b):
    """Whether fl(d / b) may exceed r, without a division: ``r_slack`` is r * SLACK. Never False
    when it does (a threshold in the subnormal range, where rounding is not relative, lets any
    d > 0 through; r = inf against b = 0 gives NaN, which nothing beats); True now and then when it
    does not, which costs a rescan, not a figure."""
    t = r_slack * b
    return d > (0.0 if t < TINY else t)


@njit(error_model="numpy")
def _scalar(a, b, a_bits, b_bits, sign_flip, e, s, lo, hi, rel_a, abs_a, rel_b, abs_b, rtol, atol,
            counts, peaks, where, sums, with_sums):
    """The plain loop over [lo, hi): every figure, element by element (maxima always; the sums
    when ``with_sums``; the counts of a finite block are taken by the caller)."""
    for i in range(lo, hi):
        x = np.float64(a[i])
        y = np.float64(b[i])
        ex = e[i]
        if not (np.isfinite(x) and np.isfinite(y) and np.isfinite(ex)):
            counts[0] += not np.isfinite(x)
            counts[1] += not np.isfinite(y)
            counts[2] += not np.isfinite(ex)
            counts[3] += not (x == y or (np.isnan(x) and np.isnan(y)))
            continue
        sx = s[i]
        da = abs(x - ex)
        db = abs(y - ex)
        bound_a = rel_a * sx + abs_a
        bound_b = rel_b * sx + abs_b
        if with_sums:
            sums[0] += sx
            sums[1] += abs(ex)
            sums[2] += ex * ex
            sums[3] += da * da
            sums[4] += db * db
            sums[5] += sx * sx
            counts[5] += da > bound_a
            counts[6] += db > bound_b
        if abs(ex) > peaks[0]:
            peaks[0] = abs(ex)
        if da > peaks[1]:
            peaks[1] = da
        if db > peaks[2]:
            peaks[2] = db
        q = _quotient(da, bound_a)
        if q > peaks[3]:
            peaks[3] = q
            where[1] = i
        q = _quotient(db, bound_b)
        if q > peaks[4]:
            peaks[4] = q
            where[2] = i
        if x == y:
            continue
        d = abs(x - y)
        ay = abs(y)
        if with_sums:
            counts[3] += 1
            counts[4] += d > atol + rtol * ay
        u = _ulps(np.int64(a_bits[i]), np.int64(b_bits[i]), sign_flip)
        if u > peaks[7]:
            peaks[7] = u
        if d > peaks[5]:
            peaks[5] = d
            where[0] = i
        q = _quotient(d, ay)
        if q > peaks[6]:
            peaks[6] = q
        q = _quotient(d, bound_a + bound_b)
        if q > peaks[8]:
            peaks[8] = q


def _reduce(a, b, a_bits, b_bits, sign_flip, precision, e, s, rel_a, abs_a, rel_b, abs_b, rtol, atol, chunks):
    n = a.size
    step = (n + chunks - 1) // chunks
    # One row per chunk, 128 bytes apart: two threads never write into one cache line.
    all_counts = np.zeros((chunks, _ROW), np.int64)[:, :_NCOUNTS]
    all_peaks = np.zeros((chunks, _ROW))[:, :_NMAX]
    all_where = np.full((chunks, _ROW), -1, np.int64)[:, :3]  # where max_diff, ratio_a, ratio_b are
    all_sums = np.zeros((chunks, _ROW))[:, :_NSUMS]
    for c in numba.prange(chunks):
        counts = all_counts[c]
        peaks = all_peaks[c]
        where = all_where[c]
        sums = all_sums[c]
        differed = False
        for lo in range(c * step, min(n, (c + 1) * step), _BLOCK):
            hi = min(n, c * step + step, lo + _BLOCK)
            # After a block where A and B differed, expect the next to differ too: skip the count.
            # The block's own views: indices from 0 load as vectors (an index that might be
            # negative makes numba wrap it, and the loads become gathers).
            a_, b_, e_, s_ = a[lo:hi], b[lo:hi], e[lo:hi], s[lo:hi]
            differ = 1 if differed else _count_differ(a_, b_)
            if differ:
                bad, over_a, over_b, moves, t0, t1, t2, t3, t4, t5, classic, differ = _block_differ(
                    a_, b_, e_, s_, rel_a, abs_a, rel_b, abs_b, rtol, atol, precision, peaks)
            else:
                bad, over_a, over_b, moves, t0, t1, t2, t3, t4, t5 = _block_equal(
                    a_, e_, s_, rel_a, abs_a, rel_b, abs_b, peaks)
                classic = 0
            differed = differ > 0
            if bad:
                _scalar(a, b, a_bits, b_bits, sign_flip, e, s, lo, hi, rel_a, abs_a, rel_b, abs_b, rtol, atol,
                        counts, peaks, where, sums, True)
                continue
            counts[3] += differ
            counts[4] += classic
            counts[5] += over_a
            counts[6] += over_b
            sums[0] += t0
            sums[1] += t1
            sums[2] += t2
            sums[3] += t3
            sums[4] += t4
            sums[5] += t5
            if moves:  # a maximum may have moved: find it, in order
                _scalar(a, b, a_bits, b_bits, sign_flip, e, s, lo, hi, rel_a, abs_a, rel_b, abs_b, rtol, atol,
                        counts, peaks, where, sums, False)
    return all_counts, all_peaks, all_where, all_sums


def _renamed(fn, name: str):
    """``fn`` under another name. numba names a function's cache files after its qualified name
    and keys them by signature alone, not by options (numba/numba#6845): the same function compiled
    serial and parallel would share one cache entry, and whichever compiled first would serve both."""
    clone = types.FunctionType(fn.__code__, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    clone.__qualname__ = name
    return clone


# Compiled twice: across threads, and in this thread for a tensor of one chunk (where waking the
# thread pool costs more than the work). Both run the same chunks in the same order, so they give
# the same figures bit for bit.
_reduce_serial = njit(error_model="numpy")(_renamed(_reduce, "_reduce_serial"))
_reduce = njit(parallel=True, error_model="numpy")(_reduce)

# Per dtype of A and B: the integers of their width, the sign bit as such an integer, and 2 ** (the
# significand's bits), the scale of a units-in-the-last-place distance.
_KINDS = {np.dtype(t): (bits, np.int64(np.iinfo(bits).min), 2.0 ** (np.finfo(t).nmant + 1))
          for t, bits in ((np.float32, np.int32), (np.float64, np.int64))}


def reduce_on_host(a: np.ndarray, b: np.ndarray, e: np.ndarray, s: np.ndarray, rel_a: float, abs_a: float,
                   rel_b: float, abs_b: float, rtol: float, atol: float) -> Reduction:
    """The reduction of flat arrays of one length: A and B of one dtype, float32 or float64 (the
    narrower ones are exact in float32), E and S float64; bound_X = rel_X * S + abs_X."""
    bits, sign_flip, precision = _KINDS[a.dtype]
    chunks = min(_MAX_CHUNKS, max(1, -(-a.size // _CHUNK)))
    counts, peaks, where, sums = (_reduce if chunks > 1 else _reduce_serial)(
        a, b, a.view(bits), b.view(bits), sign_flip, precision, e, s, rel_a, abs_a, rel_b, abs_b, rtol, atol, chunks)
    return combine(counts, peaks, where, sums)


def combine(counts: np.ndarray, peaks: np.ndarray, where: np.ndarray, sums: np.ndarray) -> Reduction:
    """One Reduction from per-chunk rows (chunks in order): counts and sums add up, each maximum is
    the largest of the chunks' and its index the first chunk's that holds it."""
    if len(counts) == 1:  # one chunk: its row
        total, top, added, first = counts[0].tolist(), peaks[0].tolist(), sums[0].tolist(), where[0].tolist()

        def at(column: int, which: int) -> int:
            return first[which] if top[column] > 0 else -1
    else:
        total, top, added = counts.sum(axis=0).tolist(), peaks.max(axis=0).tolist(), sums.sum(axis=0).tolist()

        def at(column: int, which: int) -> int:
            return int(where[int(np.argmax(peaks[:, column])), which]) if top[column] > 0 else -1

    # In Reduction's order: the seven counts, then the maxima (with where three of them are), the sums.
    return Reduction(*total, top[0], top[1], top[2], top[3], at(3, 1), top[4], at(4, 2), top[5], at(5, 0),
                     top[6], top[7], top[8], *added)


@njit(inline="always", error_model="numpy")
def _map_ratio(d, b):
    """|x - E| / bound as ``ratio.ratios_to`` has it: 0 for 0 / 0, infinite for a NaN distance."""
    if d != d:
        return np.inf
    q = d / b
    return 0.0 if q != q else q


@njit(error_model="numpy")
def _cell_maxima(a, b, e, s, cols, step_r, step_c, rel_a, abs_a, rel_b, abs_b, cells):
    rows = a.size // cols
    for r in range(rows):
        row = cells[r // step_r]
        # Cell by cell along the row: no division per element, and an inner loop that vectorises.
        for cell in range(row.size):
            start = r * cols + cell * step_c
            stop = r * cols + min(cols, (cell + 1) * step_c)
            top = row[cell]
            for i in range(start, stop):
                ex = e[i]
                sx = s[i]
                top = max(top, _map_ratio(abs(np.float64(a[i]) - ex), rel_a * sx + abs_a),
                          _map_ratio(abs(np.float64(b[i]) - ex), rel_b * sx + abs_b))
            row[cell] = top


def cell_maxima(a: np.ndarray, b: np.ndarray, e: np.ndarray, s: np.ndarray, cols: int, step_r: int, step_c: int,
                rel_a: float, abs_a: float, rel_b: float, abs_b: float, shape: tuple[int, int]) -> np.ndarray:
    """The largest of both modes' ratios in each cell of ``shape``: the flat arrays read as rows
    of ``cols`` elements, a cell ``step_r`` rows by ``step_c`` columns."""
    cells = np.zeros(shape)
    _cell_maxima(a, b, e, s, cols, step_r, step_c, rel_a, abs_a, rel_b, abs_b, cells)
    return cells
