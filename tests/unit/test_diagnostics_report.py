"""accumcheck.diagnostics.report: which parameters dominate the gradient norm, and how the
dominance report reads (no framework)."""

import math

import numpy as np
import pytest

from accumcheck.diagnostics.report import DominanceEntry, DominanceReport, largest, rank


def test_the_report_reads_each_entry_share_norm_and_largest_element():
    report = DominanceReport(step=7, reason="gradient norm above 10", total_norm=12.3456, clip_coef=0.081,
                             entries=[DominanceEntry("a.w", 0.25, 3.0, 0.5, [1, 0], -2.0, 0),
                                      DominanceEntry("b.w", math.nan, math.inf, 1.0, [3], math.nan, 2)])
    assert report.lines() == [
        "step 7: gradient norm above 10; total gradient norm 12.35, clip scale 0.081; dominated by:",
        "  a.w: 25.0% of the sum of squares, norm 3, param rms 0.5, largest |grad| -2 at (1, 0)",
        "  b.w: non-finite, norm inf, param rms 1, largest |grad| nan at (3,), 2 non-finite",
    ]
    assert str(report) == "\n".join(report.lines())
    assert DominanceReport(0, "asked", 0.0, 1.0).lines() == [
        "step 0: asked; total gradient norm 0, clip scale 1; dominated by:"]


def test_a_sharded_entry_tells_its_share_and_norm_without_whole_tensor_figures():
    # under FSDP2 or ZeRO each rank holds a shard: no rank knows the whole tensor's rms or largest element
    report = DominanceReport(step=3, reason="clipped", total_norm=5.0, clip_coef=0.2,
                             entries=[DominanceEntry("blocks.2.w", 0.999, 4.99, math.nan, [], math.nan, 0)])
    assert report.lines()[1] == "  blocks.2.w: 99.9% of the sum of squares, norm 4.99"


def test_rank_puts_non_finite_norms_first_then_the_largest_shares():
    ranked = rank(["a", "b", "c", "d"], np.array([3.0, 4.0, np.inf, 0.0]), 3)
    assert [i for i, _ in ranked] == [2, 1, 0]
    assert math.isnan(ranked[0][1])
    assert ranked[1:] == [(1, 16 / 25), (0, 9 / 25)]  # shares of 3^2 + 4^2, the finite norms
    assert rank(["a", "b", "c"], [np.nan, 1.0, -np.inf], 2)[1][0] == 2  # every non-finite one before
    assert rank(["a", "b"], [1.0, 2.0], 5) == [(1, 0.8), (0, 0.2)]  # top_k beyond the list: all of it


def test_rank_of_all_zero_norms_gives_zero_shares_in_model_order():
    assert rank(["a", "b", "c"], [0.0, 0.0, 0.0], 2) == [(0, 0.0), (1, 0.0)]


def test_largest_finds_the_largest_magnitude_and_its_place():
    grad = np.array([[1.0, -5.0], [2.0, 4.0]], np.float32)
    assert largest(grad) == ([0, 1], -5.0, 0)
    assert largest(np.array(3.0)) == ([], 3.0, 0)  # a scalar has no index


def test_largest_points_at_the_first_non_finite_element_and_counts_them():
    grad = np.array([[1.0, 1e30], [np.inf, np.nan]])
    where, value, bad = largest(grad)
    assert (where, value, bad) == ([1, 0], math.inf, 2)
    where, value, bad = largest(np.array([np.nan, -np.inf, 7.0]))
    assert where == [0] and math.isnan(value) and bad == 2


def test_largest_of_an_empty_gradient_is_nowhere():
    assert largest(np.zeros((0, 3), np.float32)) == ([], 0.0, 0)


def test_rank_squares_float32_norms_in_float64_and_shares_a_total_below_one():
    norms = np.array([1.0 + 2.0**-12, 1.0], np.float32)  # (1 + 2^-12)^2 needs 25 bits
    a = (1.0 + 2.0**-12) ** 2
    assert rank(["a", "b"], norms, 2) == [(0, a / (a + 1.0)), (1, 1.0 / (a + 1.0))]
    (first, share_b), (second, share_a) = rank(["a", "b"], [0.3, 0.4], 2)  # a total of 0.25
    assert (first, second) == (1, 0) and (share_b, share_a) == (pytest.approx(0.64), pytest.approx(0.36))
