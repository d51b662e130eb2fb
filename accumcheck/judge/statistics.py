"""Per-tensor statistics: native (A) against manual (B), both against E and S.

One fused pass over each tensor computes every statistic (compiled with numba, parallel over
chunks), so judging a 20M-element tensor costs about as much as reading it once. Values are
promoted to float64 element by element; nothing here imports a deep-learning framework. The
verdict is made from these figures once, in ``accumcheck.judge.verdicts``.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from ..bounds import CLASSIC_TOLERANCES, UNIT_ROUNDOFF, ModeBound
from .ratio import bound_ratios, unravel

_CHUNK = 1 << 16
_MAX_CHUNKS = 4096

# Columns of the kernel's per-chunk output.
(_MAX_E, _NONFIN_A, _NONFIN_B, _NONFIN_E, _NDIFF, _MAX_DIFF, _MAX_REL, _NCLASSIC, _MAX_ULPS,
 _RATIO_A, _RATIO_B, _OVER_A, _OVER_B, _SUM_S, _SUM_ABS_E, _SQ_ERR_A, _SQ_ERR_B, _MAX_ERR_A,
 _MAX_ERR_B, _SQ_E, _DIFF_RATIO, _NSTATS) = range(22)


_BLOCK = 256  # elements checked for native == manual at once; equal blocks skip the A-B statistics


@numba.njit(parallel=True, cache=True, nogil=True)
def _chunk_stats(a, b, a_bits, b_bits, sign_flip, e, s, rel_a, abs_a, rel_b, abs_b, rtol, atol, chunks):
    n = a.size
    step = (n + chunks - 1) // chunks
    out = np.zeros((chunks, _NSTATS))
    where = np.full((chunks, 3), -1, np.int64)  # argmax of max_diff, ratio_a, ratio_b
    for c in numba.prange(chunks):
        lo = c * step
        hi = min(n, lo + step)
        max_e = 0.0
        nonfin_a = 0.0
        nonfin_b = 0.0
        nonfin_e = 0.0
        ndiff = 0.0
        max_diff = 0.0
        max_rel = 0.0
        nclassic = 0.0
        max_ulps = 0.0
        ratio_a = 0.0
        ratio_b = 0.0
        over_a = 0.0
        over_b = 0.0
        sum_s = 0.0
        sum_abs_e = 0.0
        sq_err_a = 0.0
        sq_err_b = 0.0
        max_err_a = 0.0
        max_err_b = 0.0
        sq_e = 0.0
        diff_ratio = 0.0
        i_diff = -1
        i_a = -1
        i_b = -1
        for block in range(lo, hi, _BLOCK):
            end = min(hi, block + _BLOCK)
            equal = True
            for i in range(block, end):
                equal &= a[i] == b[i]
            for i in range(block, end):
                x = np.float64(a[i])
                y = np.float64(b[i])
                ex = e[i]
                if not (np.isfinite(x) and np.isfinite(y) and np.isfinite(ex)):
                    nonfin_a += not np.isfinite(x)
                    nonfin_b += not np.isfinite(y)
                    nonfin_e += not np.isfinite(ex)
                    ndiff += not (x == y or (np.isnan(x) and np.isnan(y)))
                    continue
                sx = s[i]
                abs_e = abs(ex)
                max_e = abs_e if abs_e > max_e else max_e
                sum_s += sx
                sum_abs_e += abs_e
                sq_e += ex * ex
                # Each mode against E, and against its bound (divide only for a new maximum).
                da = abs(x - ex)
                db = abs(y - ex)
                sq_err_a += da * da
                sq_err_b += db * db
                max_err_a = da if da > max_err_a else max_err_a
                max_err_b = db if db > max_err_b else max_err_b
                bound_a = rel_a * sx + abs_a
                bound_b = rel_b * sx + abs_b
                over_a += da > bound_a
                over_b += db > bound_b
                if da > ratio_a * bound_a:
                    ratio_a = da / bound_a
                    i_a = i
                if db > ratio_b * bound_b:
                    ratio_b = db / bound_b
                    i_b = i
                if equal:
                    continue
                # Native against manual, as torch.testing would see it.
                d = abs(x - y)
                ndiff += x != y
                if d > diff_ratio * (bound_a + bound_b):
                    diff_ratio = d / (bound_a + bound_b)
                if d > max_diff:
                    max_diff = d
                    i_diff = i
                ay = abs(y)
                if d > max_rel * ay:
                    max_rel = d / ay if ay > 0.0 else np.inf
                nclassic += d > atol + rtol * ay
                # Distance in ulps: map the bit patterns onto a monotonic integer line.
                oa = np.int64(a_bits[i])
                ob = np.int64(b_bits[i])
                if oa < 0:
                    oa = sign_flip - oa
                if ob < 0:
                    ob = sign_flip - ob
                if (oa >= 0) == (ob >= 0):
                    ulps = np.float64(abs(oa - ob))  # exact below 2^53 ulps
                else:
                    ulps = abs(np.float64(oa) - np.float64(ob))  # opposite signs: huge, cannot overflow
                max_ulps = ulps if ulps > max_ulps else max_ulps
        row = out[c]
        row[_MAX_E] = max_e
        row[_NONFIN_A] = nonfin_a
        row[_NONFIN_B] = nonfin_b
        row[_NONFIN_E] = nonfin_e
        row[_NDIFF] = ndiff
        row[_MAX_DIFF] = max_diff
        row[_MAX_REL] = max_rel
        row[_NCLASSIC] = nclassic
        row[_MAX_ULPS] = max_ulps
        row[_RATIO_A] = ratio_a
        row[_RATIO_B] = ratio_b
        row[_OVER_A] = over_a
        row[_OVER_B] = over_b
        row[_SUM_S] = sum_s
        row[_SUM_ABS_E] = sum_abs_e
        row[_SQ_ERR_A] = sq_err_a
        row[_SQ_ERR_B] = sq_err_b
        row[_MAX_ERR_A] = max_err_a
        row[_MAX_ERR_B] = max_err_b
        row[_SQ_E] = sq_e
        row[_DIFF_RATIO] = diff_ratio
        where[c, 0] = i_diff
        where[c, 1] = i_a
        where[c, 2] = i_b
    return out, where


_BITS = {np.dtype(np.float32): np.int32, np.dtype(np.float64): np.int64, np.dtype(np.float16): np.int16}


def _as_float(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    if array.dtype not in _BITS:
        array = array.astype(np.float32)  # bfloat16 and friends are exact in float32
    return array.reshape(-1)


def tensor_figures(
    name: str,
    kind: str,
    native: np.ndarray,
    manual: np.ndarray,
    exact: np.ndarray,
    absum: np.ndarray,
    native_bound: ModeBound,
    manual_bound: ModeBound,
    oracle: np.ndarray | None = None,
    reference_bound: ModeBound | None = None,
    ulps: bool = False,
) -> dict[str, Any]:
    """Every figure of one parameter tensor (TensorResult's fields but the verdict), plus
    ``nonfinite``, the count of non-finite elements. ``exact`` (E) and ``absum`` (S) are float64
    sums of the micro-gradients; the bounds say how far from E each mode may be by round-off
    alone. ``reference_bound`` (for native parameters of a lower precision than the accumulation
    dtype) is the bound of the accumulation dtype: native's worst ratio to it becomes
    ``precision_ratio``, and both modes' errors are reported in float32 ulps (``ulps`` asks for
    those alone)."""
    shape = tuple(np.shape(exact))
    a, b = _as_float(native), _as_float(manual)
    if a.dtype != b.dtype:
        wider = np.promote_types(a.dtype, b.dtype)
        a, b = a.astype(wider), b.astype(wider)
    e = np.ascontiguousarray(exact, np.float64).reshape(-1)
    s = np.ascontiguousarray(absum, np.float64).reshape(-1)
    if not a.size == b.size == e.size == s.size:
        raise ValueError(f"{name}: native, manual, exact and absum differ in size "
                         f"({a.size}, {b.size}, {e.size}, {s.size})")
    dtype = str(a.dtype)
    rtol, atol = CLASSIC_TOLERANCES.get(native_bound.dtype, CLASSIC_TOLERANCES[dtype])
    chunks = int(min(_MAX_CHUNKS, max(1, -(-a.size // _CHUNK))))
    bits = _BITS[a.dtype]
    # The root-mean-square of S: the scale of a kernel allowance, and of the predicted round-off spread.
    s_rms = float(np.sqrt(np.dot(s, s) / s.size)) if s.size else 0.0
    allowance_rms = s_rms if native_bound.tensor or manual_bound.tensor else 0.0
    out, where = _chunk_stats(a, b, a.view(bits), b.view(bits), np.int64(np.iinfo(bits).min), e, s,
                              native_bound.relative, native_bound.floor(allowance_rms), manual_bound.relative,
                              manual_bound.floor(allowance_rms), rtol, atol, chunks)
    total, peak = out.sum(axis=0), out.max(axis=0)  # one row per chunk, and at least one chunk

    def arg(column: int, which: int) -> int:
        return int(where[int(np.argmax(out[:, column])), which])

    ratio_a, ratio_b = float(peak[_RATIO_A]), float(peak[_RATIO_B])
    worst_mode = "native" if ratio_a >= ratio_b else "manual"
    worst_flat = arg(_RATIO_A, 1) if worst_mode == "native" else arg(_RATIO_B, 2)
    worst_bound = native_bound if worst_mode == "native" else manual_bound
    bound_at_worst = worst_bound.at(float(s[worst_flat]) if worst_flat >= 0 else 0.0, allowance_rms)
    nonfinite = int(total[_NONFIN_A] + total[_NONFIN_B] + total[_NONFIN_E])
    sum_abs_e = float(total[_SUM_ABS_E])
    condition = float(total[_SUM_S]) / sum_abs_e if sum_abs_e > 0 else (math.inf if total[_SUM_S] > 0 else 1.0)
    norm_e = math.sqrt(total[_SQ_E])
    err2_a, err2_b = math.sqrt(total[_SQ_ERR_A]), math.sqrt(total[_SQ_ERR_B])

    def relative(err: float) -> float:
        return err / norm_e if norm_e > 0 else (0.0 if err == 0 else math.inf)

    figures: dict[str, Any] = dict(
        name=name, kind=kind, shape=list(shape), dtype=dtype, numel=int(a.size), nonfinite=nonfinite,
        max_abs_grad=float(peak[_MAX_E]), mismatched=int(total[_NDIFF]), max_abs_diff=float(peak[_MAX_DIFF]),
        max_abs_diff_index=unravel(arg(_MAX_DIFF, 0), shape), max_rel_diff=float(peak[_MAX_REL]),
        max_ulps=float(peak[_MAX_ULPS]), classic_mismatched=int(total[_NCLASSIC]), classic_rtol=rtol,
        classic_atol=atol, ratio=max(ratio_a, ratio_b), worst_mode=worst_mode,
        worst_index=unravel(worst_flat, shape), bound_at_worst=bound_at_worst, ratio_native=ratio_a,
        ratio_manual=ratio_b, over_bound_native=int(total[_OVER_A]), over_bound_manual=int(total[_OVER_B]),
        err_native=float(peak[_MAX_ERR_A]), err_manual=float(peak[_MAX_ERR_B]),
        rel_err_native=relative(err2_a), rel_err_manual=relative(err2_b), condition=condition,
        nearer="tie" if err2_a == err2_b else ("native" if err2_a < err2_b else "manual"),
        nonfinite_native=int(total[_NONFIN_A]), nonfinite_manual=int(total[_NONFIN_B]),
        grad_sum_sq=float(total[_SQ_E]), diff_ratio=float(peak[_DIFF_RATIO]),
        # The statistical tier's spreads (root-mean-square over the tensor): predicted by the
        # probabilistic model, u sqrt(N - 1) S, and each mode's measured error against E.
        spread_predicted=UNIT_ROUNDOFF[manual_bound.dtype] * math.sqrt(max(manual_bound.roundings, 1)) * s_rms,
        spread_native=err2_a / math.sqrt(a.size) if a.size else 0.0,
        spread_manual=err2_b / math.sqrt(a.size) if a.size else 0.0,
    )
    if (reference_bound is not None or ulps) and not nonfinite:
        precision_ratio, figures["err_ulps_native"], figures["err_ulps_manual"] = _precision(
            a, b, e, s, reference_bound or native_bound, allowance_rms)
        if reference_bound is not None:
            figures["precision_ratio"] = precision_ratio
    if oracle is not None:
        o = np.asarray(oracle, np.float64).reshape(-1)
        figures["oracle_err_native"] = float(np.max(np.abs(a - o), initial=0.0))
        figures["oracle_err_manual"] = float(np.max(np.abs(b - o), initial=0.0))
        figures["oracle_err_exact"] = float(np.max(np.abs(e - o), initial=0.0))
    return figures


def _precision(a: np.ndarray, b: np.ndarray, e: np.ndarray, s: np.ndarray, bound: ModeBound,
               s_rms: float) -> tuple[float, float, float]:
    """Native's worst error over ``bound`` (the accumulation dtype's), and each mode's worst error
    against E in float32 ulps of E (of the mean term S/N where E cancels below it)."""
    # An ulp of E's float32 value; where the sum cancels below its mean term S/N, of S/N.
    floor = s / max(bound.roundings + 1, 1)
    ulp = np.spacing(np.maximum(np.abs(e), floor).astype(np.float32)).astype(np.float64)
    err_a, err_b = np.abs(a - e), np.abs(b - e)
    return (float(bound_ratios(a, e, s, bound, s_rms).max(initial=0.0)), float((err_a / ulp).max(initial=0.0)),
            float((err_b / ulp).max(initial=0.0)))
