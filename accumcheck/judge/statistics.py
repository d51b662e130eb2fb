"""Per-tensor statistics: native (A) against manual (B), both against E and S.

One reduction over each tensor computes what every statistic needs (``kernel``: compiled with
numba, at the speed of reading the four arrays once), or a backend's reduction on the device where
the arrays live. Values are promoted to float64 element by element; nothing here imports a
deep-learning framework. The
verdict is made from these figures once, in ``accumcheck.judge.verdicts``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

from ..bounds import CLASSIC_TOLERANCES, UNIT_ROUNDOFF, ModeBound
from .kernel import Reduction, reduce_on_host
from .ratio import bound_ratios, unravel

# A reduction where the arrays live: (rel_A, abs_A, rel_B, abs_B, rtol, atol) -> the Reduction and
# a function giving S at a flat index.
Reducer = Callable[[float, float, float, float, float, float], tuple[Reduction, Callable[[int], float]]]

_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _as_float(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    if array.dtype not in _KERNEL_DTYPES:
        array = array.astype(np.float32)  # float16, bfloat16 and friends are exact in float32
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
    reducer: Reducer | None = None,
) -> dict[str, Any]:
    """Every figure of one parameter tensor (TensorResult's fields but the verdict), plus
    ``nonfinite``, the count of non-finite elements. ``exact`` (E) and ``absum`` (S) are float64
    sums of the micro-gradients; the bounds say how far from E each mode may be by round-off
    alone. ``reference_bound`` (for native parameters of a lower precision than the accumulation
    dtype) is the bound of the accumulation dtype: native's worst ratio to it becomes
    ``precision_ratio``, and both modes' errors are reported in float32 ulps (``ulps`` asks for
    those alone). ``reducer``, when given, reduces the four arrays where they live (a backend's
    device, ``kernel.Reduction``'s figures) instead of the host kernel; the arrays themselves are
    then read only for the figures it does not give (float32 ulps, the oracle)."""
    shape = tuple(exact.shape)
    numel = math.prod(shape)
    dtype = _judged_name(native.dtype, manual.dtype)
    rtol, atol = CLASSIC_TOLERANCES.get(native_bound.dtype, CLASSIC_TOLERANCES[dtype])
    # The root-mean-square of S scales a kernel allowance (a bound's floor), so it is needed first.
    allowance_rms = _rms(absum) if native_bound.tensor or manual_bound.tensor else 0.0
    rel_a, abs_a = native_bound.relative, native_bound.floor(allowance_rms)
    rel_b, abs_b = manual_bound.relative, manual_bound.floor(allowance_rms)
    if reducer is not None:
        r, s_at = reducer(rel_a, abs_a, rel_b, abs_b, rtol, atol)
    else:
        a, b = _as_float(native), _as_float(manual)
        if a.dtype != b.dtype:
            a, b = a.astype(dtype), b.astype(dtype)
        e = np.ascontiguousarray(exact, np.float64).reshape(-1)
        s = np.ascontiguousarray(absum, np.float64).reshape(-1)
        if not a.size == b.size == e.size == s.size:
            raise ValueError(f"{name}: native, manual, exact and absum differ in size "
                             f"({a.size}, {b.size}, {e.size}, {s.size})")
        r = reduce_on_host(a, b, e, s, rel_a, abs_a, rel_b, abs_b, rtol, atol)
        s_at = lambda flat: float(s[flat])  # noqa: E731
    s_rms = math.sqrt(r.sum_sq_s / numel) if numel else 0.0
    worst_mode = "native" if r.ratio_a >= r.ratio_b else "manual"
    worst_flat = r.index_a if worst_mode == "native" else r.index_b
    worst_bound = native_bound if worst_mode == "native" else manual_bound
    bound_at_worst = worst_bound.at(s_at(worst_flat) if worst_flat >= 0 else 0.0, allowance_rms)
    nonfinite = r.nonfinite_a + r.nonfinite_b + r.nonfinite_e
    condition = r.sum_s / r.sum_abs_e if r.sum_abs_e > 0 else (math.inf if r.sum_s > 0 else 1.0)
    norm_e = math.sqrt(r.sum_sq_e)
    err2_a, err2_b = math.sqrt(r.sum_sq_err_a), math.sqrt(r.sum_sq_err_b)

    def relative(err: float) -> float:
        return err / norm_e if norm_e > 0 else (0.0 if err == 0 else math.inf)

    figures: dict[str, Any] = dict(
        name=name, kind=kind, shape=list(shape), dtype=dtype, numel=numel, nonfinite=nonfinite,
        max_abs_grad=r.max_e, mismatched=r.mismatched, max_abs_diff=r.max_diff,
        max_abs_diff_index=unravel(r.index_diff, shape), max_rel_diff=r.max_rel,
        max_ulps=r.max_ulps, classic_mismatched=r.classic_mismatched, classic_rtol=rtol,
        classic_atol=atol, ratio=max(r.ratio_a, r.ratio_b), worst_mode=worst_mode,
        worst_index=unravel(worst_flat, shape), bound_at_worst=bound_at_worst, ratio_native=r.ratio_a,
        ratio_manual=r.ratio_b, over_bound_native=r.over_a, over_bound_manual=r.over_b,
        err_native=r.max_err_a, err_manual=r.max_err_b,
        rel_err_native=relative(err2_a), rel_err_manual=relative(err2_b), condition=condition,
        nearer="tie" if err2_a == err2_b else ("native" if err2_a < err2_b else "manual"),
        nonfinite_native=r.nonfinite_a, nonfinite_manual=r.nonfinite_b,
        grad_sum_sq=r.sum_sq_e, diff_ratio=r.diff_ratio,
        # The statistical tier's spreads (root-mean-square over the tensor): predicted by the
        # probabilistic model, u sqrt(N - 1) S, and each mode's measured error against E.
        spread_predicted=UNIT_ROUNDOFF[manual_bound.dtype] * math.sqrt(max(manual_bound.roundings, 1)) * s_rms,
        spread_native=err2_a / math.sqrt(numel) if numel else 0.0,
        spread_manual=err2_b / math.sqrt(numel) if numel else 0.0,
    )
    if (reference_bound is not None or ulps) and not nonfinite:
        a, b = _as_float(native), _as_float(manual)
        e = np.asarray(exact, np.float64).reshape(-1)
        s = np.asarray(absum, np.float64).reshape(-1)
        precision_ratio, figures["err_ulps_native"], figures["err_ulps_manual"] = _precision(
            a, b, e, s, reference_bound or native_bound, allowance_rms)
        if reference_bound is not None:
            figures["precision_ratio"] = precision_ratio
    if oracle is not None:
        a, b = _as_float(native), _as_float(manual)
        e = np.asarray(exact, np.float64).reshape(-1)
        o = np.asarray(oracle, np.float64).reshape(-1)
        figures["oracle_err_native"] = float(np.max(np.abs(a - o), initial=0.0))
        figures["oracle_err_manual"] = float(np.max(np.abs(b - o), initial=0.0))
        figures["oracle_err_exact"] = float(np.max(np.abs(e - o), initial=0.0))
    return figures


@functools.lru_cache(maxsize=None)
def _judged_name(native: Any, manual: Any) -> str:
    """The dtype both modes are judged in, by name."""
    return str(np.promote_types(_judged_dtype(native), _judged_dtype(manual)))


def _judged_dtype(dtype: Any) -> np.dtype:
    """The dtype the kernel reads an array in: its own, float32 for those it cannot (bfloat16)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # a name numpy does not know ("bfloat16")
        return np.dtype(np.float32)
    return dtype if dtype in _KERNEL_DTYPES else np.dtype(np.float32)


def _rms(absum: np.ndarray) -> float:
    s = np.ascontiguousarray(absum, np.float64).reshape(-1)
    return float(np.sqrt(np.dot(s, s) / s.size)) if s.size else 0.0


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
