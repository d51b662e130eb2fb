"""accumcheck.judge.fullbatch on plain numpy arrays: equivalence, a constant factor and what it
matches, a weighting no constant explains, and how the result is saved and drawn."""

import math
import re

import numpy as np
import pytest

from accumcheck.case.reading import builtin_case
from accumcheck.judge import FACTOR_TOLERANCE, build_report, full_batch_verdict
from accumcheck.judge.candidates import factor_candidates, run_figures
from accumcheck.render.markdown import markdown
from accumcheck.render.wording import full_batch_line, summary_line
from accumcheck.report import FullBatchResult
from accumcheck.report.values import decode, encode
from accumcheck.run.results import FullBatchGap, ParamAccumulation, RunResult

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


def test_float32_rounding_inside_a_float64_model_is_equivalent_and_a_factor_beyond_it_is_not():
    """Llama's RMSNorm computes in float32 whatever the model's dtype: a window evaluated at other
    batch shapes rounds differently, 1e-8 of the gradient's scale, far from any normalisation."""
    rounded = {name: f * (1 + 5e-8 * (1 + 0.1 * RNG.standard_normal(f.shape))) for name, f in FULL.items()}
    result = verdict(rounded)
    assert 1e-9 < result.max_relative_difference < 1e-6
    assert result.equivalent and not result.constant and result.matches is None and result.headline == ""
    assert result.explanation.startswith("equivalent: accumulated = full batch within 1e-6 on every tensor, ")
    assert "float32" in result.explanation
    # Negative control: a constant 1 + 1e-5 is beyond the factor tolerance, so it is a factor.
    beyond = verdict(scaled(1 + 1e-5))
    assert not beyond.equivalent and beyond.constant and beyond.matches is None


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


def test_context_candidates_only_with_more_than_one_context():
    """A Gluon Trainer on C contexts in one process: C and 1/C, named as contexts, not ranks."""
    assert "C" not in [c.name for c in factor_candidates(4)]
    assert [c.name for c in factor_candidates(4, contexts=2)][4:] == ["C", "1/C"]
    gap = FullBatchGap("mean", "1/N", scaled(2.0), FULL)
    result = full_batch_verdict(gap, 4, contexts=2)
    assert result.matches == "C" and "(C = 2 contexts)" in result.explanation
    assert full_batch_verdict(gap, 4).matches is None  # 2 means nothing on one context with N = 4
    assert run_figures(4, contexts=3) == "N = 4, 3 contexts"


def test_two_of_the_runs_numbers_of_the_same_value_are_both_named():
    """N = C = 2: a factor of 2 is the division by N forgotten or trainer.step given one context's
    share; the verdict names the likelier first and does not hide the other."""
    result = full_batch_verdict(FullBatchGap("mean", "1/N", scaled(2.0), FULL), 2, contexts=2)
    assert result.matches == "N"
    assert "matches N (N = 2): the micro-batch losses are summed" in result.explanation
    assert "; or C (C = 2 contexts), the same number here: trainer.step's batch_size" in result.explanation
    assert "; or" not in full_batch_verdict(FullBatchGap("mean", "1/N", scaled(2.0), FULL), 2).explanation


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
    params = [ParamAccumulation(name, "weight", np.ones(1, np.float32), np.ones(1, np.float32), np.ones(1),
                                np.ones(1)) for name in FULL]
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


# Small whole numbers: a dyadic or whole factor times them, and their sums, are exact in float64, so
# every figure of the sentence is known exactly ("spread 0").
EXACT = {"embed.weight": np.array([[1.0, -2.0], [3.0, 1.0]]), "fc.bias": np.array([2.0, -1.0])}
HEAD = "x full batch on all 2 tensors (spread 0): matches"


@pytest.mark.parametrize("factor, world_size, item_counts, name, sentence", [
    (4.0, 1, None, "N", "4.00 {} N (N = 4): the micro-batch losses are summed without dividing by N"),
    (0.25, 1, None, "1/N", "0.250 {} 1/N (N = 4): the loss is divided by N once more than the loss normalisation "
     "needs"),
    (16.0, 1, None, "N^2", "16.0 {} N^2 (N = 4): the loss is multiplied by N where the normalisation divides by N"),
    (1 / 16, 1, None, "1/N^2", "0.0625 {} 1/N^2 (N = 4): the loss is divided by N twice more than the loss "
     "normalisation needs"),
    (2.0, 2, None, "W", "2.00 {} W (W = 2): the ranks' gradients are summed where the all-reduce averages them"),
    (0.5, 2, None, "1/W", "0.500 {} 1/W (W = 2): the gradient is divided by the world size once more than the "
     "all-reduce's average needs"),
    (8.0, 2, None, "N*W", "8.00 {} N*W (N = 4, W = 2): the losses are summed over the micro-batches and the ranks "
     "without dividing by either"),
    (1 / 8, 2, None, "1/(N*W)", "0.125 {} 1/(N*W) (N = 4, W = 2): the loss is divided by N x W once more than the "
     "loss normalisation needs"),
    (128.0, 1, [16, 48, 32, 32], "T", "128 {} T (T = 128 items in the window): the loss sums over the items where "
     "the full batch averages over them"),
    (1 / 128, 1, [16, 48, 32, 32], "1/T", "0.00781 {} 1/T (T = 128 items in the window): the loss is divided by "
     "the window's item count where the full batch sums over the items"),
    (32.0, 1, [16, 48, 32, 32], "T/N", "32.0 {} T/N (T = 128 items, N = 4): each micro-batch's loss sums over its "
     "items and the accumulated sum is divided by N, where the full batch averages over the items"),
    (3.0, 1, [16, 48, 32, 32], "largest/smallest items", "3.00 {} largest/smallest items (items per micro-batch 16 "
     "to 48): the largest micro-batch's item count over the smallest's"),
    (3.0, 1, [1, 3, 2, 2], "largest/smallest items", "3.00 {} largest/smallest items (items per micro-batch 1 to "
     "3): the largest micro-batch's item count over the smallest's"),
])
def test_each_number_of_the_run_a_constant_factor_matches_is_named_with_its_cause(factor, world_size, item_counts,
                                                                                  name, sentence):
    result = verdict(scaled(factor, EXACT), full=EXACT, world_size=world_size, item_counts=item_counts)
    assert result.constant and result.factor == factor and result.matches == name
    assert result.explanation == "accumulated = " + sentence.format(HEAD)
    assert result.factor_tolerance == FACTOR_TOLERANCE


def test_the_world_size_is_one_unless_told():
    gap = FullBatchGap("mean", "1/N", scaled(0.5, EXACT), EXACT)
    result = full_batch_verdict(gap, 4)
    assert result.constant and result.matches is None
    assert result.explanation == (f"accumulated = 0.500 {HEAD} none of N, 1/N, N^2, 1/N^2 (N = 4): the loss is "
                                  "scaled by a constant its normalisation does not have")
    assert run_figures(4) == "N = 4" and run_figures(4, 2, [3, 4]) == "N = 4, W = 2, T = 7 items"


def test_one_item_in_the_window_leaves_only_t_over_n_of_the_item_candidates():
    # T = 1 and 1/T = 1 say nothing; T/N is 1/N's value, which 1/N matches first
    result = verdict(scaled(1.5, EXACT), full=EXACT, item_counts=[0, 1, 0, 0])
    assert result.explanation == (f"accumulated = 1.50 {HEAD} none of N, 1/N, N^2, 1/N^2, T/N (N = 4, T = 1 items): "
                                  "the loss is scaled by a constant its normalisation does not have")
    assert verdict(scaled(0.25, EXACT), full=EXACT, item_counts=[0, 1, 0, 0]).matches == "1/N"


def test_a_factor_exactly_at_the_tolerance_matches():
    # 1e-6 x 15625 is 2^-6 exactly, so |c - T| is exactly FACTOR_TOLERANCE x T
    factor = 15625 + FACTOR_TOLERANCE * 15625
    assert factor - 15625 == FACTOR_TOLERANCE * 15625
    result = verdict({"w": np.array([factor])}, full={"w": np.array([1.0])}, item_counts=[3906, 3906, 3906, 3907])
    assert result.factor == factor and result.constant and result.matches == "T"
    assert result.explanation == ("accumulated = 1.56e+04 x full batch on all 1 tensors (spread 0): matches T "
                                  "(T = 15625 items in the window): the loss sums over the items where the full batch "
                                  "averages over them")


# c = <A,F>/<F,F> = (3 x 2 + 1 x 6) / 4 = 3: "a" is 1 from it, "b" 3, so the spread is 3/3 and b's residual 3/6
TWO = {"a": np.ones(3), "b": np.ones(1)}
TWO_WEIGHTED = {"a": np.full(3, 2.0), "b": np.full(1, 6.0)}
WEIGHTED_SENTENCE = ("not a constant factor: per-tensor factors 2.00 to 6.00 (worst b, residual 0.5): the "
                     "micro-batches are weighted unlike the full batch")
ITEM_COUNT_CAUSE = (", as per-micro-batch mean losses over micro-batches with different numbers of items do "
                    "(transformers#34191); normalise by the window's item count")


def test_a_weighting_is_told_with_its_range_its_worst_tensor_and_the_likely_cause():
    result = verdict(TWO_WEIGHTED, full=TWO)
    assert result.factor == 3.0 and result.tensor_factors == {"a": 2.0, "b": 6.0}
    assert (result.factor_min, result.factor_max, result.factor_worst_tensor) == (2.0, 6.0, "b")
    assert result.spread == 1.0 and result.residual == pytest.approx(0.5) and result.worst_tensor_residual == 0.5
    assert not result.constant and result.matches is None
    assert result.explanation == WEIGHTED_SENTENCE + ITEM_COUNT_CAUSE
    told = verdict(TWO_WEIGHTED, full=TWO, item_counts=[30, 50, 40, 40])
    assert told.explanation == WEIGHTED_SENTENCE + ITEM_COUNT_CAUSE + "; items per micro-batch: 30 to 50"


def test_one_micro_batch_with_its_item_count_is_not_weighted_by_item_counts():
    result = verdict(TWO_WEIGHTED, full=TWO, steps=1, item_counts=[32])
    assert result.explanation == WEIGHTED_SENTENCE + "; every micro-batch holds 32 items, so not by their item counts"


def test_the_worst_tensor_is_the_one_furthest_from_the_factor_below_it_too():
    # c = (3 x 2 + 0.5) / 4 = 1.625: "b" at 0.5 is 1.125 from it, "a" at 2 only 0.375
    result = verdict({"a": np.full(3, 2.0), "b": np.full(1, 0.5)}, full=TWO)
    assert result.factor == 1.625 and result.factor_worst_tensor == "b" and result.worst_tensor_residual == 2.25
    assert "(worst b, residual 2.2)" in result.explanation


def test_a_tensor_zero_in_both_is_never_the_worst():
    result = verdict(dict(TWO_WEIGHTED, unused=np.zeros(2)), full=dict(TWO, unused=np.zeros(2)))
    assert result.factor_worst_tensor == "b" and "unused" not in result.tensor_factors
    assert result.explanation == WEIGHTED_SENTENCE + ITEM_COUNT_CAUSE


def test_a_residual_of_a_thousand_is_written_with_a_short_exponent():
    # "b" is a thousandth of the full batch's where c is about 1: its residual is about 1000 times its size
    full = {"a": np.full(4, 100.0), "b": np.ones(1)}
    result = verdict({"a": np.full(4, 100.0), "b": np.full(1, 1e-3)}, full=full)
    assert result.factor_worst_tensor == "b" and result.worst_tensor_residual == pytest.approx(999, rel=1e-3)
    assert result.explanation.startswith("not a constant factor: per-tensor factors 0.00100 to 1.00 (worst b, "
                                         "residual 1e3): ")


def test_a_tensor_whose_accumulated_gradient_alone_is_zero_is_infinitely_far_from_it():
    full = {"a": np.full(4, 100.0), "b": np.ones(1)}
    result = verdict({"a": np.full(4, 100.0), "b": np.zeros(1)}, full=full)
    assert result.factor_worst_tensor == "b" and result.worst_tensor_residual == math.inf
    assert result.tensor_factors == {"a": 1.0, "b": 0.0} and 0 < result.residual < 1e-2
    assert result.explanation.startswith("not a constant factor: per-tensor factors 0.00 to 1.00 (worst b, "
                                         "residual inf): ")


def test_zero_and_non_finite_gradients_are_told_in_words():
    zero_full = verdict(scaled(1.0, EXACT), full={name: np.zeros_like(f) for name, f in EXACT.items()})
    assert zero_full.explanation == ("not a constant factor: the full batch's gradient is zero everywhere, the "
                                     "accumulated one is not")
    assert (zero_full.factor, zero_full.spread, zero_full.residual, zero_full.worst_tensor_residual) == (None,) * 4
    assert zero_full.tensor_factors == {} and zero_full.factor_worst_tensor == "" and zero_full.factor_min is None
    zero = verdict(scaled(0.0, EXACT), full=EXACT)
    assert zero.explanation == "not a constant factor: the accumulated gradient is zero where the full batch's is not"
    assert zero.factor == 0 and zero.spread is None  # no factor to be relative to
    assert zero.residual == 0 and zero.worst_tensor_residual == 0  # 0 of 0: A is all of cF
    assert not zero.constant and zero.headline == "not a constant factor"
    for bad in (math.nan, math.inf):
        result = verdict(dict(scaled(0.25, EXACT), **{"fc.bias": np.full(2, bad)}), full=EXACT)
        assert result.explanation == "not a constant factor: the gradients are not finite (inf or nan)"
        assert result.factor is None and result.spread is None and result.residual is None


def test_tiny_gradients_are_judged_at_their_own_scale():
    tiny = {name: 1e-12 * f for name, f in EXACT.items()}
    result = verdict(scaled(0.25, tiny), full=tiny)
    assert not result.equivalent and result.matches == "1/N"
    assert result.max_relative_difference == pytest.approx(0.75) and result.worst_tensor == "embed.weight"


def test_a_tensor_without_elements_is_left_out():
    full = dict(EXACT, empty=np.zeros((0, 3)))
    result = verdict(dict(scaled(0.25, EXACT), empty=np.zeros((0, 3))), full=full)
    assert result.matches == "1/N" and "empty" not in result.tensor_factors
    assert result.explanation.startswith(f"accumulated = 0.250 {HEAD} 1/N (N = 4)")


def test_a_run_without_gradients_has_nothing_to_differ():
    result = verdict({}, full={})
    assert result.equivalent and result.max_relative_difference == 0.0 and result.worst_tensor == ""
    assert result.factor is None and result.tensor_factors == {} and result.factor_min is None
    assert result.explanation == "equivalent: accumulated = full batch within 1e-9"


def test_float32_gradients_too_large_to_square_in_float32_are_fitted_in_float64():
    big = {name: (1e20 * f).astype(np.float32) for name, f in TWO.items()}
    weighted = {name: (1e20 * f).astype(np.float32) for name, f in TWO_WEIGHTED.items()}
    result = verdict(weighted, full=big)
    assert result.factor == 3.0 and result.spread == 1.0
    assert result.residual == pytest.approx(0.5) and result.worst_tensor_residual == pytest.approx(0.5)
    assert result.explanation == WEIGHTED_SENTENCE + ITEM_COUNT_CAUSE


def window_verdict(factor, micro_batches, steps=4, item_counts=None, predicted_counts=None) -> FullBatchResult:
    gap = FullBatchGap("the window as one batch", "1", scaled(factor), FULL, item_counts, predicted_counts)
    return full_batch_verdict(gap, steps, micro_batches=micro_batches)


def test_a_short_window_divided_by_n_is_k_over_n_and_summed_is_k():
    half = window_verdict(0.5, micro_batches=2)
    assert half.matches == "k/N" and half.explanation.endswith(
        "matches k/N (k = 2 micro-batches in a window of N = 4): the short window's losses are divided by N, not by "
        "the k micro-batches it holds")
    assert window_verdict(2.0, micro_batches=2).matches == "k"
    assert window_verdict(4.0, micro_batches=2).matches == "N"  # a short window summed like a full one
    assert [c.name for c in factor_candidates(4, micro_batches=3)][:2] == ["k/N", "k"]


def test_a_full_window_has_no_short_window_candidates():
    assert [c.name for c in factor_candidates(4, micro_batches=4)] == ["N", "1/N", "N^2", "1/N^2"]
    assert window_verdict(0.5, micro_batches=4).matches is None


def test_labels_counted_before_a_causal_shift_are_predicted_over_labelled():
    result = window_verdict(57 / 65, micro_batches=4, item_counts=[13, 18, 9, 25], predicted_counts=[11, 16, 7, 23])
    assert result.matches == "predicted/labelled"
    assert "57 predicted of 65 labelled tokens" in result.explanation and "transformers#46204" in result.explanation
    names = [c.name for c in factor_candidates(4, 1, [13, 18, 9, 25], None, [13, 18, 9, 25])]
    assert "predicted/labelled" not in names  # nothing shifted: no such candidate
    assert "predicted/labelled" not in [c.name for c in factor_candidates(4, 1, [13, 18, 9, 25], None, [0, 0, 0, 0])]


def test_a_nan_in_one_tensor_is_never_equivalent_whatever_the_others_say():
    broken = {**FULL, "fc.bias": np.full(3, np.nan)}
    result = verdict(broken)
    assert not result.equivalent and result.max_relative_difference == float("inf")
    assert result.worst_tensor == "fc.bias" and "not finite" in result.explanation


def test_a_short_window_summed_is_named_with_its_cause_in_full():
    assert window_verdict(2.0, micro_batches=2).explanation == (
        "accumulated = 2.00 x full batch on all 3 tensors (spread 0): matches k (k = 2 micro-batches in a window of "
        "N = 4): the short window's micro-batch losses are summed without dividing by k")
    assert [c.name for c in factor_candidates(4)] == ["N", "1/N", "N^2", "1/N^2"]  # no window told: no k


def test_the_causal_shift_is_named_with_its_cause_in_full_and_needs_a_predicted_label():
    result = window_verdict(0.4, micro_batches=4, item_counts=[2, 2, 1, 0], predicted_counts=[1, 1, 0, 0])
    # The spread's last bits come from dot products whose summation order follows the CPU's vector width.
    spread = re.search(r"\(spread ([^)]*)\)", result.explanation).group(1)
    assert float(spread) < 1e-15
    assert result.matches == "predicted/labelled" and result.explanation == (
        f"accumulated = 0.400 x full batch on all 3 tensors (spread {spread}): matches predicted/labelled "
        "(2 predicted of 5 labelled tokens): the loss is divided by the labelled tokens counted before the causal "
        "shift, which leaves each sequence's first label out of the loss (transformers#46204)")
    assert "predicted/labelled" not in [c.name for c in factor_candidates(4, 1, [2, 1], None, [0, 0])]
    assert "predicted/labelled" in [c.name for c in factor_candidates(4, 1, [2, 1], None, [1, 0])]
