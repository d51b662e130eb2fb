import math

import pytest

from accumcheck.bounds import UNIT_ROUNDOFF, ModeBound, gamma


def test_gamma_matches_hand_computed_values():
    u = 2.0**-24
    assert gamma(0, u) == 0.0
    assert gamma(1, u) == pytest.approx(u / (1 - u), rel=1e-15)
    assert gamma(31, u) == pytest.approx(31 * u / (1 - 31 * u), rel=1e-15)
    assert gamma(31, u) == pytest.approx(1.8477e-6, rel=1e-4)


def test_gamma_is_infinite_once_the_bound_says_nothing():
    assert gamma(256, UNIT_ROUNDOFF["bfloat16"]) == math.inf
    assert math.isfinite(gamma(255, UNIT_ROUNDOFF["bfloat16"]))


def test_mode_bound_counts_n_minus_one_roundings_plus_a_kernel_allowance():
    plain = ModeBound.for_sum("float32", 32)
    assert plain.roundings == 31 and plain.floor(5.0) == plain.absolute
    fused = ModeBound.for_sum("float32", 32, kernel_allowance=4.0)
    assert fused.roundings == 31
    assert fused.relative == pytest.approx(plain.relative + 4 * 2.0**-24, rel=1e-15)
    assert fused.floor(2.0) == pytest.approx(plain.absolute + 4 * 2.0**-24 * 2.0, rel=1e-15)
    assert fused.at(1.0, 2.0) == pytest.approx(fused.relative + fused.floor(2.0), rel=1e-15)
    # E's own float64 error is included, and is negligible next to float32's.
    assert plain.relative == pytest.approx(gamma(31, 2.0**-24) + gamma(31, 2.0**-53), rel=1e-15)


def test_bound_scales_with_gradient_magnitude():
    # A tensor of 1e-10 gradients summed 32 times is judged at ~1e-17, not at a fixed 1e-5.
    bound = ModeBound.for_sum("float32", 32)
    assert 1e-17 < bound.at(32 * 1e-10) < 1e-14
    assert bound.at(0.0) == pytest.approx(31 * 2.0**-126)


def test_one_step_has_nothing_to_round():
    bound = ModeBound.for_sum("float32", 1)
    assert bound.roundings == 0 and bound.relative == 0.0 and bound.at(5.0) == 0.0


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="int8"):
        ModeBound.for_sum("int8", 4)


def test_stages_clamp_negative_roundings_and_skip_a_stage_without_any():
    # A stage of no roundings (one rank: an all-reduce of one term) adds nothing, even in bfloat16.
    staged = ModeBound.for_stages([("float32", 3), ("bfloat16", 0), ("float32", -1)])
    assert staged.roundings == 3 and staged.dtype == "float32"
    assert staged.relative == pytest.approx(gamma(3, 2.0**-24) + gamma(3, 2.0**-53), rel=1e-9)
    assert staged.absolute == 3 * 2.0**-126


def test_a_float64_stage_covers_its_own_rounding_and_that_of_e():
    staged = ModeBound.for_stages([("float64", 1)])
    assert staged.relative >= 2 * gamma(1, 2.0**-53)
    assert staged.absolute == 2.0**-1022


def test_stages_refuse_an_unknown_dtype_by_name():
    with pytest.raises(ValueError, match="no unit round-off known for dtype 'int8'"):
        ModeBound.for_stages([("float32", 3), ("int8", 1)])


def test_plus_adds_two_bounds_in_the_first_ones_dtype():
    a = ModeBound("float32", 3, 0.5, 0.25, kernel_allowance=2.0, tensor=0.125)
    b = ModeBound("bfloat16", 5, 0.25, 0.5, tensor=0.0625)
    assert a.plus(b) == ModeBound("float32", 0, 0.75, 0.75, kernel_allowance=0.0, tensor=0.1875)


def test_for_sum_records_its_dtype_and_kernel_allowance():
    u = 2.0**-24
    assert ModeBound.for_sum("float32", 32, kernel_allowance=4.0) == ModeBound(
        "float32", 31, gamma(31, u) + gamma(31, 2.0**-53) + 4 * u, 31 * 2.0**-126, kernel_allowance=4.0, tensor=4 * u)


def test_at_without_an_rms_of_s_adds_no_tensor_allowance():
    bound = ModeBound("float32", 1, 0.25, 0.5, tensor=2.0)
    assert bound.at(4.0) == 1.5 and bound.at(4.0, 1.0) == 3.5
