"""The comparator on hand-computed numbers: each verdict, each statistic, and the controls."""

import math

import numpy as np
import pytest

from accumcheck.bounds import ModeBound
from accumcheck.judge import ILL_CONDITIONED, compare_tensor, kernel, statistics

F32 = np.float32
U = 2.0**-24


def judge(native, manual, exact, absum, steps=2, dtype="float32", **kw):
    bound = ModeBound.for_sum(dtype, steps)
    return compare_tensor("t", "weight", np.asarray(native), np.asarray(manual), np.asarray(exact, np.float64),
                          np.asarray(absum, np.float64), bound, bound, **kw)


def test_identical_tensors():
    x = np.array([1.0, -2.0, 3.5], F32)
    r = judge(x, x.copy(), x, np.abs(x))
    assert r.verdict == "identical"
    assert (r.mismatched, r.max_abs_diff, r.max_ulps, r.ratio, r.classic_mismatched) == (0, 0.0, 0.0, 0.0, 0)
    assert r.max_abs_grad == 3.5 and r.condition == 1.0 and r.nearer == "tie"


def test_one_ulp_apart_at_half_an_ulp_from_e_is_round_off():
    # E = 1 + 2^-24 lies half-way between native 1 and manual 1 + 2^-23: each is u away from E,
    # and the bound for two terms summing to S = 1 is gamma_1 * 1 (> u), plus negligible terms.
    native = np.array([1.0], F32)
    manual = np.array([1.0 + 2.0**-23], F32)
    r = judge(native, manual, [1.0 + U], [1.0])
    assert r.verdict == "round-off"
    assert r.max_ulps == 1.0
    assert r.max_abs_diff == 2.0**-23
    assert r.err_native == U and r.err_manual == U
    assert r.ratio == pytest.approx(1 - U, rel=1e-6)  # just inside
    assert r.classic_mismatched == 0


def test_three_half_ulps_from_e_is_diverged_and_names_the_mode():
    native = np.array([1.0 + 2.0**-22], F32)  # 3u above E
    manual = np.array([1.0], F32)  # u below E
    r = judge(native, manual, [1.0 + U], [1.0])
    assert r.verdict == "diverged"
    assert r.worst_mode == "native" and r.nearer == "manual"
    assert r.ratio_native == pytest.approx(3.0, rel=1e-6)
    assert r.ratio_manual == pytest.approx(1.0, rel=1e-6)
    assert r.over_bound_native == 1 and r.over_bound_manual == 0
    assert r.max_ulps == 2.0  # ulp(1.0f) = 2^-23


def test_verdict_is_scale_invariant_where_fixed_tolerances_are_blind():
    # The same numbers scaled by 2^-40 (~1e-12): the bound scales with S, so the verdict stays;
    # torch.testing's atol of 1e-5 would pass them all.
    s = 2.0**-40
    native = np.array([(1.0 + 2.0**-22) * s], F32)
    manual = np.array([1.0 * s], F32)
    r = judge(native, manual, [(1.0 + U) * s], [s])
    assert r.verdict == "diverged" and r.ratio == pytest.approx(3.0, rel=1e-6)
    assert r.classic_mismatched == 0
    assert r.bound_at_worst == pytest.approx((U / (1 - U)) * s, rel=1e-6)


def test_relative_difference_and_classic_tolerances():
    native = np.array([1.0, 1.0001, 2.0, 0.0], F32)
    manual = np.array([1.0, 1.0, 2.0 + 1e-5, 0.0], F32)
    r = judge(native, manual, manual.astype(np.float64), np.abs(manual) * 3, steps=4)
    assert r.mismatched == 2
    assert r.classic_mismatched == 1  # 1e-4 > 1e-5 + 1.3e-6; ~1e-5 at 2.0 is within atol + rtol*2
    assert r.max_abs_diff == pytest.approx(1e-4, rel=1e-2)
    assert r.max_abs_diff_index == [1]
    assert r.max_rel_diff == pytest.approx(1e-4, rel=1e-2)


def test_relative_difference_against_zero_is_infinite():
    r = judge(np.array([1e-30], F32), np.array([0.0], F32), [0.0], [1.0])
    assert r.max_rel_diff == math.inf


def test_non_finite_is_a_verdict_not_a_crash():
    native = np.array([np.inf, 1.0, np.nan], F32)
    manual = np.array([1.0, 1.0, 1.0], F32)
    r = judge(native, manual, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert r.verdict == "non-finite" and r.flagged
    assert r.nonfinite_native == 2 and r.nonfinite_manual == 0


def test_heavy_cancellation_is_ill_conditioned_not_diverged():
    # S = 1 but E = 1e-3: cond 1000. Both modes within the bound: round-off, marked ill-conditioned.
    native = np.array([1e-3 + 2e-8], F32)
    manual = np.array([1e-3 - 1e-8], F32)
    r = judge(native, manual, [1e-3], [1.0], steps=8)
    assert r.condition == pytest.approx(1000.0)
    assert r.condition >= ILL_CONDITIONED
    assert r.verdict == "round-off" and r.ill_conditioned
    assert r.max_rel_diff > 1e-5  # a relative test would cry wolf here


def test_worst_element_is_located_in_a_large_multi_chunk_tensor():
    rng = np.random.default_rng(1)
    micro = rng.standard_normal((4, 300, 1000)).astype(F32)
    native = micro.sum(axis=0, dtype=F32)
    manual = native.copy()
    exact = micro.astype(np.float64).sum(axis=0)
    absum = np.abs(micro.astype(np.float64)).sum(axis=0)
    assert judge(native, manual, exact, absum, steps=4).verdict == "identical"
    native[217, 604] += micro[2, 217, 604]  # a micro-step counted twice, in one element
    r = judge(native, manual, exact, absum, steps=4)
    assert r.verdict == "diverged"
    assert r.worst_index == [217, 604] and r.max_abs_diff_index == [217, 604]
    assert r.mismatched == 1 and r.over_bound_native == 1


def test_float64_tensors_use_their_own_ulps():
    bound = ModeBound.for_sum("float64", 2)
    one_ulp = compare_tensor("t", "weight", np.array([1.0 + 2.0**-52]), np.array([1.0]), np.array([1.0]),
                             np.array([1.0]), bound, bound)
    # 2^-52 = 2u from E, and the float64 bound is gamma_1 for the mode plus gamma_1 for E itself.
    assert one_ulp.dtype == "float64" and one_ulp.max_ulps == 1.0 and one_ulp.verdict == "round-off"
    four_ulps = compare_tensor("t", "weight", np.array([1.0 + 2.0**-50]), np.array([1.0]), np.array([1.0]),
                               np.array([1.0]), bound, bound)
    assert four_ulps.max_ulps == 4.0 and four_ulps.verdict == "diverged"
    assert four_ulps.ratio == pytest.approx(4.0, rel=1e-6)  # 8u against 2u


def test_ulps_across_zero_count_every_float_between():
    r = judge(np.array([2.0**-149], F32), np.array([-2.0**-149], F32), [0.0], [1.0])
    assert r.max_ulps == 2.0  # -min_subnormal, 0, +min_subnormal


def test_oracle_errors_are_reported_per_mode():
    native = np.array([1.0, 2.0], F32)
    manual = np.array([1.0, 2.0 + 2.0**-22], F32)
    r = judge(native, manual, [1.0, 2.0], [1.0, 2.0], oracle=np.array([1.0, 2.0 + 2.0**-21]))
    assert r.oracle_err_native == 2.0**-21
    assert r.oracle_err_manual == 2.0**-22
    assert r.oracle_err_exact == 2.0**-21


# ------------------------------------------------------------------ controls on real summations


def _sums(micro: np.ndarray):
    forward = np.zeros(micro.shape[1:], F32)
    for g in micro:
        forward += g
    backward = np.zeros(micro.shape[1:], F32)
    for g in micro[::-1]:
        backward += g
    return forward, backward, micro.astype(np.float64).sum(0), np.abs(micro.astype(np.float64)).sum(0)


@pytest.mark.parametrize("scale", [1e-10, 1.0, 1e10])
def test_positive_control_reordered_sums_are_never_flagged(scale):
    rng = np.random.default_rng(7)
    micro = (rng.standard_normal((64, 5000)) * scale).astype(F32)
    forward, backward, exact, absum = _sums(micro)
    r = judge(forward, backward, exact, absum, steps=64)
    assert r.verdict == "round-off" and not r.flagged
    assert 0 < r.ratio < 1


@pytest.mark.parametrize("scale", [1e-10, 1.0, 1e10])
def test_negative_control_a_dropped_micro_step_is_flagged(scale):
    rng = np.random.default_rng(7)
    micro = (rng.standard_normal((64, 5000)) * scale).astype(F32)
    forward, backward, exact, absum = _sums(micro)
    dropped = (forward - micro[31]).astype(F32)
    r = judge(dropped, backward, exact, absum, steps=64)
    assert r.verdict == "diverged" and r.worst_mode == "native" and r.nearer == "manual"
    assert r.ratio > 100


# ------------------------------------------------------------------ the figures, one by one

QUARTER = ModeBound("float32", 1, 0.25, 0.0)  # |x - E| <= S / 4: ratios come out exact
HALF = ModeBound("float32", 1, 0.5, 0.0)


def quartered(native, manual, exact, absum, **kw):
    return compare_tensor("t", "weight", np.asarray(native, F32), np.asarray(manual, F32), np.asarray(exact, float),
                          np.asarray(absum, float), QUARTER, QUARTER, **kw)


def test_the_pass_runs_over_chunks_of_a_mebi_element(monkeypatch):
    chunks = []
    for name in ("_reduce", "_reduce_serial"):  # across threads, and in this one for a single chunk
        def recording(*args, reduce=getattr(kernel, name)):
            chunks.append(args[-1])
            return reduce(*args)

        monkeypatch.setattr(kernel, name, recording)
    for n in (0, 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 5):
        x = np.ones(n, F32)
        assert judge(x, x, x, x).verdict == "identical"
    assert chunks == [1, 1, 1, 2, 4]


def test_an_empty_tensor_has_nothing_to_point_at():
    bound = ModeBound.for_sum("float32", 4)
    r = judge(np.zeros(0, F32), np.zeros(0, F32), [], [], steps=4, reference_bound=bound, ulps=True)
    assert (r.verdict, r.numel, r.worst_index, r.max_abs_diff_index, r.ratio) == ("identical", 0, [], [], 0.0)
    assert (r.precision_ratio, r.err_ulps_native, r.err_ulps_manual, r.condition) == (0.0, 0.0, 0.0, 1.0)
    assert r.bound_at_worst == bound.at(0.0)


def test_the_mode_further_from_its_bound_is_the_worst_one():
    # native 1/2 from E against S/4 = 1 (ratio 1/2); manual 3/2 from E against S/2 = 2 (3/4), elsewhere.
    r = compare_tensor("t", "weight", np.array([8.5, 8.0], F32), np.array([8.0, 9.5], F32), np.array([8.0, 8.0]),
                       np.array([4.0, 4.0]), QUARTER, HALF)
    assert (r.ratio_native, r.ratio_manual, r.ratio, r.worst_mode) == (0.5, 0.75, 0.75, "manual")
    assert r.worst_index == [1] and r.bound_at_worst == 2.0
    # A tie goes to native, at native's place and bound.
    tie = compare_tensor("t", "weight", np.array([9.0, 8.0], F32), np.array([8.0, 10.0], F32), np.array([8.0, 8.0]),
                         np.array([4.0, 4.0]), QUARTER, HALF)
    assert (tie.ratio, tie.worst_mode, tie.worst_index, tie.bound_at_worst) == (1.0, "native", [0], 1.0)


def test_native_and_manual_of_different_widths_are_compared_in_the_wider():
    r = judge(np.array([1.0, 2.0], np.float16), np.array([1.0 + 2.0**-23, 2.0], F32), [1.0, 2.0], [1.0, 2.0])
    assert r.dtype == "float32" and r.max_ulps == 1.0 and r.mismatched == 1
    counts = judge(np.array([1, 2], np.int8), np.array([1, 2], np.int8), [1.0, 2.0], [1.0, 2.0])
    assert counts.dtype == "float32" and counts.verdict == "identical"  # no float of their own: float32


def test_e_is_read_in_float64():
    # E = 1 + 2^-23 given in float32: its square needs float64.
    x = np.array([1.0 + 2.0**-23], F32)
    bound = ModeBound.for_sum("float32", 2)
    assert compare_tensor("t", "weight", x, x, x, np.ones(1, F32), bound, bound).grad_sum_sq == (1.0 + 2.0**-23) ** 2


def test_sizes_that_differ_are_refused_by_name():
    with pytest.raises(ValueError) as error:
        judge(np.zeros(2, F32), np.zeros(2, F32), np.zeros(3), np.zeros(2))
    assert str(error.value) == "t: native, manual, exact and absum differ in size (2, 2, 3, 2)"


def test_classic_tolerances_follow_the_bound_s_dtype_else_the_arrays():
    x = np.ones(2, F32)
    bf16 = compare_tensor("t", "weight", x, x, x, x, ModeBound.for_sum("bfloat16", 2), ModeBound.for_sum("float32", 2))
    assert (bf16.classic_rtol, bf16.classic_atol) == (1.6e-2, 1e-5)
    custom = compare_tensor("t", "weight", x, x, x, x, ModeBound("custom", 1, 0.25, 0.0), QUARTER)
    assert (custom.classic_rtol, custom.classic_atol) == (1.3e-6, 1e-5)


def test_figures_without_ulps_unless_asked():
    x = np.ones(2, F32)
    figures = statistics.tensor_figures("t", "weight", x, x, x, x, QUARTER, QUARTER)
    assert "err_ulps_native" not in figures and "precision_ratio" not in figures
    assert statistics.tensor_figures("t", "weight", x, x, x, x, QUARTER, QUARTER, ulps=True)["err_ulps_native"] == 0.0


def test_errors_in_float32_ulps_of_e_or_of_the_mean_term_where_e_cancels():
    bound = ModeBound.for_sum("float32", 4)  # 3 roundings: the mean term is S / 4
    # E = 0 (cancelled) at S = 8: ulps of 2.0f = 2^-22. E = 3 = S: ulps of 3.0f = 2^-22 too.
    r = compare_tensor("t", "weight", np.array([2.0**-20, 3.0 + 2.0**-21], F32), np.array([0.0, 3.0], F32),
                       np.array([0.0, 3.0]), np.array([8.0, 3.0]), bound, bound, ulps=True)
    assert (r.err_ulps_native, r.err_ulps_manual) == (4.0, 0.0)
    # E = 1 + 2^-24 is a float32 tie: 1.0f, whose ulp is 2^-23; native 1 is half an ulp away.
    half = compare_tensor("t", "weight", np.array([1.0], F32), np.array([1.0 + 2.0**-23], F32),
                          np.array([1.0 + 2.0**-24]), np.array([1.0]), bound, bound, reference_bound=QUARTER)
    assert (half.err_ulps_native, half.err_ulps_manual) == (0.5, 0.5)
    assert half.precision_ratio == 2.0**-24 / 0.25


def test_a_kernel_allowance_scales_with_the_rms_of_s():
    native_bound = ModeBound.for_sum("float32", 2, kernel_allowance=4.0)
    plain = ModeBound.for_sum("float32", 2)
    r = compare_tensor("t", "weight", np.array([8.0, 8.0 + 2.0**-20], F32), np.array([8.0, 8.0], F32),
                       np.array([8.0, 8.0]), np.array([3.0, 4.0]), native_bound, plain)
    s_rms = math.sqrt((9.0 + 16.0) / 2)
    assert r.worst_mode == "native" and r.worst_index == [1]
    assert r.bound_at_worst == native_bound.relative * 4.0 + native_bound.absolute + native_bound.tensor * s_rms
    assert r.ratio == pytest.approx(2.0**-20 / r.bound_at_worst, rel=1e-12)


def test_a_huge_s_needs_no_rms_without_a_kernel_allowance():
    # float64 sums near 1e200: S_rms would overflow, and no bound asks for it.
    bound = ModeBound.for_sum("float64", 2)
    r = compare_tensor("t", "weight", np.array([1e200 * (1 + 2.0**-40)]), np.array([1e200]), np.array([1e200]),
                       np.array([1e200]), bound, bound)
    assert r.verdict == "diverged" and math.isfinite(r.bound_at_worst)


def test_the_bound_at_the_worst_element_is_at_its_s_and_at_s_0_where_nothing_is_off():
    exact = quartered(np.array([8.0, 8.0], F32), np.array([8.0, 8.0], F32), [8.0, 8.0], [4.0, 8.0])
    assert (exact.ratio, exact.worst_index, exact.bound_at_worst) == (0.0, [], 0.0)
    off = quartered(np.array([8.0, 10.0], F32), np.array([8.0, 8.0], F32), [8.0, 8.0], [4.0, 8.0])
    assert (off.ratio, off.worst_index, off.bound_at_worst) == (1.0, [1], 2.0)


def test_non_finite_counts_from_either_mode_or_e():
    # Both modes infinite at the same element agree there, and are still non-finite.
    both = judge(np.array([np.inf, 1.0], F32), np.array([np.inf, 1.0], F32), [1.0, 1.0], [1.0, 1.0])
    assert both.verdict == "non-finite" and (both.nonfinite_native, both.nonfinite_manual) == (1, 1)
    assert both.mismatched == 0
    # Native and E infinite at the same element.
    with_e = judge(np.array([np.inf, 1.0], F32), np.array([1.0, 1.0], F32), [np.inf, 1.0], [np.inf, 1.0])
    assert with_e.verdict == "non-finite" and with_e.mismatched == 1
    assert judge(np.ones(2, F32), np.ones(2, F32), [1.0, np.nan], [1.0, 1.0]).verdict == "non-finite"


def test_condition_of_a_sum_that_cancels_to_zero():
    assert judge(np.zeros(1, F32), np.zeros(1, F32), [0.0], [0.5]).condition == math.inf
    assert judge(np.zeros(1, F32), np.zeros(1, F32), [0.0], [0.0]).condition == 1.0
    assert judge(np.ones(2, F32), np.ones(2, F32), [1.0, -1.0], [3.0, 3.0]).condition == 3.0


def test_relative_errors_in_the_2_norm_of_e():
    r = quartered(np.array([3.5, 4.0], F32), np.array([3.0, 4.0], F32), [3.0, 4.0], [4.0, 4.0])
    assert (r.rel_err_native, r.rel_err_manual, r.nearer) == (0.1, 0.0, "manual")
    assert (r.numel, r.diff_ratio) == (2, 0.5 / 2.0)  # |A - B| over the two bounds, S/4 each
    small = quartered(np.array([0.75], F32), np.array([0.5], F32), [0.5], [4.0])
    assert (small.rel_err_native, small.rel_err_manual, small.nearer) == (0.5, 0.0, "manual")
    zero = quartered(np.array([2.0**-10, 0.0], F32), np.zeros(2, F32), [0.0, 0.0], [1.0, 1.0])
    assert (zero.rel_err_native, zero.rel_err_manual, zero.nearer) == (math.inf, 0.0, "manual")
    nearer = quartered(np.array([3.0], F32), np.array([3.5], F32), [3.0], [4.0])
    assert nearer.nearer == "native"


def test_the_largest_difference_is_located_apart_from_the_worst_ratio():
    # Element 0: native 1 from E at S = 1 (ratio 4). Element 1: the modes 2 apart at S = 64 (ratio 1/8).
    r = quartered(np.array([9.0, 10.0], F32), np.array([8.0, 8.0], F32), [8.0, 8.0], [1.0, 64.0])
    assert (r.worst_index, r.max_abs_diff_index, r.max_abs_diff) == ([0], [1], 2.0)


def test_oracle_errors_in_float64_of_any_shape_and_of_an_empty_tensor():
    native = np.array([[1e8, 1.0], [2.0, 3.0]], F32)
    r = judge(native, native.copy(), native.astype(np.float64), np.abs(native.astype(np.float64)),
              oracle=np.array([[1.0, 1.0], [2.0, 3.0]], F32))
    assert r.oracle_err_native == r.oracle_err_manual == r.oracle_err_exact == 99999999.0
    empty = judge(np.zeros((0, 3), F32), np.zeros((0, 3), F32), np.zeros((0, 3)), np.zeros((0, 3)),
                  oracle=np.zeros((0, 3)))
    assert (empty.oracle_err_native, empty.oracle_err_manual, empty.oracle_err_exact) == (0.0, 0.0, 0.0)


def test_the_rms_of_s_is_taken_in_float64_even_from_float32():
    # S = 3e20 given in float32: its square overflows float32.
    native_bound = ModeBound.for_sum("float32", 2, kernel_allowance=4.0)
    s = np.array([3e20], F32)
    r = compare_tensor("t", "weight", np.nextafter(s, F32(np.inf)), s, s.astype(np.float64), s, native_bound,
                       ModeBound.for_sum("float32", 2))
    big = float(s[0])
    assert r.bound_at_worst == native_bound.relative * big + native_bound.absolute + native_bound.tensor * big


def test_the_reference_bound_takes_its_tensor_allowance_from_the_same_rms_of_s():
    native_bound = ModeBound.for_sum("float32", 2, kernel_allowance=4.0)
    reference = ModeBound("float32", 1, 0.25, 0.0, tensor=0.25)
    r = compare_tensor("t", "weight", np.array([9.0, 8.0], F32), np.array([8.0, 8.0], F32), np.array([8.0, 8.0]),
                       np.array([3.0, 4.0]), native_bound, ModeBound.for_sum("float32", 2), reference_bound=reference)
    assert r.precision_ratio == 1.0 / (0.75 + 0.25 * math.sqrt(12.5))
