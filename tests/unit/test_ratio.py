"""accumcheck.judge.ratio on hand-computed values: the ratio to the bound, its worst element, the
root-mean-square of S and the ratio map."""

import math
import warnings

import numpy as np
import pytest

from accumcheck.bounds import ModeBound
from accumcheck.judge.ratio import absum_rms, bound_ratios, ratio_map, ratios_to, unravel, worst_ratio

F32 = np.float32
QUARTER = ModeBound("float32", 1, 0.25, 0.0)  # |x - E| <= S / 4
ALLOWANCE = ModeBound("float32", 1, 0.5, 0.0, tensor=0.5)  # |x - E| <= S / 2 + S_rms / 2


def test_ratios_to_zero_and_non_finite_bounds():
    ratio = ratios_to(np.array([1.0, 0.0, 1.0, np.nan, np.inf]), np.array([4.0, 0.0, 0.0, 1.0, 1.0]))
    assert ratio.tolist() == [0.25, 0.0, math.inf, math.inf, math.inf]


def test_absum_rms():
    assert absum_rms(np.array([3.0, 4.0])) == math.sqrt(12.5)
    assert absum_rms(np.zeros(0)) == 0.0
    # Squared in float64 even from float32: (1 + 2^-12)^2 needs 25 bits.
    assert absum_rms(np.array([1.0 + 2.0**-12], F32)) == 1.0 + 2.0**-12


def test_bound_ratios_add_the_floor_and_take_the_tensor_allowance_from_s_rms():
    values, exact, absum = np.array([9.0, 8.0]), np.array([8.0, 9.0]), np.array([2.0, 6.0])
    bound = ModeBound("float32", 1, 0.25, 0.5, tensor=0.25)
    # bound = S/4 + 1/2 + S_rms/4: without S_rms [1, 2], with S_rms = 4 [2, 3]
    assert bound_ratios(values, exact, absum, bound).tolist() == [1.0, 0.5]
    assert bound_ratios(values, exact, absum, bound, 4.0).tolist() == [0.5, 1 / 3]


def test_bound_ratios_subtract_in_float64_whatever_the_inputs():
    # 1e8 - 1 rounds to 1e8 in float32; the difference must be exact.
    assert bound_ratios(np.array([1e8], F32), np.array([1.0], F32), np.array([4.0], F32), QUARTER).tolist() == [
        99999999.0]
    # S of float32 scaled by the float64 relative bound: 3 * gamma_1 is not a float32.
    bound = ModeBound.for_sum("float32", 2)
    s = np.array([3.0], F32)
    assert bound_ratios(np.array([1.0]), np.array([0.0]), s, bound)[0] == 1.0 / (bound.relative * 3.0 + bound.absolute)


def test_worst_ratio_and_its_place():
    assert worst_ratio(np.array([8.0, 9.0, 8.5]), np.full(3, 8.0), np.full(3, 4.0), QUARTER) == (1.0, 1)
    assert worst_ratio(np.zeros(0), np.zeros(0), np.zeros(0), QUARTER) == (0.0, -1)


def test_unravel():
    assert unravel(5, (2, 3)) == [1, 2] and unravel(0, [4]) == [0]
    assert unravel(-1, (2, 3)) == [] and unravel(0, ()) == []


def test_ratio_map_of_a_tall_matrix_in_cells_of_two_rows():
    exact, absum = np.full((33, 2), 8.0), np.full((33, 2), 4.0)
    native, manual = exact.copy(), exact.copy()
    native[0, 0], native[32, 1] = 9.0, 10.0  # ratios 1 and 2 against S/4 = 1
    manual[5, 0] = 11.0  # 3 against S/2 + S_rms/2 = 4: 0.75
    cells, cell = ratio_map(native, manual, exact, absum, QUARTER, ALLOWANCE)
    assert cell == [2, 1] and len(cells) == 17 and all(len(row) == 2 for row in cells)
    expected = [[0.0, 0.0] for _ in range(17)]
    expected[0][0], expected[2][0], expected[16][1] = 1.0, 0.75, 2.0  # row 32 shares its cell with padding
    assert cells == expected


def test_ratio_map_of_a_wide_matrix_in_cells_of_three_columns():
    exact = np.full((2, 65), 8.0)
    native = exact.copy()
    native[1, 64] = 8.5
    cells, cell = ratio_map(native, exact, exact, np.full((2, 65), 4.0), QUARTER, QUARTER)
    assert cell == [1, 3] and len(cells) == 2 and len(cells[0]) == 22
    assert cells[1][21] == 0.5 and sum(map(sum, cells)) == 0.5


def test_ratio_map_of_a_vector_is_one_row_and_of_more_dimensions_first_axis_by_the_rest():
    native = np.array([8.0, 8.25, 8.0, 8.0, 9.0])
    cells, cell = ratio_map(native, np.full(5, 8.0), np.full(5, 8.0), np.full(5, 4.0), QUARTER, QUARTER)
    assert cells == [[0.0, 0.25, 0.0, 0.0, 1.0]] and cell == [1, 1]
    native = np.full((2, 3, 4), 8.0)
    native[1, 2, 3] = 8.5
    cells, cell = ratio_map(native, np.full((2, 3, 4), 8.0), np.full((2, 3, 4), 8.0), np.full((2, 3, 4), 4.0),
                            QUARTER, QUARTER)
    assert cell == [1, 1] and len(cells) == 2 and len(cells[0]) == 12 and cells[1][11] == 0.5
    cells, cell = ratio_map(np.array(9.0), np.array(8.0), np.array(8.0), np.array(4.0), QUARTER, QUARTER)
    assert (cells, cell) == ([[1.0]], [1, 1])


@pytest.mark.parametrize("mode", ["native", "manual"])
def test_ratio_map_takes_each_mode_against_its_own_bound(mode):
    values = {"native": np.full(2, 8.0), "manual": np.full(2, 8.0)}
    values[mode][1] = 10.0
    bounds = {"native": QUARTER, "manual": ALLOWANCE}
    cells, _ = ratio_map(values["native"], values["manual"], np.full(2, 8.0), np.array([4.0, 8.0]),
                         bounds["native"], bounds["manual"])
    # S = [4, 8]: S/4 = 2 at [1]; S/2 + S_rms/2 = 4 + sqrt(40)/2
    assert cells == [[0.0, 1.0 if mode == "native" else 2.0 / (4.0 + math.sqrt(40.0) / 2)]]


def test_absum_rms_of_float32_squares_that_overflow_float32():
    big = F32(3e20)
    assert absum_rms(np.array([big, big], F32)) == float(big)


def test_worst_ratio_takes_the_rms_of_s_when_given():
    values, exact, absum = np.array([8.0, 10.0]), np.full(2, 8.0), np.array([4.0, 4.0])
    assert worst_ratio(values, exact, absum, ALLOWANCE) == (1.0, 1)  # S/2 alone: 2
    assert worst_ratio(values, exact, absum, ALLOWANCE, 4.0) == (0.5, 1)  # S/2 + 4/2 = 4


def test_ratio_map_gives_native_its_tensor_allowance_too():
    cells, _ = ratio_map(np.array([8.0, 10.0]), np.full(2, 8.0), np.full(2, 8.0), np.array([4.0, 8.0]), ALLOWANCE,
                         QUARTER)
    assert cells == [[0.0, 2.0 / (4.0 + math.sqrt(40.0) / 2)]]


def test_ratios_to_a_zero_bound_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ratios_to(np.array([1.0, 0.0]), np.array([0.0, 0.0])).tolist() == [math.inf, 0.0]


RATIO_VALUES = [0.0, 1.0, -2.5, 3e38, np.nan, np.inf, -np.inf, 1e-30]


@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_worst_ratio_is_the_largest_of_bound_ratios_and_its_first_place(seed):
    """float32 and float64 arrays go through one compiled pass: the same largest ratio as
    ``bound_ratios`` (nan excess infinite, 0/0 and inf/inf nought, a zero bound under an excess
    infinite) and the first index where it is, as ``np.argmax``; strided arrays the numpy way."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 12))
    pick = lambda: rng.choice(RATIO_VALUES + list(rng.standard_normal(4)), n)  # noqa: E731
    values = pick().astype(rng.choice([np.float32, np.float64]))
    exact, absum = pick(), np.abs(pick())
    bound = ModeBound("float32", 1, float(rng.choice([0.0, 0.25])), float(rng.choice([0.0, 1e-3])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ratios = bound_ratios(values, exact, absum, bound)
        expected = (float(ratios.max()), int(np.argmax(ratios))) if n else (0.0, -1)
    assert worst_ratio(values, exact, absum, bound) == expected
    strided = np.repeat(values, 2)[::2]
    assert not strided.flags.c_contiguous or n <= 1
    assert worst_ratio(strided, exact, absum, bound) == expected
