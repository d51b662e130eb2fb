"""Property-based checks of the comparator's two claims: no false positives, no false negatives."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from accumcheck.bounds import ModeBound
from accumcheck.compare import compare_tensor

F32 = np.float32


@st.composite
def micro_gradients(draw):
    steps = draw(st.integers(1, 64))
    size = draw(st.integers(1, 40))
    exponent = draw(st.integers(-30, 30))
    # Finite float32 values of any magnitude (subnormals included), then a common scale;
    # sums stay far from float32 overflow.
    base = draw(arrays(F32, (steps, size), elements=st.floats(-1e3, 1e3, width=32)))
    if draw(st.booleans()):  # heavy cancellation: alternate signs of near-equal values
        base[1::2] = -base[0::2][: len(base[1::2])] * F32(1 + 1e-3)
    return (base.astype(np.float64) * 10.0**exponent).astype(F32)


def sequential(micro, order):
    total = np.zeros(micro.shape[1:], F32)
    for k in order:
        total += micro[k]
    return total


def pairwise(micro):
    if len(micro) == 1:
        return micro[0].copy()
    half = len(micro) // 2
    return (pairwise(micro[:half]) + pairwise(micro[half:])).astype(F32)


def exact_and_absum(micro):
    wide = micro.astype(np.float64)
    return wide.sum(0), np.abs(wide).sum(0)


@settings(max_examples=150, deadline=None)
@given(micro_gradients(), st.randoms(use_true_random=False))
def test_no_correct_summation_order_is_ever_flagged(micro, rnd):
    steps = len(micro)
    exact, absum = exact_and_absum(micro)
    order = list(range(steps))
    rnd.shuffle(order)
    bound = ModeBound.for_sum("float32", steps)
    for native in (sequential(micro, range(steps)), sequential(micro, order), pairwise(micro)):
        manual = sequential(micro, reversed(range(steps)))
        result = compare_tensor("t", "weight", native, manual, exact, absum, bound, bound)
        assert not result.flagged, (result.verdict, result.ratio)
        assert result.ratio <= 1.0


@settings(max_examples=150, deadline=None)
@given(micro_gradients(), st.data())
def test_a_dropped_step_beyond_the_bound_is_always_flagged(micro, data):
    steps = len(micro)
    exact, absum = exact_and_absum(micro)
    dropped = data.draw(st.integers(0, steps - 1))
    native = sequential(micro, [k for k in range(steps) if k != dropped])
    manual = sequential(micro, range(steps))
    bound = ModeBound.for_sum("float32", steps)
    # The fault is detectable only where its effect exceeds twice the bound (the error budget of
    # the faulty sum plus that of the reference); elsewhere the theorem allows it.
    visible = np.abs(micro[dropped].astype(np.float64)) > 2 * (bound.relative * absum + bound.absolute)
    result = compare_tensor("t", "weight", native, manual, exact, absum, bound, bound)
    if visible.any():
        assert result.verdict == "diverged" and result.worst_mode == "native"
