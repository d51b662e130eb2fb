"""Cross-framework agreement (accumcheck.judge.agreement) on hand-computed numbers: two runs' manual
sums against each other, within the frameworks' own float32 errors and the float64 kernel allowance."""

import math

import numpy as np
import pytest

from accumcheck.judge.agreement import FLOAT64_KERNEL_ALLOWANCE, agreement, forward_agreement, ordered_bits
from accumcheck.run.results import ParamAccumulation, RunResult

F32 = np.float32
U = 2.0**-24


def param(name, manual, oracle, absum):
    manual = np.asarray(manual, F32)
    oracle = None if oracle is None else np.asarray(oracle, np.float64)
    return ParamAccumulation(name, "weight", manual, manual.copy(), np.zeros(manual.shape), np.asarray(absum, float),
                             oracle=oracle)


def run(*params, logits=None):
    return RunResult(params=list(params), framework="f", versions={}, device="cpu", param_dtype="float32",
                     accum_dtype="float32", first_logits=logits)


def test_ordered_bits_put_floats_on_a_monotonic_integer_line():
    values = np.array([-1.0, -2.0**-149, -0.0, 0.0, 2.0**-149, 1.0, np.nextafter(F32(1), F32(2))], F32)
    assert ordered_bits(values).tolist() == [-0x3F800000, -1, 0, 0, 1, 0x3F800000, 0x3F800001]
    assert ordered_bits(values).dtype == np.int64
    # The most negative float32 lies 2^31 - 1 - 2^23 below zero: no int32 wrap-around.
    assert ordered_bits(np.array([-np.finfo(F32).max], F32)).tolist() == [-0x7F7FFFFF]


def test_sums_within_their_float32_errors_and_the_kernel_allowance_agree():
    # w: b's manual sum is 2^-22 above a's at [1], and b's own float64 run says 2 there (err_b = 2^-22).
    # S = max of the two runs' S: [1, 4]; the other tensor has S = 3, so over the model S_rms^2 = 26/3.
    a = run(param("w", [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]), param("b", [0.5], [0.5], [3.0]))
    b = run(param("b", [0.5], [0.5], [2.0]), param("w", [1.0, 2.0 + 2.0**-22], [1.0, 2.0], [1.0, 4.0]))
    w, bias = agreement(a, b)
    floor = FLOAT64_KERNEL_ALLOWANCE * U * (4.0 + math.sqrt(8.5) + math.sqrt(26 / 3))
    assert (w.name, w.kind, w.shape, w.verdict) == ("w", "weight", [2], "agree")
    assert w.max_abs_diff == 2.0**-22 and w.max_abs_diff_index == [1] and w.max_ulps == 1.0
    assert w.float32_err_a == 0.0 and w.float32_err_b == 2.0**-22
    assert w.worst_index == [1]
    assert w.bound_at_worst == pytest.approx(2.0**-22 + floor, rel=1e-12)
    assert w.ratio == pytest.approx(2.0**-22 / (2.0**-22 + floor), rel=1e-12)
    assert not w.flagged
    # Equal sums: identical, their bound the allowance alone (S = 3, and S_rms = 3 over the tensor).
    assert (bias.verdict, bias.ratio, bias.max_abs_diff, bias.max_ulps) == ("identical", 0.0, 0.0, 0.0)
    assert bias.bound_at_worst == pytest.approx(FLOAT64_KERNEL_ALLOWANCE * U * (6.0 + math.sqrt(26 / 3)),
                                                rel=1e-12)


def test_a_difference_beyond_the_bound_disagrees():
    sums, absum = [[1.0, 2.0], [3.0, 1.0]], [[1.0, 2.0], [3.0, 1.0]]
    other = [[1.0, 2.0], [3.0 + 2.0**-10, 1.0]]
    (w,) = agreement(run(param("w", sums, sums, absum)), run(param("w", other, other, absum)))
    assert w.verdict == "disagree" and w.flagged
    assert w.max_abs_diff == 2.0**-10 and w.max_abs_diff_index == [1, 0] and w.worst_index == [1, 0]
    assert w.max_ulps == 4096.0  # an ulp of 3.0f is 2^-22
    floor = FLOAT64_KERNEL_ALLOWANCE * U * (3.0 + 2 * math.sqrt(15 / 4))  # S_rms over tensor and model
    assert w.ratio == pytest.approx(2.0**-10 / floor, rel=1e-12)
    assert w.bound_at_worst == pytest.approx(floor, rel=1e-12)


def test_differences_are_taken_in_float64():
    (w,) = agreement(run(param("w", [-1e8], [-1e8], [1e8])), run(param("w", [-1.0], [-1.0], [1e8])))
    assert w.max_abs_diff == 99999999.0  # float32 would round it to 1e8
    assert w.max_ulps == float(0x4CBEBC20 - 0x3F800000)  # the bit patterns of 1e8f and 1.0f
    assert w.verdict == "disagree"


def test_non_finite_sums_are_a_verdict_of_their_own():
    for sums in (([np.inf, 1.0], [1.0, 1.0]), ([1.0, 1.0], [1.0, np.nan])):
        a = run(param("w", sums[0], [1.0, 1.0], [1.0, 1.0]))
        b = run(param("w", sums[1], [1.0, 1.0], [1.0, 1.0]))
        (w,) = agreement(a, b)
        assert w.verdict == "non-finite" and w.flagged


@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:invalid value encountered")
def test_an_empty_tensor_is_identical_and_points_nowhere():
    (w,) = agreement(run(param("w", np.zeros(0), np.zeros(0), np.zeros(0))),
                     run(param("w", np.zeros(0), np.zeros(0), np.zeros(0))))
    assert (w.verdict, w.shape, w.worst_index, w.max_abs_diff_index) == ("identical", [0], [], [])
    assert (w.ratio, w.bound_at_worst, w.max_abs_diff, w.max_ulps, w.float32_err_a) == (0.0, 0.0, 0.0, 0.0, 0.0)


def test_a_zero_bound_still_divides():
    # S = 0 everywhere and both runs exact: the bound is the smallest normal float64, not 0.
    (w,) = agreement(run(param("w", [0.0, 1.0], [0.0, 1.0], [0.0, 0.0])),
                     run(param("w", [0.0, 1.0 + 2.0**-23], [0.0, 1.0 + 2.0**-23], [0.0, 0.0])))
    assert w.verdict == "disagree" and w.bound_at_worst == np.finfo(np.float64).tiny
    assert w.ratio == 2.0**-23 / np.finfo(np.float64).tiny


@pytest.mark.parametrize("which", ["a", "b"])
def test_both_runs_need_the_float64_oracle(which):
    runs = {k: run(param("w", [1.0], [1.0], [1.0])) for k in "ab"}
    runs[which].params[0].oracle = None
    with pytest.raises(ValueError, match="both runs made with the float64 oracle"):
        agreement(runs["a"], runs["b"])


def test_forward_agreement_of_the_first_logits():
    la = np.array([[1.0, -4.0], [2.0, 0.0]], F32)
    lb = np.array([[1.0, -4.0 + 2.0**-20], [2.0, 0.0]])
    fwd = forward_agreement(run(logits=la), run(logits=lb))
    assert (fwd.max_abs_diff, fwd.max_abs_logit, fwd.index) == (2.0**-20, 4.0, [0, 1])
    assert fwd.relative == 2.0**-22 and fwd.in_float32_units == 4.0
    big = forward_agreement(run(logits=np.array([1e8], F32)), run(logits=np.array([1.0], F32)))
    assert big.max_abs_diff == 99999999.0 and big.index == [0]  # the difference taken in float64


def test_forward_agreement_of_zero_logits_and_of_none():
    fwd = forward_agreement(run(logits=np.zeros(3, F32)), run(logits=np.array([0.0, 0.0, 1e-3])))
    assert (fwd.max_abs_diff, fwd.max_abs_logit, fwd.relative, fwd.in_float32_units, fwd.index) == (
        1e-3, 0.0, 0.0, 0.0, [2])
    assert forward_agreement(run(logits=np.ones(2, F32)), run()) is None
    assert forward_agreement(run(), run(logits=np.ones(2, F32))) is None


def test_ordered_bits_of_float64_values_are_those_of_their_float32():
    assert ordered_bits(np.array([1.0, -1.0])).tolist() == [0x3F800000, -0x3F800000]


def test_a_ratio_of_exactly_one_agrees_and_above_it_disagrees():
    # S = 0: the bound is a's float32 error 2^-10 (and the smallest normal float64, lost next to it).
    def verdict(b_sum):
        (w,) = agreement(run(param("w", [1.0], [1.0 + 2.0**-10], [0.0])), run(param("w", [b_sum], [b_sum], [0.0])))
        return w.ratio, w.verdict

    assert verdict(1.0 + 2.0**-10) == (1.0, "agree")
    assert verdict(1.0 + 3 * 2.0**-11) == (1.5, "disagree")


def test_the_oracle_is_required_in_words():
    with pytest.raises(ValueError) as error:
        agreement(run(param("w", [1.0], None, [1.0])), run(param("w", [1.0], [1.0], [1.0])))
    assert str(error.value) == "agreement needs both runs made with the float64 oracle"
