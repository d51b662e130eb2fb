"""accumcheck.judge.fullbatch on plain numpy arrays: equivalence, a constant factor and what it
matches, a weighting no constant explains, and how the result is saved and drawn."""

import math

import numpy as np
import pytest

from accumcheck.backend import FullBatchGap, ParamAccumulation, RunResult
from accumcheck.casefile import builtin_case
from accumcheck.judge import FACTOR_TOLERANCE, build_report, full_batch_verdict
from accumcheck.judge.fullbatch import factor_candidates
from accumcheck.render.markdown import markdown
from accumcheck.render.text import full_batch_line, summary_line
from accumcheck.report import FullBatchResult
from accumcheck.report.values import decode, encode

RNG = np.random.default_rng(7)
FULL = {"embed.weight": RNG.standard_normal((5, 3)), "fc.weight": RNG.standard_normal((3, 3)),
        "fc.bias": RNG.standard_normal(3)}


def verdict(accumulated, full=FULL, steps=4, world_size=1, item_counts=None) -> FullBatchResult:
    gap = FullBatchGap("mean", "1/N", accumulated, full, item_counts)
    return full_batch_verdict(gap, steps, world_size)


def scaled(factors, full=FULL):
    """Each tensor of ``full`` times its factor (one number: the same for all)."""
    factors = factors if isinstance(factors, dict) else dict.fromkeys(full, factors)
    return {name: factors[name] * f for name, f in full.items()}


def test_float64_noise_is_equivalent_and_no_factor_is_claimed():
    noisy = {name: f + 1e-15 * RNG.standard_normal(f.shape) for name, f in FULL.items()}
    result = verdict(noisy)
    assert result.equivalent and not result.constant and result.matches is None
    assert result.max_relative_difference < 1e-14
    assert abs(result.factor - 1) < 1e-14 and result.spread < 1e-14 and result.residual < 1e-14
    assert result.explanation == "equivalent: accumulated = full batch within 1e-9"
    assert result.headline == ""


def test_a_quarter_at_four_micro_batches_is_one_over_n():
    result = verdict(scaled(0.25))
    assert not result.equivalent and result.constant and result.matches == "1/N"
    assert result.factor == 0.25 and result.factor_min == result.factor_max == 0.25
    assert result.tensor_factors == dict.fromkeys(FULL, 0.25)
    assert result.explanation == (
        "accumulated = 0.250 x full batch on all 3 tensors (spread 0): matches 1/N (N = 4): the loss is divided by "
        "N once more than the loss normalisation needs")
    assert result.headline == "0.250 x it on every tensor (1/N)"


def test_four_times_at_four_micro_batches_is_n():
    result = verdict(scaled(4.0))
    assert result.constant and result.matches == "N"
    assert result.explanation.endswith("matches N (N = 4): the micro-batch losses are summed without dividing by N")


def test_a_constant_that_is_none_of_the_runs_numbers_matches_nothing():
    result = verdict(scaled(1.7))
    assert result.constant and result.matches is None and result.headline == "1.70 x it on every tensor"
    assert result.explanation.startswith("accumulated = 1.70 x full batch on all 3 tensors (spread ")
    assert "matches none of N, 1/N, N^2, 1/N^2 (N = 4)" in result.explanation


def test_the_factor_tolerance_lies_between_float64_noise_and_a_weighting():
    assert verdict(scaled({"embed.weight": 1.7, "fc.weight": 1.7, "fc.bias": 1.7 * (1 + 1e-7)})).constant
    assert not verdict(scaled({"embed.weight": 1.7, "fc.weight": 1.7, "fc.bias": 1.7 * (1 + 1e-5)})).constant


def test_a_factor_is_matched_within_the_tolerance_only():
    assert verdict(scaled(0.25 * (1 + FACTOR_TOLERANCE / 2))).matches == "1/N"
    near = verdict(scaled(0.25 * (1 + 2 * FACTOR_TOLERANCE)))
    assert near.constant and near.matches is None


def test_factors_of_their_own_per_tensor_are_not_a_constant_and_the_furthest_is_named():
    result = verdict(scaled({"embed.weight": 1.0, "fc.weight": 1.1, "fc.bias": 3.0}))
    assert not result.equivalent and not result.constant and result.matches is None
    assert result.factor_worst_tensor == "fc.bias"
    assert (result.factor_min, result.factor_max) == pytest.approx((1.0, 3.0))
    assert result.spread > 0.1 and result.residual > 0.1 and result.worst_tensor_residual > 0.1
    assert result.explanation.startswith("not a constant factor: per-tensor factors 1.00 to 3.00 (worst fc.bias, "
                                         "residual ")
    assert "transformers#34191" in result.explanation and "items per micro-batch" not in result.explanation
    assert result.headline == "not a constant factor"


def test_a_small_tensor_with_its_own_factor_is_a_weighting_though_the_residual_misses_it():
    full = dict(FULL, **{"fc.bias": 1e-4 * FULL["fc.bias"]})
    result = verdict(scaled({"embed.weight": 1.0, "fc.weight": 1.0, "fc.bias": 1.01}, full), full=full)
    assert not result.constant and result.spread > 1e-3 and result.residual < FACTOR_TOLERANCE
    assert result.factor_worst_tensor == "fc.bias"
    barely = verdict(scaled({"embed.weight": 1.7, "fc.weight": 1.7, "fc.bias": 1.7 * (1 + FACTOR_TOLERANCE / 10)}))
    assert barely.constant


def test_a_residual_no_factor_explains_is_not_a_constant():
    full = {"w": np.array([1.0, 0.0])}
    result = verdict({"w": np.array([0.25, 0.25 * 10 * FACTOR_TOLERANCE])}, full=full)
    assert result.tensor_factors == {"w": 0.25} and result.spread == 0  # the one factor fits, the residual not
    assert not result.constant and result.residual > FACTOR_TOLERANCE


def test_a_tensor_zero_in_both_is_left_out():
    full = dict(FULL, unused=np.zeros(4))
    result = verdict(dict(scaled(0.25), unused=np.zeros(4)), full=full)
    assert result.constant and result.matches == "1/N" and "unused" not in result.tensor_factors
    assert "on all 3 tensors" in result.explanation


def test_a_gradient_where_the_full_batch_has_none_is_not_a_constant():
    full = dict(FULL, unused=np.zeros(4))
    result = verdict(dict(scaled(0.25), unused=np.full(4, 0.5)), full=full)
    assert not result.constant and result.matches is None
    assert result.factor == 0.25 and result.spread == 0  # the other tensors agree on their factor
    assert result.factor_worst_tensor == "unused" and result.worst_tensor_residual == 1.0
    assert "worst unused, a gradient where the full batch's is zero" in result.explanation


def test_zero_and_non_finite_gradients_have_no_factor():
    zero_full = verdict(scaled(1.0), full={name: np.zeros_like(f) for name, f in FULL.items()})
    assert zero_full.factor is None and not zero_full.constant
    assert zero_full.max_relative_difference == max(np.abs(f).max() for f in FULL.values())  # absolute: no scale
    assert "the full batch's gradient is zero everywhere" in zero_full.explanation
    zero_accumulated = verdict(scaled(0.0))
    assert zero_accumulated.factor == 0 and not zero_accumulated.constant
    assert "the accumulated gradient is zero" in zero_accumulated.explanation
    nan = verdict(dict(scaled(0.25), **{"fc.bias": np.full(3, math.nan)}))
    assert nan.factor is None and not nan.constant and "not finite" in nan.explanation


def test_item_counts_are_told_and_matched():
    weighted = scaled({"embed.weight": 0.8, "fc.weight": 1.0, "fc.bias": 1.2})
    told = verdict(weighted, item_counts=[31, 58, 40, 44])
    assert told.item_counts == [31, 58, 40, 44]
    assert told.explanation.endswith("normalise by the window's item count; items per micro-batch: 31 to 58")
    even = verdict(weighted, item_counts=[32, 32, 32, 32])
    assert even.explanation.endswith("every micro-batch holds 32 items, so not by their item counts")
    summed = verdict(scaled(173.0), item_counts=[31, 58, 40, 44])  # summed over tokens, the full batch a mean
    assert summed.matches == "T" and "(T = 173 items in the window)" in summed.explanation
    divided = verdict(scaled(173 / 4), item_counts=[31, 58, 40, 44])
    assert divided.matches == "T/N"
    unknown = verdict(scaled(1.7), item_counts=[31, 58, 40, 44])
    assert "(N = 4, T = 173 items)" in unknown.explanation


def test_a_micro_batch_without_items_leaves_out_the_ratio_of_counts_only():
    names = [c.name for c in factor_candidates(4, 1, [0, 5, 3, 4])]
    assert names[4:] == ["T", "1/T", "T/N"]
    assert verdict(scaled(12.0), item_counts=[0, 5, 3, 4]).matches == "T"
    assert [c.name for c in factor_candidates(4, 1, [0, 0, 0, 0])] == ["N", "1/N", "N^2", "1/N^2"]
    assert factor_candidates(4, 1, [2, 4, 2, 2])[-1].name == "largest/smallest items"


def test_world_size_candidates_only_with_more_than_one_rank():
    assert [c.name for c in factor_candidates(4)] == ["N", "1/N", "N^2", "1/N^2"]
    assert [c.name for c in factor_candidates(4, 2)][4:] == ["W", "1/W", "N*W", "1/(N*W)"]
    assert verdict(scaled(0.5)).matches is None
    assert verdict(scaled(0.5), world_size=2).matches == "1/W"
    both = verdict(scaled(8.0), world_size=2)
    assert both.matches == "N*W" and "(N = 4, W = 2)" in both.explanation
    assert "1/(N*W) (N = 4, W = 2)" in verdict(scaled(1.7), world_size=2).explanation


def test_candidates_equal_to_one_say_nothing():
    assert [c.name for c in factor_candidates(1)] == []
    assert verdict(scaled(1 + 1e-8), steps=1).matches is None  # not equivalent, yet N = 1 explains nothing


def test_the_result_round_trips_and_a_result_of_an_earlier_version_loads():
    result = verdict(scaled(0.25), item_counts=[3, 4, 3, 4])
    assert decode(FullBatchResult, encode(result)) == result
    old = decode(FullBatchResult, {"normalisation": "mean", "accumulated_scaled_by": "1/N",
                                   "max_relative_difference": 0.125, "worst_tensor": "fc2.weight",
                                   "equivalent": False, "tolerance": 1e-9})
    assert old.explanation == "" and old.factor is None and old.headline == "" and old.tensor_factors == {}


def test_the_lines_say_what_the_accumulated_gradient_is():
    params = [ParamAccumulation(name, "weight", np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros(1),
                                np.zeros(1)) for name in FULL]
    run = RunResult(params=params, framework="torch", versions={}, device="cpu", param_dtype="float32",
                    accum_dtype="float32", full_batch=FullBatchGap("mean", "1/N", scaled(0.25), FULL))
    report = build_report(builtin_case("shared-weight"), run, 4, None, False, 0.0)
    assert report.exit_code == 1 and report.flagged == []
    assert summary_line(report).endswith("every tensor is numerically faithful): 0.250 x it on every tensor (1/N)")
    line = full_batch_line(report)
    assert line.endswith("SEMANTIC MISMATCH (the loss normalisation, not round-off): accumulated = 0.250 x full "
                         "batch on all 3 tensors (spread 0): matches 1/N (N = 4): the loss is divided by N once "
                         "more than the loss normalisation needs")
    assert line in markdown(report) and summary_line(report) in markdown(report)
    old = build_report(builtin_case("shared-weight"), run, 4, None, False, 0.0)
    old.full_batch = FullBatchResult("mean", "1/N", 0.75, "fc.weight", False, 1e-9)  # saved by an earlier version
    assert summary_line(old).endswith("numerically faithful)")
    assert full_batch_line(old).endswith("at fc.weight: SEMANTIC MISMATCH (the loss normalisation, not round-off)")
